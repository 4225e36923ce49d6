"""The heads a worker serves: where each one is, which requests are whose, and the links to them.

A worker's `--disagg-server-addr` takes the forms a head's worker lists take (`;`-separated
tcp:// addresses, `dns://NAME:PORT` of a headless Service, `file:///PATH`), re-read as discovery
changes. The worker heartbeats to every head it finds, saying by which endpoint (`via`); each head
echoes that endpoint in its pings, so the worker learns which head (Ping.head_id) is where. Every
head->worker message names its head, so each request's reports go back to the head that owns it.

A head that stops pinging for a heartbeat timeout is gone: what the worker held for it is released
(and the head hears which of its requests were dropped, should it come back). A new head behind
the endpoint of an old one replaced it: the old one's work is released at once.

With one static address (`tcp://HOST:PORT`, the usual single head), every message goes to it and
a new head id is a replacement: exactly the behaviour of a worker serving one head.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from triptych.config import parse_urls
from triptych.discovery import DYNAMIC, EndpointDirectory
from triptych.ports import result_endpoint
from triptych.protocol import Failed, HeaderTooLarge, TransferStaged
from triptych.roles import Role
from triptych.security import ControlPlane
from triptych.sockets import connect, send_message

log = logging.getLogger(__name__)

Clock = Callable[[], float]
OWNED_MEMORY = 10_000  # how many requests' heads are remembered (far more than a worker ever holds)


class HeadBook:
    """Thread-safe record of the heads: endpoints, which head id is at each, pings, and who owns
    each request this worker holds."""

    def __init__(self, server_addr: str, role: Role, interval_s: float, clock: Clock):
        specs = parse_urls(server_addr)
        self._role = role
        self._clock = clock
        # One static address: the single-head worker (standing slots allowed, every message to it).
        self.single = len(specs) == 1 and not specs[0].startswith(DYNAMIC)
        self._directory = EndpointDirectory(specs, interval_s)
        self._lock = threading.Lock()
        self._head_at: dict[str, str] = {}  # result endpoint -> the head id last seen there
        self._last_ping: dict[str, float] = {}  # head id -> when it last pinged
        self._instance_as: dict[str, str] = {}  # head id -> this worker's URL as that head knows it
        self._owner: OrderedDict[str, str] = OrderedDict()  # request id -> head id, the newest OWNED_MEMORY
        self._acknowledged: set[str] = set()  # heads that acknowledged this worker's drain
        self.version = 0  # bumped when the endpoints or the heads at them change, so each thread's links follow
        self._urls_seen: list[str] | None = None  # the directory's list endpoints() was made from
        self._endpoints: list[str] = []

    # --- where the heads are ----------------------------------------------------------------

    def endpoints(self) -> list[str]:
        """The result endpoints of every head discovery lists now (the directory replaces its list
        when it changes: only then are they worked out again, and the version bumped)."""
        urls = self._directory.urls
        if urls is not self._urls_seen:
            self._endpoints = [result_endpoint(addr, self._role) for addr in urls]
            self._urls_seen = urls
            self.version += 1
        return self._endpoints

    def close(self) -> None:
        self._directory.close()

    def on_ping(self, head_id: str, via: str, instance: str) -> str | None:
        """A ping from `head_id`; returns the head it replaced (another head id last seen at the same
        endpoint), whose work must be released, or None."""
        now = self._clock()
        endpoints = self.endpoints()
        if self.single and endpoints:
            via = endpoints[0]
        with self._lock:
            self._last_ping[head_id] = now
            self._instance_as[head_id] = instance
            if not via or via not in endpoints:
                return None  # not yet known where it is: the heartbeats to every endpoint tell it
            previous = self._head_at.get(via)
            if previous == head_id:
                return None
            self._head_at[via] = head_id
            self.version += 1
            if previous is None:
                log.info("serving head %s at %s", head_id, via)
                return None
            log.info("head %s at %s replaced head %s", head_id, via, previous)
            self._forget_head(previous)
            return previous

    def head_at(self, endpoint: str) -> str:
        with self._lock:
            return self._head_at.get(endpoint, "")

    def endpoint_of(self, head_id: str) -> str | None:
        with self._lock:
            for endpoint, head in self._head_at.items():
                if head == head_id:
                    return endpoint
        return None

    def instance_for(self, head_id: str) -> str:
        with self._lock:
            return self._instance_as.get(head_id, "")

    def live_heads(self, timeout_s: float) -> list[str]:
        """Heads mapped to an endpoint that pinged within `timeout_s`."""
        now = self._clock()
        with self._lock:
            return [h for h in self._head_at.values() if now - self._last_ping.get(h, -1e18) <= timeout_s]

    def silent_heads(self, timeout_s: float) -> list[str]:
        """Heads that pinged once and have been silent for `timeout_s`: gone. Each is reported once."""
        now = self._clock()
        with self._lock:
            gone = [h for h, t in self._last_ping.items() if now - t > timeout_s]
            for head in gone:
                self._forget_head(head)
            if gone:
                self.version += 1
        return gone

    def last_ping(self) -> float | None:
        """When any head last pinged."""
        with self._lock:
            return max(self._last_ping.values(), default=None)

    def _forget_head(self, head_id: str) -> None:
        self._last_ping.pop(head_id, None)
        self._instance_as.pop(head_id, None)
        self._acknowledged.discard(head_id)
        for endpoint in [e for e, h in self._head_at.items() if h == head_id]:
            del self._head_at[endpoint]

    # --- whose requests ---------------------------------------------------------------------

    def own(self, request_id: str, head_id: str) -> None:
        with self._lock:
            self._owner[request_id] = head_id
            self._owner.move_to_end(request_id)
            while len(self._owner) > OWNED_MEMORY:
                self._owner.popitem(last=False)

    def owner(self, request_id: str) -> str:
        with self._lock:
            return self._owner.get(request_id, "")

    def requests_of(self, head_id: str) -> set[str]:
        with self._lock:
            return {r for r, h in self._owner.items() if h == head_id}

    def route(self, request_id: str) -> str | None:
        """The endpoint a report about `request_id` goes to: its head's (the only one for a single head)."""
        if self.single:
            endpoints = self.endpoints()
            return endpoints[0] if endpoints else None
        return self.endpoint_of(self.owner(request_id))

    # --- drain ------------------------------------------------------------------------------

    def acknowledge(self, head_id: str) -> None:
        with self._lock:
            self._acknowledged.add(head_id)

    def acknowledged(self) -> set[str]:
        with self._lock:
            return set(self._acknowledged)

    def all_acknowledged(self, timeout_s: float) -> bool:
        """Every live head has acknowledged the drain (and there is at least one)."""
        live = self.live_heads(timeout_s)
        with self._lock:
            return bool(live) and all(h in self._acknowledged for h in live)


