"""The HTTP API's listening socket, bound as the head (or the monolithic process) starts.

Bound before anything else starts (a monolithic process's model loads, a head's DiffusionServer
binds its ports), so a taken --port, or a --host that is not this machine's address, stops the
process at once in one line naming the flag, where uvicorn found it only as it began serving
(after the model loaded) and exited 3 with a log line of its own. uvicorn then serves on this
socket (shutdown.serve_http).
"""

from __future__ import annotations

import socket

from triptych.config import ConfigError, ServeArgs, bind_error
from triptych.ports import host_port

PORT_HINT = "another process (another head?) listens on it; give another --port"


def bind_http(args: ServeArgs) -> socket.socket:
    """A TCP socket bound to --host:--port as uvicorn binds it (IPv6 for an address with a colon, else
    IPv4, a name resolved in that family), not listening yet: uvicorn listens on it."""
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own: a restart binds at once
    where = host_port(args.host, args.port)
    try:
        sock.bind((args.host, args.port))
    except socket.gaierror as exc:
        sock.close()
        raise ConfigError(
            f"--host {args.host} does not resolve ({exc.strerror}): give an address or a name of this machine"
        ) from None
    except OSError as exc:
        sock.close()
        raise bind_error(exc, where, ("--host", args.host), ("--port", args.port), PORT_HINT) from None
    return sock
