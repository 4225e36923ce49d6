"""DiffusionServer: the head's sockets, loop and timers around its decision core (core.py).

One thread owns every socket. The head's own HTTP API hands its messages over in-process
(local_channel.py); the frontend ROUTER takes those of API clients in other processes (on
loopback only: the bench, tests); one PULL per role takes its workers' results and heartbeats,
and one PUSH per worker (links.py) carries the core's decisions to it. Each loop turn hands what
arrived to the core, runs its upkeep every PING_INTERVAL_S with the worker lists discovery
(discovery.py) resolves, and lets it dispatch; what the core decides leaves through this
module's Transport.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from triptych.config import ServeArgs, bind_error
from triptych.discovery import EndpointDirectory
from triptych.ports import frontend_port, result_port, tcp_url
from triptych.protocol import HeaderTooLarge, RequestEvent, encode
from triptych.roles import Role
from triptych.security import ControlPlane, control_plane
from triptych.sockets import SocketSet, has_queued_message, recv_message
from triptych.tracing import start_tracing, traces_url
from triptych_head import upkeep
from triptych_head.core import HeadCore
from triptych_head.links import WorkerLinks
from triptych_head.local_channel import LOCAL_CLIENT, LocalChannel
from triptych_head.membership import Membership
from triptych_head.metrics import HeadMetrics
from triptych_head.state import REJECTED, TERMINAL, RequestState

log = logging.getLogger(__name__)

PING_INTERVAL_S = 0.5
SHUTDOWN_LINGER_MS = 1000  # how long the last messages to workers may take to leave after a drain
POLL_MS = 50
HEAD_SERVICE = "triptych-head"  # its spans' service.name (a worker's: triptych-<role>)
READ_LIMIT = 1000  # messages taken from one socket per loop turn, so no socket starves the others
_FINAL = {state.value for state in TERMINAL} | {REJECTED}  # the states of an event that ends its request


class _SocketTransport:
    """The core's Transport on this server's sockets: worker links, the frontend ROUTER, and the
    in-process channel of the head's own API."""

    def __init__(self, links: WorkerLinks, local: LocalChannel):
        self.links = links
        self.local = local
        self.frontend: zmq.Socket | None = None
        self.replied = False  # sent on the frontend since the loop last looked (its wait must ask it again)

    def open(self, url: str) -> str | None:
        return self.links.open(url)

    def close(self, url: str) -> None:
        self.links.close(url)

    def send(self, url: str, msg: Any) -> bool:
        return self.links.send(url, msg)

    def reply(self, client: bytes, msg: Any, frames: Sequence[Any] = ()) -> None:
        if client == LOCAL_CLIENT:
            self.local.reply(msg, frames)
            return
        assert self.frontend is not None
        self.replied = True
        try:
            parts = encode(msg, frames)
        except HeaderTooLarge as exc:  # the client would drop it unread
            if isinstance(msg, RequestEvent) and msg.state not in _FINAL:
                log.error("frontend client %r: %s; dropped", client, exc)
                return
            log.error("frontend client %r: %s; sent a failure in its place", client, exc)
            failed = RequestEvent(exc.request_id or "", RequestState.FAILED.value, error=str(exc), status_code=500)
            parts = encode(failed)
        try:
            # Zero-copy only pays for large frames (pixels); small control messages are cheaper copied.
            self.frontend.send_multipart([client, *parts], flags=zmq.NOBLOCK, copy=not frames)
        except zmq.Again:
            log.warning("frontend client %r is not reading; dropped %s", client, msg.TYPE)


