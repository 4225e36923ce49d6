"""The port convention shared by the head and the workers (docs/design.md, "Port convention").

Result endpoints are derived from the head's --scheduler-port, so a worker only needs
--disagg-server-addr to find where its results go.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from triptych.roles import ROLE_SPECS, Role

DEFAULT_SCHEDULER_PORT = 5555
DEFAULT_HTTP_PORT = 30000

RESULT_PORT_OFFSET: dict[Role, int] = {role: spec.result_port_offset for role, spec in ROLE_SPECS.items()}
MAX_RESULT_PORT_OFFSET = max(RESULT_PORT_OFFSET.values())
# A multi-device worker's ranks meet on loopback at --master-port, by default its work port
# (--scheduler-port) + this (docs/design.md, "Port convention"; triptych_worker.parallel.ranks).
DEFAULT_MASTER_PORT_OFFSET = 50


# Mooncake takes its handshake and TCP data ports from this range (its defaults, which the worker
# pins through MC_MIN_RPC_PORT/MC_MAX_RPC_PORT); the operator's NetworkPolicy opens exactly these
# ports between a pipeline's workers.
MOONCAKE_PORT_RANGE = (15000, 17000)


def frontend_port(scheduler_port: int) -> int:
    """The head's frontend ROUTER port."""
    return scheduler_port


def result_port(scheduler_port: int, role: Role) -> int:
    """The head's PULL port on which `role` workers report."""
    try:
        return scheduler_port + RESULT_PORT_OFFSET[role]
    except KeyError:
        raise ValueError(f"role {role.value!r} has no result port; only worker roles report") from None


def parse_tcp_endpoint(url: str, scheme: str = "tcp") -> tuple[str, int]:
    """Split 'tcp://HOST:PORT' (or SCHEME://NAME:PORT) into (host, port); nothing else is taken: a
    path, query or user part would be dropped without a word, and port 0 is no port."""
    word = "NAME" if scheme == "dns" else "HOST"
    what = f"{url!r} is not a {scheme}://{word}:PORT endpoint (PORT 1-65535)"
    prefix = f"{scheme}://"
    if not url.startswith(prefix):
        raise ValueError(what)
    try:
        parts = urlsplit("tcp://" + url.removeprefix(prefix))
        port = parts.port  # ValueError: not a number, or above 65535
    except ValueError:
        raise ValueError(what) from None
    extra = parts.path or parts.query or parts.fragment or parts.username is not None
    if not parts.hostname or not port or extra:
        raise ValueError(what)
    return parts.hostname, port


def result_endpoint(server_addr: str, role: Role) -> str:
    """The endpoint a worker of `role` connects to, derived from --disagg-server-addr."""
    host, port = parse_tcp_endpoint(server_addr)
    return tcp_url(host, result_port(port, role))


def host_port(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 address in brackets (pod IPs can be IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tcp_url(host: str, port: int) -> str:
    """tcp://HOST:PORT, with an IPv6 address in brackets."""
    return f"tcp://{host_port(host, port)}"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name, or a placeholder such as $(POD_IP): reachable from elsewhere