class HeadLinks:
    """One thread's PUSH sockets to the heads' result endpoints for its role (sockets are not
    thread-safe: each worker thread has its own), following the HeadBook's endpoints."""

    def __init__(self, ctx: zmq.Context, book: HeadBook, security: ControlPlane):
        self._ctx = ctx
        self._book = book
        self._security = security
        self._sockets: dict[str, zmq.Socket] = {}
        self._version = -1

    def _sync(self) -> None:
        endpoints = self._book.endpoints()  # first: a discovery change bumps the version
        if self._version == self._book.version:
            return  # the common case, on every report: nothing built
        self._version = self._book.version
        wanted = set(endpoints)
        for endpoint in [e for e in self._sockets if e not in wanted]:
            self._sockets.pop(endpoint).close(linger=0)
        for endpoint in wanted - set(self._sockets):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            self._security.client(sock)  # with keys: the head's result port lets in the pipeline's workers only
            connect(sock, endpoint)
            self._sockets[endpoint] = sock

    def send(self, msg: Any, frames: Sequence[Any] = ()) -> None:
        """A report about one request, to the head that owns it, naming this worker as that head knows it."""
        self._sync()
        request_id = getattr(msg, "request_id", "")
        endpoint = self._book.route(request_id)
        sock = self._sockets.get(endpoint or "")
        if sock is None:
            log.debug("dropped %s for %s: its head is gone", msg.TYPE, request_id)
            return
        if not self._book.single:
            msg = msgspec.structs.replace(msg, instance=self._book.instance_for(self._book.owner(request_id)))
        try:
            send_message(sock, msg, frames)
        except HeaderTooLarge as exc:  # the head would drop it unread, and the request wait for its timeout
            log.error("request %s: %s; it fails instead", request_id, exc)
            send_message(sock, too_large(msg, exc))

    def send_to(self, endpoint: str | None, msg: Any) -> None:
        """To the head at `endpoint` (nothing when it is not known)."""
        self._sync()
        if (sock := self._sockets.get(endpoint or "")) is not None:
            send_message(sock, msg)

    def broadcast(self, make: Callable[[str, str], Any]) -> None:
        """make(endpoint, head id there or "") to every head endpoint: heartbeats."""
        self._sync()
        for endpoint, sock in self._sockets.items():
            send_message(sock, make(endpoint, self._book.head_at(endpoint)))

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()


ERROR_KEPT = 4096  # characters of a too-large Failed's own error that the one sent in its place keeps


def too_large(msg: Any, exc: HeaderTooLarge) -> Failed:
    """What a worker reports instead of a report over the control header limit: its request fails
    at once, saying why (the head's on_failed names this worker and frees what the request holds,
    staged outputs included)."""
    why, status_code = str(exc), 500
    if isinstance(msg, TransferStaged):
        manifest, meta = len(msgspec.msgpack.encode(msg.manifest)), len(msgspec.msgpack.encode(msg.meta))
        why += f": its outputs manifest/meta is too large (manifest {manifest} bytes, meta {meta} bytes)"
    elif isinstance(msg, Failed):  # an error message too long to send: its beginning
        why, status_code = f"{why}; the error began: {msg.error[:ERROR_KEPT]}", msg.status_code
    return Failed(msg.request_id, msg.instance, why, status_code)
