"""What `triptych serve`'s flag values may be, checked together: each check raises ConfigError naming
the flag, its value and the fix. ServeArgs.validate runs CHECKS in order (the values: config.py)."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
from collections.abc import Callable
from urllib.parse import SplitResult, urlsplit

from triptych.config import (
    BATCHING_MODES,
    DTYPES,
    MAX_NUMBER,
    MAX_PRESIGN_S,
    MAX_SIZE,
    MIB,
    MIN_DISCOVERY_INTERVAL_S,
    S3_BUCKET,
    SIZE_FIELDS,
    URL_FLAGS,
    ConfigError,
    ServeArgs,
    parse_endpoint_spec,
    parse_urls,
)
from triptych.flag_roles import first_unused, refusal
from triptych.liveness import HEARTBEAT_INTERVAL_S, MIN_HEARTBEAT_TIMEOUT_S
from triptych.parallelism import ParallelismError
from triptych.ports import DEFAULT_MASTER_PORT_OFFSET, MAX_RESULT_PORT_OFFSET, is_loopback, parse_tcp_endpoint
from triptych.roles import FULL_PIPELINE_ROLE, WORKER_ROLES, Role, is_full_pipeline
from triptych.serve_help import flag


def url_port_ok(parts: SplitResult) -> bool:
    """Whether a URL's port, if it has one, is a TCP port (urlsplit raises on reading a bad one)."""
    try:
        return parts.port is None or parts.port > 0
    except ValueError:
        return False