class DiffusionServer:
    def __init__(
        self,
        args: ServeArgs,
        metrics: HeadMetrics | None = None,
        ctx: zmq.Context | None = None,
    ):
        self.args = args
        self._ctx = ctx or zmq.Context.instance()
        self._ctx.setsockopt(zmq.IPV6, 1)  # workers may have IPv6 pod IPs; IPv4 keeps working
        # Before any socket: with keys, result sockets let in only the pipeline's workers, and the
        # head reaches workers' work sockets as the only client they accept.
        self.security: ControlPlane = control_plane(args, self._ctx, "head")
        self.local = LocalChannel()  # the head's own API (connect a LocalClient to it)
        self._transport = _SocketTransport(WorkerLinks(self._ctx, self.security), self.local)
        self._tracing = start_tracing(traces_url(args.otlp_endpoint), HEAD_SERVICE)
        self.core = HeadCore(args, self._transport, metrics, tracing=self._tracing)
        roles = self.core.membership.roles()
        self._directories = {
            role: EndpointDirectory(args.urls_for(role), args.disagg_discovery_interval) for role in roles
        }
        self.core.membership.sync(self._discovered())
        self._stop = threading.Event()
        self._draining = False
        self._shutdown_lock = threading.Lock()
        self._shutdown_requests: list[float] = []  # drain() calls from other threads, for the loop to apply
        self._held: Callable[[], bool] = lambda: False  # hold_while
        self._sockets: list[tuple[zmq.Socket, Role | None]] = []
        self.frontend_endpoint = f"tcp://127.0.0.1:{frontend_port(args.scheduler_port)}"
        self._transport.frontend = self._bind(zmq.ROUTER, self.frontend_endpoint, None)  # loopback clients only
        for role in roles:
            self._bind(zmq.PULL, tcp_url(args.host, result_port(args.scheduler_port, role)), role)
        log.info(
            "result sockets on %s ports %s, control plane %s", args.host,
            ",".join(str(result_port(args.scheduler_port, role)) for role in roles),
            "authenticated (CURVE)" if self.security.authenticated else "UNAUTHENTICATED",
        )  # fmt: skip

    # What the API and the tests read: the core's state.
    @property
    def metrics(self) -> HeadMetrics:
        return self.core.metrics

    @property
    def registry(self) -> Membership:
        return self.core.membership

    @property
    def requests(self) -> dict[str, Any]:
        return self.core.requests

    @property
    def admission(self) -> Any:
        return self.core.admission

    @property
    def topology(self) -> str:
        return self.core.topology

    def view(self) -> dict[str, Any]:
        """GET /v1/pipeline (upkeep.view)."""
        return upkeep.view(self.core)

    def _discovered(self) -> dict[Role, list[str]]:
        return {role: directory.urls for role, directory in self._directories.items()}

    def _bind(self, kind: int, endpoint: str, role: Role | None) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if role is not None:
            self.security.server(sock)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            self._close(0)
            port_hint = (
                "the head's frontend and its result ports +1..+5 must be free on --host; is another head using them?"
            )
            raise bind_error(
                exc, endpoint, ("--host", self.args.host), ("--scheduler-port", self.args.scheduler_port), port_hint
            ) from None
        self._sockets.append((sock, role))
        return sock

    def _close(self, linger_ms: int) -> None:
        self._transport.links.close_all(linger_ms)
        for directory in self._directories.values():
            directory.close()
        for sock, _ in self._sockets:
            sock.close(linger=0)
        self.local.close()
        self.security.close()
        if self._tracing is not None:
            self._tracing.shutdown()  # the spans still buffered

    # --- loop -------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until stop() or a finished drain; call from the thread that owns this server."""
        waiting = SocketSet()
        for sock, _ in self._sockets:
            waiting.add_socket(sock)
        waiting.add_fd(self.local.fd)
        frontend = self._transport.frontend
        assert frontend is not None
        next_tick = 0.0
        # A group waiting for --batching-delay-ms leaves on time, not at the next idle wake-up.
        batcher = self.core.dispatcher.batcher
        delay_ms = batcher.shortest_delay_s * 1000 if batcher is not None else 0.0
        poll_s = min(POLL_MS, max(1, int(delay_ms))) / 1000 if delay_ms > 0 else POLL_MS / 1000
        try:
            while not self._stop.is_set():
                ready = waiting.wait(poll_s)
                self._apply_shutdown()  # before reading: a request that arrives after drain() is refused
                if self.local.fd in ready:
                    self._read_local()
                for sock, role in self._sockets:
                    if sock in ready and self._read(sock, role):
                        waiting.recheck(sock)  # left messages queued: its descriptor may not fire for them
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + PING_INTERVAL_S
                    try:
                        self.core.tick(self._discovered())
                    except Exception:  # e.g. an unusable address from discovery: log it, keep serving
                        log.exception("periodic upkeep failed")
                try:
                    self.core.dispatch()
                except Exception:  # a bug in one request's dispatch: logged, the loop and the others go on
                    log.exception("dispatch failed")
                if self._transport.replied:  # a send on the frontend may have taken its descriptor's signal
                    self._transport.replied = False
                    waiting.recheck(frontend)
                if self._draining and self.core.drained() and (not self._held() or self.core.drain_expired()):
                    break  # nothing held on a worker, nor an HTTP request let in that may still submit
        except BaseException:
            log.critical("the DiffusionServer loop stopped; this head serves nothing more", exc_info=True)
            raise
        finally:
            # Lingering lets the CancelWork messages of a drain reach the workers before the sockets go.
            self._close(SHUTDOWN_LINGER_MS if self._draining else 0)

    def _read(self, sock: zmq.Socket, role: Role | None) -> bool:
        """Hand up to READ_LIMIT queued messages of one socket to the core; True if it has more."""
        for _ in range(READ_LIMIT):
            try:  # the frontend's parts are [client id, header, *frames], a result socket's [header, *frames]
                parts = recv_message(sock, zmq.NOBLOCK, copied=2 if role is None else 1)
            except zmq.Again:
                return False
            try:
                if role is None:
                    if len(parts) >= 2 and parts[0] != LOCAL_CLIENT:  # that id is the head's own API's
                        self.core.on_frontend(parts[0], parts[1:])
                else:
                    self.core.on_worker(role, parts)
            except Exception:  # the loop serves every other request; never let one message end it
                log.exception("unhandled error on the %s socket; message dropped", role.value if role else "frontend")
            if not has_queued_message(sock):
                return False
        return True

    def _read_local(self) -> None:
        """Hand up to READ_LIMIT messages of the head's own API to the core."""
        for msg in self.local.take(READ_LIMIT):
            try:
                self.core.on_client(LOCAL_CLIENT, msg)
            except Exception:  # as for a socket's message: one bad message never ends the loop
                log.exception("unhandled error on the API's channel; message dropped")

    def stop(self) -> None:
        self._stop.set()

    def hold_while(self, busy: Callable[[], bool]) -> None:
        """A drain also waits, until its deadline, while `busy()` (the HTTP API's requests let in
        before their admission: they may still submit, and hear the core's 503)."""
        self._held = busy

    def drain(self, seconds: float) -> None:
        """Stop taking requests; in-flight ones have `seconds` to finish, then fail (503) and free
        their worker slots; run() returns once nothing is held on any worker. Thread-safe: the
        request is handed to the loop's thread, which owns the core; a second call can only bring
        the deadline forward."""
        with self._shutdown_lock:
            self._shutdown_requests.append(seconds)

    def _apply_shutdown(self) -> None:
        with self._shutdown_lock:
            pending, self._shutdown_requests = self._shutdown_requests, []
        for seconds in pending:
            self.core.shut_down(seconds)
            self._draining = True
