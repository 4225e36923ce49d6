"""Where Mooncake listens: its port range, and only the worker's --disagg-p2p-hostname.

Mooncake (0.3.x) binds its P2P handshake listener on INADDR_ANY and its TCP data listener on a
dual-stack `[::]`, whatever address it is given, and no setting of it narrows them. A worker
therefore runs with `bind_shim.c` preloaded: `confine_mooncake_listeners` re-executes the worker
process once (same pid, same argv) with LD_PRELOAD naming the shim and the address and port range
it confines to, and `check_mooncake_listeners` verifies, once the engine has started, that none of
its listeners is a wildcard. `--disagg-transfer-listen-any` keeps Mooncake's own behaviour.

The shim is built by `make setup` (scripts/build-bind-shim.sh) next to this module, or in the
worker image; TRIPTYCH_BIND_SHIM names another path.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path

from triptych import startup
from triptych.config import ConfigError, ServeArgs
from triptych.ports import MOONCAKE_PORT_RANGE

log = logging.getLogger(__name__)

SHIM_ENV = "TRIPTYCH_BIND_SHIM"  # where the shim is, when not next to this module
ADDRESS_ENV = "TRIPTYCH_BIND_ADDRESS"  # read by the shim: the address wildcard binds go to
PORTS_ENV = "TRIPTYCH_BIND_PORTS"  # read by the shim: MIN-MAX, the binds it may rewrite
SHIM_NAME = "libtriptych_bind.so"
WILDCARDS = ("0.0.0.0", "::")
OPT_OUT = "--disagg-transfer-listen-any"
EPHEMERAL_PORTS = (32768, 60999)  # what Mooncake refuses in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (config.cpp)


def mooncake_port_range() -> tuple[int, int]:
    """The ports Mooncake listens on, pinned for it through MC_MIN_RPC_PORT/MC_MAX_RPC_PORT.

    The range the operator's NetworkPolicy opens between workers (triptych.ports), unless the
    environment already sets them.
    """
    os.environ.setdefault("MC_MIN_RPC_PORT", str(MOONCAKE_PORT_RANGE[0]))
    os.environ.setdefault("MC_MAX_RPC_PORT", str(MOONCAKE_PORT_RANGE[1]))
    given = f"MC_MIN_RPC_PORT {os.environ['MC_MIN_RPC_PORT']!r} / MC_MAX_RPC_PORT {os.environ['MC_MAX_RPC_PORT']!r}"
    try:
        low, high = int(os.environ["MC_MIN_RPC_PORT"]), int(os.environ["MC_MAX_RPC_PORT"])
    except ValueError:
        raise ConfigError(f"{given} must be port numbers") from None
    # Mooncake takes another range, its default, without a word when it refuses this one: its
    # listeners would then be where neither the bind shim nor the check below looks.
    if not (_mooncake_takes(low) and _mooncake_takes(high) and low <= high):
        raise ConfigError(
            f"{given}: Mooncake refuses the range (each end in 1024-65535 and outside the ephemeral "
            f"{EPHEMERAL_PORTS[0]}-{EPHEMERAL_PORTS[1]}, MIN <= MAX) and would listen on "
            f"{MOONCAKE_PORT_RANGE[0]}-{MOONCAKE_PORT_RANGE[1]} instead; choose a range it takes"
        )
    return low, high


def _mooncake_takes(port: int) -> bool:
    return 1024 <= port <= 65535 and not EPHEMERAL_PORTS[0] <= port <= EPHEMERAL_PORTS[1]


def bind_shim_path() -> Path:
    return Path(os.environ.get(SHIM_ENV) or Path(__file__).with_name(SHIM_NAME))


def shim_environment(shim: Path, address: str, ports: str) -> dict[str, str]:
    """The variables that load the bind shim (before whatever LD_PRELOAD already names) and confine
    the binds of `ports` (MIN-MAX) to `address`."""
    preload = os.environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": ":".join(p for p in (str(shim), preload) if p), ADDRESS_ENV: address, PORTS_ENV: ports}


def listen_address(hostname: str) -> str:
    """The IP address of --disagg-p2p-hostname (a literal, or the first address a name resolves to)."""
    try:
        return str(ipaddress.ip_address(hostname.strip("[]")))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"--disagg-p2p-hostname {hostname} does not resolve: {exc}") from None
    return str(infos[0][4][0])


def check_local_address(hostname: str) -> None:
    """Raise ConfigError unless --disagg-p2p-hostname is an address of this host: Mooncake's engine,
    started after the model loads, could not listen on it, and peers would write to another host."""
    address = listen_address(hostname)
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as exc:
            resolved = "" if address == hostname.strip("[]") else f" ({address})"
            raise ConfigError(
                f"--disagg-p2p-hostname {hostname}{resolved} is not an address of this host ({exc.strerror}): "
                "give this host's address (in a pod, its IP, e.g. $(POD_IP)) or a name that resolves to it"
            ) from None


def confine_mooncake_listeners(args: ServeArgs) -> None:
    """Make sure Mooncake will listen on --disagg-p2p-hostname only; may re-execute this process.

    Returns when the shim is loaded with this worker's address (or the user opted out); otherwise
    replaces the process image with the same command under the shim (it never returns then).
    Raises ConfigError when the shim is missing or failed to load.
    """
    if args.disagg_transfer_listen_any:
        log.warning("%s: Mooncake listens on every address of this host", OPT_OUT)
        return
    address = listen_address(args.disagg_p2p_hostname)
    low, high = mooncake_port_range()
    ports = f"{low}-{high}"
    shim = bind_shim_path().resolve()
    if _is_mapped(shim):
        if (os.environ.get(ADDRESS_ENV), os.environ.get(PORTS_ENV)) != (address, ports):
            raise ConfigError(
                f"the bind shim {shim} confines to {os.environ.get(ADDRESS_ENV)} ports {os.environ.get(PORTS_ENV)}, "
                f"not --disagg-p2p-hostname {address} ports {ports}; unset {ADDRESS_ENV}/{PORTS_ENV}"
            )
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if str(shim) in preload.split(":"):
        raise ConfigError(f"the bind shim {shim} was preloaded but did not load (see the loader's message above)")
    if not shim.is_file():
        raise ConfigError(
            f"Mooncake would listen on every address, not only --disagg-p2p-hostname {args.disagg_p2p_hostname}: "
            f"its bind shim {shim} is missing; build it (`make setup`, or scripts/build-bind-shim.sh {shim}), "
            f"point {SHIM_ENV} at it, or give {OPT_OUT}"
        )
    env = {**os.environ, **shim_environment(shim, address, ports)}
    env[startup.REEXEC_ENV] = f"{startup.since_process_start():.3f}"  # the new image's start-up line counts this one
    if ipaddress.ip_address(address).version == 6:
        env.setdefault("MC_USE_IPV6", "1")  # Mooncake's handshake socket is IPv4 otherwise (and cannot take it)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def check_mooncake_listeners(args: ServeArgs) -> None:
    """Raise ConfigError if Mooncake, now started, listens on a wildcard address against the flags."""
    if args.disagg_transfer_listen_any:
        return
    low, high = mooncake_port_range()
    wide = sorted(s for s in listening_sockets(os.getpid()) if s[0] in WILDCARDS and low <= s[1] <= high)
    if wide:
        raise ConfigError(
            f"Mooncake listens on {', '.join(f'{a}:{p}' for a, p in wide)} despite the bind shim "
            f"{bind_shim_path()}; give {OPT_OUT} to accept that"
        )
    log.info("Mooncake listeners confined to %s (ports %d-%d) by %s", os.environ.get(ADDRESS_ENV), low, high,
             bind_shim_path().resolve())  # fmt: skip


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, from /proc (IPv4 and IPv6).

    An IPv4-mapped address (::ffff:A.B.C.D, a dual-stack socket bound to one IPv4 address) is
    given as the IPv4 address it accepts; the wildcards are 0.0.0.0 and ::.
    """
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            address = socket.inet_ntop(family, raw).removeprefix("::ffff:")
            found.add((address, int(hex_port, 16)))
    return found


def _is_mapped(shim: Path) -> bool:
    """Whether `shim` (a resolved path) is loaded into this process."""
    try:
        return any(line.endswith(str(shim)) for line in Path("/proc/self/maps").read_text().splitlines())
    except OSError:
        return False