def http_endpoint(url: str) -> SplitResult | None:
    """`url` split, if it is http(s)://HOST[:PORT]... with a valid port; None if it is not."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or not url_port_ok(parts):
        return None
    return parts


# Numbers and ports


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


def check_ports(args: ServeArgs) -> None:
    for name in ("scheduler_port", "port") + (("master_port",) if args.master_port is not None else ()):
        value = getattr(args, name)
        if not 1 <= value <= 65535:
            raise ConfigError(f"{flag(name)} {value} is not a TCP port (1-65535)")
    if args.disagg_role is Role.SERVER and args.scheduler_port + MAX_RESULT_PORT_OFFSET > 65535:
        raise ConfigError(
            f"--scheduler-port {args.scheduler_port} leaves no room for the result ports "
            f"(+1..+{MAX_RESULT_PORT_OFFSET})"
        )
    _check_port_clashes(args)


def _check_port_clashes(args: ServeArgs) -> None:
    """Two sockets of this process on one port: the second bind would fail after the model loaded."""
    if args.disagg_role is Role.SERVER:
        taken = range(args.scheduler_port, args.scheduler_port + MAX_RESULT_PORT_OFFSET + 1)
        if args.port in taken:
            raise ConfigError(
                f"--port {args.port} is one of the head's control ports (--scheduler-port {args.scheduler_port} "
                f"and its result ports +1..+{MAX_RESULT_PORT_OFFSET}); give the HTTP API another port"
            )
    derived = args.scheduler_port + DEFAULT_MASTER_PORT_OFFSET
    if args.disagg_role.is_worker and args.num_gpus > 1 and args.master_port is None and derived > 65535:
        raise ConfigError(
            f"--scheduler-port {args.scheduler_port}: the ranks meet on it + {DEFAULT_MASTER_PORT_OFFSET} "
            f"({derived}), not a TCP port; give --master-port"
        )
    if args.master_port is not None and args.master_port == args.scheduler_port:
        raise ConfigError(
            f"--master-port {args.master_port} is also --scheduler-port (this worker's work port); give another"
        )


# A host name (RFC 1123 labels, not all digits at the end: 192.0.2.300 is no name) or a Kubernetes
# $(VAR) reference, which the kubelet replaces before the process starts (the operator's $(POD_IP)).
HOST_NAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\.)*(?![0-9]+\.?$)"
                       r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\.?")  # fmt: skip
VAR_REFERENCE = re.compile(r"\$\([A-Za-z_][A-Za-z0-9_]*\)")


def is_bind_address(host: str) -> bool:
    """Whether `host` can name this machine's address: an IP address (IPv6 with or without brackets),
    a host name or a $(VAR) reference."""
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        return True
    except ValueError:
        return bool(HOST_NAME.fullmatch(host) or VAR_REFERENCE.fullmatch(host))


def check_bind_addresses(args: ServeArgs) -> None:
    """--host and --disagg-p2p-hostname are addresses this process binds: one that is not an address or
    a name fails the bind only after the model loaded (an empty --host would bind every address)."""
    for name in ("host", "disagg_p2p_hostname"):
        value = getattr(args, name)
        if not is_bind_address(value):
            raise ConfigError(
                f"{flag(name)} {value!r} is not an IP address or a host name; give e.g. 127.0.0.1, 0.0.0.0 or "
                "the pod's IP"
            )


# Who talks to whom: the head's name, a worker's heads, the head's worker lists


def check_served_model_name(args: ServeArgs) -> None:
    if args.served_model_name is None:
        return
    if args.disagg_role.is_worker:
        raise ConfigError(f"--served-model-name is for the head (server or monolithic), not {args.disagg_role.value}")
    if not args.served_model_name.strip():
        raise ConfigError("--served-model-name is empty: give the id clients send as `model`")


def check_server_addr(args: ServeArgs) -> None:
    role = args.disagg_role
    if role.is_worker and not args.disagg_server_addr:
        raise ConfigError(f"--disagg-role {role.value} needs --disagg-server-addr tcp://HEAD:SCHEDULER_PORT")
    if not args.disagg_server_addr:
        return
    if not role.is_worker:
        raise ConfigError(f"--disagg-server-addr is only for worker roles, not --disagg-role {role.value}")
    try:  # one head, or several (replicated heads): the forms of the head's worker lists
        specs = parse_urls(args.disagg_server_addr)
        for spec in specs:
            parse_endpoint_spec(spec)
    except ValueError as exc:
        raise ConfigError(f"--disagg-server-addr: {exc}") from None
    if not specs:
        raise ConfigError("--disagg-server-addr is empty: give tcp://HEAD:SCHEDULER_PORT")
    if twice := next((spec for i, spec in enumerate(specs) if spec in specs[:i]), None):
        raise ConfigError(f"--disagg-server-addr: {twice} is listed twice; give each head once")
    for spec in specs:  # a worker reports on the head's result port for its role: up to +5
        if not spec.startswith("tcp://"):
            continue
        host, port = parse_tcp_endpoint(spec)
        if port + MAX_RESULT_PORT_OFFSET > 65535:
            raise ConfigError(
                f"--disagg-server-addr {spec}: a head's --scheduler-port leaves room for its result ports "
                f"(+1..+{MAX_RESULT_PORT_OFFSET}), so it is at most {65535 - MAX_RESULT_PORT_OFFSET}"
            )
        _check_work_port_is_not_the_head_s(args, spec, host, port)


def _check_work_port_is_not_the_head_s(args: ServeArgs, spec: str, host: str, port: int) -> None:
    """A worker on its head's address binds its work port (--scheduler-port) where the head binds its
    frontend and result ports: it would fail only at that bind, after its model loaded."""
    if not _same_address(host, args.disagg_p2p_hostname):
        return
    if port <= args.scheduler_port <= port + MAX_RESULT_PORT_OFFSET:
        raise ConfigError(
            f"--scheduler-port {args.scheduler_port}: this worker's work port is one of its head's ports on the "
            f"same address ({spec}: frontend {port}, result ports {port + 1}-{port + MAX_RESULT_PORT_OFFSET}); "
            "give the worker a --scheduler-port of its own (e.g. 19000)"
        )


def _same_address(a: str, b: str) -> bool:
    """Whether two hosts surely name one address, without a DNS lookup (a check at parse time must not
    wait on one): `localhost` is 127.0.0.1 (RFC 6761 makes it loopback everywhere; whether a socket
    takes ::1 for it instead depends on the host, so that pair is left to the bind to find)."""
    return _address(a) == _address(b)


def _address(host: str) -> str:
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def check_worker_lists(args: ServeArgs) -> None:
    given = [r for r in URL_FLAGS if args.urls_for(r)]
    if args.disagg_role is not Role.SERVER:
        if given:
            names = ", ".join(flag(URL_FLAGS[r]) for r in given)
            raise ConfigError(f"{names} only apply to --disagg-role server, not {args.disagg_role.value}")
        return
    if not is_full_pipeline(set(given)):  # only denoisers: a full-pipeline pool (--disagg-full-pipeline)
        _check_role_pools(given)
    seen: dict[str, Role] = {}
    for role in given:
        for url in args.urls_for(role):
            try:
                parse_endpoint_spec(url)
            except ValueError as exc:
                raise ConfigError(f"{flag(URL_FLAGS[role])}: {exc}") from None
            if seen.get(url) is role:
                raise ConfigError(f"{flag(URL_FLAGS[role])}: {url} is listed twice; give each worker once")
            if url in seen:
                raise ConfigError(
                    f"{url} is listed for both {seen[url].value} and {role.value}; each worker has one role"
                )
            seen[url] = role
            _check_worker_reaches_results(args, role, url)


def _check_role_pools(given: list[Role]) -> None:
    if Role.DENOISER not in given or Role.DECODER not in given:
        raise ConfigError(
            "--disagg-role server needs --denoiser-urls and --decoder-urls (semicolon-separated), or only "
            "--denoiser-urls for a full-pipeline pool (workers started with --disagg-full-pipeline)"
        )
    split = Role.PROMPT_ENCODER in given or Role.IMAGE_ENCODER in given
    if split and Role.ENCODER in given:
        raise ConfigError("give either --encoder-urls or --prompt-encoder-urls/--image-encoder-urls, not both")
    if not split and Role.ENCODER not in given:
        raise ConfigError("--disagg-role server needs --encoder-urls (or --prompt-encoder-urls)")
    if split and Role.PROMPT_ENCODER not in given:
        raise ConfigError("--image-encoder-urls needs --prompt-encoder-urls as well")


def _check_worker_reaches_results(args: ServeArgs, role: Role, url: str) -> None:
    """A worker reports (heartbeats, results) to the head's result sockets, which bind --host: a
    worker on another host never reaches a loopback --host, so its instance would never come up.
    Only a tcp:// endpoint names its host; dns:// and file:// lists may resolve anywhere."""
    if not url.startswith("tcp://") or not is_loopback(args.host):
        return
    host, _ = parse_tcp_endpoint(url)
    if is_loopback(host):
        return
    raise ConfigError(
        f"{flag(URL_FLAGS[role])} {url} is on another host, but --host {args.host} binds the head's result "
        f"sockets to loopback, which that {role.value} cannot reach (its heartbeats never arrive): pass "
        "--host with an address the workers reach (or 0.0.0.0), with --disagg-keys-dir DIR"
    )


