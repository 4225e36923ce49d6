"""What one role does: a full-pipeline pool, batching, simulation, reference images, adapters, the
model's layout, and no flag a role would ignore."""

from __future__ import annotations

import dataclasses

from triptych.config import (
    BATCHING_MODES,
    DTYPES,
    ConfigError,
    ServeArgs,
)
from triptych.flag_roles import first_unused, refusal
from triptych.parallelism import ParallelismError
from triptych.roles import FULL_PIPELINE_ROLE, WORKER_ROLES, Role
from triptych.serve_help import flag

# What only moving tensors uses, which a full-pipeline worker does not (no Mooncake engine, no pool).
TRANSFER_FLAGS = ("disagg_ib_device", "disagg_transfer_pool_size", "disagg_transfer_listen_any", "disagg_load_ahead")


def check_full_pipeline(args: ServeArgs) -> None:
    if not args.disagg_full_pipeline:
        return
    if args.disagg_role is not FULL_PIPELINE_ROLE:
        raise ConfigError(
            f"--disagg-full-pipeline is for --disagg-role {FULL_PIPELINE_ROLE} (a full-pipeline pool), "
            f"not {args.disagg_role}"
        )
    if args.simulate:
        raise ConfigError("--disagg-full-pipeline does not support --simulate; simulate the role pools instead")
    given = [name for name in TRANSFER_FLAGS if getattr(args, name) != getattr(ServeArgs, name)]
    if given:
        raise ConfigError(
            f"{flag(given[0])} does nothing with --disagg-full-pipeline: a full-pipeline worker moves no tensors "
            "(no Mooncake engine, no transfer pool); drop it"
        )


def check_batching(args: ServeArgs) -> None:
    if args.batching_mode not in BATCHING_MODES:
        raise ConfigError(f"--batching-mode {args.batching_mode!r} is not one of {', '.join(BATCHING_MODES)}")
    if args.batching_max_size < 1:
        raise ConfigError(f"--batching-max-size {args.batching_max_size} must be >= 1 (1: no batching)")
    if not args.batching_delay_ms >= 0:  # NaN too
        raise ConfigError(f"--batching-delay-ms {args.batching_delay_ms} must be >= 0 milliseconds")
    head_only = [f for f in ("batching_mode", "batching_delay_ms", "batching_role_delay_ms",
                             "enable_batching_metrics") if getattr(args, f) != getattr(ServeArgs, f)]  # fmt: skip
    if head_only and args.disagg_role is not Role.SERVER:
        raise ConfigError(f"{flag(head_only[0])} is for the head (--disagg-role server), not {args.disagg_role}")
    if args.disagg_role is Role.SERVER and args.batching_mode != "dynamic":  # the head forms no groups
        _refuse_grouping_flags(args)
    args.role_batching_delays_ms()  # raises naming the entry
    if args.batching_max_size > 1 and args.disagg_role is Role.MONOLITHIC:
        raise ConfigError("--batching-max-size is for --disagg-role server and its workers; monolithic mode "
                          "runs one request at a time")  # fmt: skip


def _refuse_grouping_flags(args: ServeArgs) -> None:
    """A head without --batching-mode dynamic forms no groups: the flags that size, wait for or
    measure them would do nothing there."""
    if args.batching_max_size > 1:
        raise ConfigError(
            f"--batching-max-size {args.batching_max_size} on --disagg-role server does nothing without "
            "--batching-mode dynamic (the head groups requests only then): add --batching-mode dynamic, or "
            "drop it and give --batching-max-size to the workers only"
        )
    grouping = [
        f
        for f in ("batching_delay_ms", "batching_role_delay_ms", "enable_batching_metrics")
        if getattr(args, f) != getattr(ServeArgs, f)
    ]
    if grouping:
        raise ConfigError(
            f"{flag(grouping[0])} on --disagg-role server does nothing without --batching-mode dynamic (the head "
            "forms no groups to wait for or measure): add --batching-mode dynamic, or drop it"
        )


def check_reference_urls(args: ServeArgs) -> None:
    from triptych.reference import parse_networks

    try:
        parse_networks(args.reference_url_networks)
    except ValueError as exc:
        raise ConfigError(f"--reference-url-networks: {exc}") from None


def check_simulation(args: ServeArgs) -> None:
    timing = [f for f in ("simulate_seconds", "simulate_seconds_per_unit") if getattr(args, f) is not None]
    if args.simulate and not args.disagg_role.is_worker:
        workers = ", ".join(role.value for role in WORKER_ROLES)
        raise ConfigError(f"--simulate is for worker roles ({workers}), not {args.disagg_role}")
    if timing and not args.simulate:
        raise ConfigError(f"{flag(timing[0])} only applies with --simulate")
    if args.simulate and args.dtype not in ("auto", "float32"):
        raise ConfigError(
            f"--dtype {args.dtype} does nothing with --simulate: a simulated worker loads no model and emits "
            "float32 tensors; leave --dtype out"
        )
    for name in timing:
        if getattr(args, name) < 0:
            raise ConfigError(f"{flag(name)} {getattr(args, name)} must be >= 0 seconds")


def check_flags_taken(args: ServeArgs) -> None:
    # No flag silently ignored: one a role does not use is refused (the table: triptych.flag_roles).
    defaults = ServeArgs(model_path="")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    unused = first_unused(values, {n: getattr(defaults, n) for n in values}, args.disagg_role)
    if unused is not None:
        raise ConfigError(refusal(unused, args.disagg_role))


def check_lora(args: ServeArgs) -> None:
    from triptych.lora import parse_entries

    try:
        parse_entries(args.lora)  # the --lora-catalog file is the process's to read (and re-read): not here
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.lora_catalog is not None and not args.lora_catalog.strip():
        raise ConfigError("--lora-catalog is empty: give the path of a file of NAME=SOURCE lines")
    if args.lora_cache_bytes < 1:
        raise ConfigError(f"--lora-cache-bytes {args.lora_cache_bytes} must be > 0; use e.g. 2GiB")


def check_model_layout(args: ServeArgs) -> None:
    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}")
    try:
        args.parallelism()
    except ParallelismError as exc:
        raise ConfigError(str(exc)) from None
