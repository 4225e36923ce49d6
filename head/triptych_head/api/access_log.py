"""--access-log: one line per HTTP request, as its answer ends, on the `triptych_head.access` logger.

    127.0.0.1:50122 "POST /v1/images/generations" 200 0.231s id=img_5f0c... owner=tenant:acme ref=-

The client's address, the method and the path as sent (still percent-encoded, without its query: a
query may carry a presigned URL's signature), the status, the seconds from the request's arrival to
its answer's last byte (a streamed answer's whole stream), the request's id where the head gave one
(X-Request-Id), whose it was where API keys are on (ownership.py: `tenant:NAME` or `key:ID`, never
the key), and the X-Request-Id the request came with, if any (an ingress's, e.g. ingress-nginx's
`$req_id`: what ties its log line to this one). A request that ends without an answer (the client
left, the head stopped) logs status 0. Probes and scrapes (/health, /ready, /metrics) are logged
only when they fail. Lines are INFO, written whatever --log-level. Off by default: uvicorn's own
access log stays off either way. A line costs the head ~50 us of CPU (bench/http_app_bench.py
--access-log). With --log-format json the line's parts are also its `http` object (client, method,
path, status, seconds, request_id, owner, ref), and its `request_id` field is the head's id, or
absent: never `ref`, which a client without a key could set to another request's id.
"""

from __future__ import annotations

import logging
import re
import time
from urllib.parse import quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from triptych.log_format import FIELDS, NAMED
from triptych_head.api.context import REQUEST_ID_HEADER
from triptych_head.api.ownership import OWNER

log = logging.getLogger("triptych_head.access")

QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
_ID_HEADER = REQUEST_ID_HEADER.lower().encode()
_SHOWN = 200  # characters of a path or request id a line repeats
# An image URL's random part is what lets its holder fetch it (ownership.py): never written to the log.
_IMAGE_SECRET = re.compile(r"(/v1/files/images/[^/]*-)[0-9A-Fa-f]{16,}(\.[A-Za-z0-9]+)?$")


class AccessLog:
    """The outermost middleware, so it sees the answers the key and body-limit checks give too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        log.setLevel(logging.INFO)  # asked for by its flag: written under --log-level warning too

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status, request_id = 0, "-"
        ref = next((_shown(value.decode("latin-1")) for name, value in scope["headers"] if name == _ID_HEADER), "-")

        async def answering(message: Message) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", ()):
                    if name.lower() == _ID_HEADER:
                        request_id = value.decode("latin-1")[:_SHOWN]
            await send(message)

        try:
            await self.app(scope, receive, answering)
        except Exception:
            status = status or 500  # what the server's error middleware answers
            raise
        finally:
            if not (scope.get("path", "") in QUIET_PATHS and 200 <= status < 400):
                _write(scope, status, time.perf_counter() - started, request_id, ref)


def _write(scope: Scope, status: int, seconds: float, request_id: str, ref: str) -> None:
    """The line, and the same as fields for --log-format json (triptych.log_format)."""
    line = (_client(scope), scope.get("method", "-"), _shown_path(scope), status, seconds, request_id,
            scope.get("state", {}).get(OWNER) or "-", ref)  # fmt: skip
    http = dict(zip(("client", "method", "path", "status", "seconds", "request_id", "owner", "ref"), line, strict=True))
    # The line's request_id is the head's id or none: never `ref`, the client's, which may name another request.
    named = None if request_id == "-" else request_id
    log.info('%s "%s %s" %d %.3fs id=%s owner=%s ref=%s', *line, extra={FIELDS: {"http": http}, NAMED: named})


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


def _shown_path(scope: Scope) -> str:
    """The path as the client sent it, percent-encoded: a decoded one could hold a line break or
    quote, and one log line per request must stay one line."""
    raw = scope.get("raw_path")
    shown = raw.decode("latin-1") if isinstance(raw, bytes) else quote(scope.get("path", ""), safe="/")
    return _shown(_IMAGE_SECRET.sub(r"\1REDACTED\2", shown.split("?", 1)[0]))


def _shown(text: str) -> str:
    """`text` percent-encoded where it would break the line's fields (spaces, quotes, line breaks)."""
    return quote(text, safe="/%:@!$&'()*+,;=-._~")[:_SHOWN]