def check_control_security(args: ServeArgs) -> None:
    if args.disagg_keys_dir is not None and not args.disagg_keys_dir.strip():  # not "no keys" by mistake
        raise ConfigError(
            "--disagg-keys-dir is empty: give the folder `triptych keys generate DIR` wrote, or leave the flag out"
        )
    if args.disagg_keys_dir and args.disagg_insecure:
        raise ConfigError("give --disagg-keys-dir or --disagg-insecure, not both")
    address = args.control_bind_address()
    if address is None or args.disagg_keys_dir or args.disagg_insecure or is_loopback(address):
        return
    which = "--host" if args.disagg_role is Role.SERVER else "--disagg-p2p-hostname"
    raise ConfigError(
        f"{which} {address} is reachable from other hosts and the control plane has no keys: give "
        "--disagg-keys-dir DIR (`triptych keys generate DIR` writes one) or, on a trusted network, "
        "--disagg-insecure"
    )


# Transfers, time limits and capacities


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


def check_capacity(args: ServeArgs) -> None:
    if args.num_gpus < 1 or args.base_gpu_id < 0:
        raise ConfigError("--num-gpus must be >= 1 and --base-gpu-id >= 0")
    if args.worker_capacity < 1:
        raise ConfigError(f"--worker-capacity {args.worker_capacity} must be >= 1")
    if args.disagg_drain_timeout <= 0:
        raise ConfigError(f"--disagg-drain-timeout {args.disagg_drain_timeout} must be > 0 seconds")
    if args.encoder_cache_bytes < 0:
        raise ConfigError(f"--encoder-cache-bytes {args.encoder_cache_bytes} must be >= 0 (0: no cache)")


