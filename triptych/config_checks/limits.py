"""Numbers, sizes, time limits and capacities: each finite, in range and of the sign it needs."""

from __future__ import annotations

import dataclasses
import math

from triptych.config import (
    MAX_NUMBER,
    MAX_SIZE,
    MIB,
    MIN_DISCOVERY_INTERVAL_S,
    SIZE_FIELDS,
    ConfigError,
    ServeArgs,
)
from triptych.liveness import HEARTBEAT_INTERVAL_S, MIN_HEARTBEAT_TIMEOUT_S
from triptych.serve_help import flag


def check_numbers(args: ServeArgs) -> None:
    """Every number flag is finite and below MAX_NUMBER (a size below MAX_SIZE): NaN passes every
    `x <= 0` check below and then never times out, or times out at once; infinity overflows the
    clocks' waits; a whole number past 64 bits fails the first heartbeat that carries it."""
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= MAX_NUMBER):
            raise ConfigError(f"{flag(f.name)} {value} must be a finite number (at most {MAX_NUMBER:g})")
        if isinstance(value, int) and not isinstance(value, bool):
            limit = f"{MAX_SIZE >> 50}PiB" if f.name in SIZE_FIELDS else f"{MAX_NUMBER:.0f}"
            if abs(value) > (MAX_SIZE if f.name in SIZE_FIELDS else MAX_NUMBER):
                raise ConfigError(f"{flag(f.name)} {value} is out of range (at most {limit})")


def check_transfer(args: ServeArgs) -> None:
    if args.disagg_transfer_pool_size < MIB:
        raise ConfigError(
            f"--disagg-transfer-pool-size {args.disagg_transfer_pool_size} is below 1 MiB; use e.g. 256MiB"
        )
    if args.disagg_load_ahead < 0:
        raise ConfigError(
            f"--disagg-load-ahead {args.disagg_load_ahead} must be >= 0 (0: the computing thread copies its own inputs)"
        )
    if args.disagg_transfer_listen_any and not args.disagg_role.is_worker:
        raise ConfigError(
            f"--disagg-transfer-listen-any is for worker roles, not --disagg-role {args.disagg_role.value}"
        )


def check_time_limits(args: ServeArgs) -> None:
    if args.disagg_timeout <= 0:
        raise ConfigError(f"--disagg-timeout {args.disagg_timeout} must be > 0 seconds")
    if not args.disagg_heartbeat_timeout >= MIN_HEARTBEAT_TIMEOUT_S:  # NaN too
        raise ConfigError(
            f"--disagg-heartbeat-timeout {args.disagg_heartbeat_timeout:g} is below twice the workers' "
            f"{HEARTBEAT_INTERVAL_S:g} s heartbeat interval, so a worker whose heartbeat is a little late "
            f"would count as lost: use at least {MIN_HEARTBEAT_TIMEOUT_S:g}"
        )
    if args.disagg_discovery_interval < MIN_DISCOVERY_INTERVAL_S:
        raise ConfigError(
            f"--disagg-discovery-interval {args.disagg_discovery_interval} must be at least "
            f"{MIN_DISCOVERY_INTERVAL_S:g} seconds (each pass resolves every worker list's names)"
        )
    if args.disagg_max_retries < 0:
        raise ConfigError(f"--disagg-max-retries {args.disagg_max_retries} must be >= 0 (0: never retry)")
    if args.disagg_no_instance_wait <= 0:
        raise ConfigError(f"--disagg-no-instance-wait {args.disagg_no_instance_wait} must be > 0 seconds")
    if not args.disagg_priority_aging > 0:
        raise ConfigError(
            f"--disagg-priority-aging {args.disagg_priority_aging} must be > 0 seconds (the wait that raises a "
            "request one priority level, so that none waits forever)"
        )
    if args.results_max_age <= 0:
        raise ConfigError(f"--results-max-age {args.results_max_age} must be > 0 seconds")
    if args.results_max_bytes < 1:  # 0 is no "unlimited": the retention sweep deleted every result within a minute
        raise ConfigError(
            f"--results-max-bytes {args.results_max_bytes} must be > 0 (the bytes of results the head keeps); "
            "use e.g. 5GiB"
        )


def check_capacity(args: ServeArgs) -> None:
    if args.num_gpus < 1 or args.base_gpu_id < 0:
        raise ConfigError("--num-gpus must be >= 1 and --base-gpu-id >= 0")
    if args.worker_capacity < 1:
        raise ConfigError(f"--worker-capacity {args.worker_capacity} must be >= 1")
    if args.disagg_drain_timeout <= 0:
        raise ConfigError(f"--disagg-drain-timeout {args.disagg_drain_timeout} must be > 0 seconds")
    if args.encoder_cache_bytes < 0:
        raise ConfigError(f"--encoder-cache-bytes {args.encoder_cache_bytes} must be >= 0 (0: no cache)")
