"""Where this process listens and whom it talks to: URLs, ports, bind addresses, a worker's heads, the
head's worker lists, and the control plane's keys."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import SplitResult, urlsplit

from triptych.config import (
    URL_FLAGS,
    ConfigError,
    ServeArgs,
    parse_endpoint_spec,
    parse_urls,
)
from triptych.ports import DEFAULT_MASTER_PORT_OFFSET, MAX_RESULT_PORT_OFFSET, is_loopback, parse_tcp_endpoint
from triptych.roles import Role, is_full_pipeline
from triptych.serve_help import flag


def url_port_ok(parts: SplitResult) -> bool:
    """Whether a URL's port, if it has one, is a TCP port (urlsplit raises on reading a bad one)."""
    try:
        return parts.port is None or parts.port > 0
    except ValueError:
        return False


def http_endpoint(url: str) -> SplitResult | None:
    """`url` split, if it is http(s)://HOST[:PORT]... with a valid port; None if it is not (urlsplit
    raises on an unclosed or bad [IPv6] host: 'http://[')."""
    try:
        parts = urlsplit(url)
        hostname = parts.hostname
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not hostname or not url_port_ok(parts):
        return None
    return parts


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