# Where results and traces go


def check_output_path(args: ServeArgs) -> None:
    if not args.output_path.strip():
        raise ConfigError("--output-path is empty: give the folder the head keeps URL images and videos in")


def check_results_store(args: ServeArgs) -> None:
    given = [f for f in ("results_store", "results_s3_endpoint", "results_presign") if getattr(args, f)]
    if given and args.disagg_role.is_worker:
        raise ConfigError(f"{flag(given[0])} is for the head (server or monolithic), not {args.disagg_role}")
    if args.results_store is not None:
        parts = urlsplit(args.results_store)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise ConfigError(
                f"--results-store {args.results_store!r} is not s3://BUCKET/PREFIX (for a shared folder, "
                "mount it and give --output-path instead)"
            )
        if not S3_BUCKET.fullmatch(parts.netloc):
            raise ConfigError(
                f"--results-store {args.results_store!r}: {parts.netloc!r} is not an S3 bucket name "
                "(3-63 lowercase letters, digits, dots and hyphens)"
            )
    elif args.results_s3_endpoint or args.results_presign:
        which = "--results-s3-endpoint" if args.results_s3_endpoint else "--results-presign"
        raise ConfigError(f"{which} only applies with --results-store s3://BUCKET/PREFIX")
    if args.results_s3_endpoint is not None:
        parts_or_none = http_endpoint(args.results_s3_endpoint)
        if parts_or_none is None or parts_or_none.path.strip("/") or parts_or_none.query:
            raise ConfigError(
                f"--results-s3-endpoint {args.results_s3_endpoint!r} is not http(s)://HOST[:PORT] "
                "(the bucket goes in --results-store)"
            )
    if not 0 <= args.results_presign <= MAX_PRESIGN_S:
        raise ConfigError(
            f"--results-presign {args.results_presign} must be between 0 (the head proxies content) and "
            f"{MAX_PRESIGN_S} seconds (S3's longest)"
        )


def check_otlp_endpoint(args: ServeArgs) -> None:
    if args.otlp_endpoint and http_endpoint(args.otlp_endpoint) is None:
        raise ConfigError(
            f"--otlp-endpoint {args.otlp_endpoint!r} is not http(s)://HOST:PORT, an OTLP/HTTP collector "
            "(traces go to its /v1/traces)"
        )


# What one role does: pipelines, HTTP, batching, simulation, adapters, the model's layout


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


def both_or_neither(args: ServeArgs, first: str, second: str, why: str) -> None:
    """Two flags (ServeArgs fields) given together or not at all: one alone is refused, naming the other."""
    if (getattr(args, first) is None) != (getattr(args, second) is None):
        given, missing = (first, second) if getattr(args, second) is None else (second, first)
        raise ConfigError(f"{flag(given)} needs {flag(missing)} too ({why})")


def check_webhook(args: ServeArgs) -> None:
    """--webhook-url and --webhook-secret-file come together (an unsigned event could be anyone's), the
    URL an absolute http(s) one. The secret's form is checked where it is read (triptych_head.webhooks)."""
    both_or_neither(args, "webhook_url", "webhook_secret_file", "webhooks are always signed")
    if args.webhook_url is not None:
        try:
            parts = urlsplit(args.webhook_url)
            usable = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:  # e.g. an unclosed [ of an IPv6 address
            usable = False
        if not usable:
            raise ConfigError(
                f"--webhook-url {args.webhook_url!r} is not an http(s) URL; give e.g. https://hooks.example.com/triptych"
            )


def check_http_limits(args: ServeArgs) -> None:
    head_only = [
        f
        for f in ("api_keys_file", "max_queued_requests", "webhook_url", "webhook_secret_file")
        if getattr(args, f) is not None
    ]
    if head_only and args.disagg_role.is_worker:
        raise ConfigError(f"{flag(head_only[0])} is for the head (server or monolithic), not {args.disagg_role}")
    if args.api_keys_file is not None and not args.api_keys_file.strip():  # the API would be open, unasked
        raise ConfigError(
            "--api-keys-file is empty: give the file of API keys (one per line), or leave the flag out for an "
            "API without keys"
        )
    if args.max_request_bytes < 1024:
        raise ConfigError(f"--max-request-bytes {args.max_request_bytes} is below 1KiB; use e.g. 16MiB")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ConfigError(f"--max-queued-requests {args.max_queued_requests} must be >= 0")
    check_webhook(args)
    both_or_neither(args, "ssl_certfile", "ssl_keyfile", "the certificate and its private key, PEM files")


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


# In this order: a message names the first problem the flags have, numbers (NaN) before anything compares them.
CHECKS: tuple[Callable[[ServeArgs], None], ...] = (
    check_numbers,
    check_served_model_name,
    check_server_addr,
    check_worker_lists,
    check_ports,
    check_bind_addresses,
    check_transfer,
    check_time_limits,
    check_output_path,
    check_results_store,
    check_otlp_endpoint,
    check_capacity,
    check_full_pipeline,
    check_http_limits,
    check_batching,
    check_reference_urls,
    check_simulation,
    check_control_security,
    check_flags_taken,
    check_lora,
    check_model_layout,
)


# Checks of the files the flags name, as the process starts (not where the flags are written)


def check_listed_files(args: ServeArgs) -> None:
    """A file:// worker or head list and --lora-catalog may be missing at start-up (a ConfigMap mounted
    later), but a folder there is never a list: the lists would stay empty without a word."""
    named = [(flag(URL_FLAGS[role]), url) for role in URL_FLAGS for url in args.urls_for(role)]
    if args.disagg_server_addr:
        named += [("--disagg-server-addr", spec) for spec in parse_urls(args.disagg_server_addr)]
    paths = [(name, url.removeprefix("file://")) for name, url in named if url.startswith("file://")]
    if args.lora_catalog:
        paths.append(("--lora-catalog", args.lora_catalog))
    for name, path in paths:
        if os.path.isdir(path):
            raise ConfigError(f"{name} {path} is a folder; give the file in it that lists one entry per line")


def check_tls_files(args: ServeArgs) -> None:
    """--ssl-certfile and --ssl-keyfile: readable, and a certificate the key belongs to."""
    if args.ssl_certfile is None or args.ssl_keyfile is None:
        return
    import ssl

    for name, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"{name} {path}: {exc.strerror or exc}") from None
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(
            f"--ssl-certfile {args.ssl_certfile} and --ssl-keyfile {args.ssl_keyfile} do not load as a PEM "
            f"certificate and its private key ({exc}); an encrypted key is not supported"
        ) from None


def check_pool_fits_memory(args: ServeArgs) -> None:
    """--disagg-transfer-pool-size: no more than this host's memory, which the worker would fail to
    allocate only after its model loaded."""
    if not args.disagg_role.is_worker or args.disagg_full_pipeline:  # a full-pipeline worker has no pool
        return
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host that says
        return
    if 0 < memory < args.disagg_transfer_pool_size:
        raise ConfigError(
            f"--disagg-transfer-pool-size {args.disagg_transfer_pool_size} is more than this host's memory "
            f"({memory} bytes); use e.g. 256MiB"
        )
