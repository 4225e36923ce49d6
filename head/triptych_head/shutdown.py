"""How the head stops: on SIGTERM (or Ctrl-C) it drains instead of dropping what it accepted.

1. At once: /ready answers 503 (the Service stops sending it traffic) and new generation
   requests get 503 with Retry-After.
2. Accepted requests have --disagg-drain-timeout seconds to finish; whatever is left then fails with a
   503 saying so, and every worker slot it held is released (DiffusionServer.drain). Requests let in
   but not yet admitted (waiting on another run of their Idempotency-Key, fetching a reference) are
   waited for as well: they end with their replay, or the core's 503 when they submit.
3. The HTTP server lets the last responses go out, video jobs are saved, and the process exits 0.

A second signal brings the deadline forward to now. However its requests are stuck, the head is
gone within --disagg-drain-timeout + HEAD_SHUTDOWN_OVERHEAD_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Generator
from types import FrameType

import uvicorn

from triptych import startup
from triptych.config import ServeArgs
from triptych.ports import host_port
from triptych.tls_reload import CertificateReloader
from triptych_head.api.context import HeadContext
from triptych_head.server import DiffusionServer

log = logging.getLogger(__name__)

FLUSH_S = 5.0  # after the drain: how long the last HTTP responses may take to go out
SIGNALS = (signal.SIGTERM, signal.SIGINT)

Drain = Callable[[float], Awaitable[None]]  # finish or fail every accepted request within the seconds given


class DrainingServer(uvicorn.Server):
    """uvicorn, but a signal starts a bounded drain of the backend before the HTTP server stops.

    uvicorn's own handling waits, unbounded, for every open request, then re-raises the signal
    (the process would die of it rather than exit 0).
    """

    def __init__(self, config: uvicorn.Config, ctx: HeadContext, drain: Drain, hurry: Callable[[], None]):
        super().__init__(config)
        self._ctx = ctx
        self._drain = drain
        self._hurry = hurry
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None
        self._reloading: asyncio.Task[None] | None = None  # the HTTPS certificate's (triptych/tls_reload.py)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        config = self.config
        scheme = "https" if config.ssl is not None else "http"
        log.info("HTTP API on %s://%s", scheme, host_port(config.host, config.port))  # uvicorn names none for a socket
        if config.ssl is not None and config.ssl_certfile and config.ssl_keyfile:
            reloader = CertificateReloader(config.ssl, str(config.ssl_certfile), str(config.ssl_keyfile))
            self._reloading = self._loop.create_task(reloader.run())
        startup.done("listening")

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread; whoever runs us elsewhere stops us
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None:  # not serving yet: nothing was accepted, nothing to drain
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain, signal.Signals(sig).name)

    def _begin_drain(self, name: str) -> None:
        if self._draining is not None:
            log.warning("%s again: failing what is left of the drain now", name)
            self._hurry()
            return
        self._ctx.draining = True
        log.info("%s: draining; new requests get 503, accepted ones may finish", name)
        self._draining = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain(self._ctx.drain_seconds)
        except Exception:
            log.exception("draining failed; stopping anyway")
        finally:
            log.info("drained; stopping the HTTP server")
            self.should_exit = True


def disaggregated_drain(
    server: DiffusionServer, loop_thread: threading.Thread, ctx: HeadContext
) -> tuple[Drain, Callable[[], None]]:
    """Drain for the DiffusionServer: it fails what is left at the deadline, then its loop ends; until
    then it also waits for the HTTP requests let in and not yet admitted (they may still submit)."""
    server.hold_while(lambda: bool(ctx.at_door))

    async def drain(seconds: float) -> None:
        server.drain(seconds)
        await asyncio.to_thread(loop_thread.join, seconds + FLUSH_S)

    return drain, lambda: server.drain(0)


def in_process_drain(ctx: HeadContext) -> tuple[Drain, Callable[[], None]]:
    """Drain for monolithic mode: wait for the requests being generated, cancel any left at the deadline."""
    hurry = asyncio.Event()

    async def drain(seconds: float) -> None:
        try:
            await asyncio.wait_for(_until_idle(ctx, hurry), seconds)
        except TimeoutError:
            pass
        ctx.drain_expired = True
        for request_id in list(ctx.active):
            await ctx.backend.cancel(request_id)

    return drain, hurry.set


async def _until_idle(ctx: HeadContext, hurry: asyncio.Event) -> None:
    while (ctx.active or ctx.at_door) and not hurry.is_set():
        await asyncio.sleep(0.05)


def serve_http(
    app: object, ctx: HeadContext, args: ServeArgs, sock: socket.socket, drain: Drain, hurry: Callable[[], None]
) -> None:
    """Run the HTTP API on `sock` (http_socket.bind_http; HTTPS with --ssl-certfile/--ssl-keyfile,
    reloaded when they change) until a signal has drained it."""
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,  # its lines go through the process's own handler (triptych.log_format): one format
        access_log=False,
        timeout_graceful_shutdown=int(FLUSH_S),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
    )
    try:
        DrainingServer(config, ctx, drain, hurry).run(sockets=[sock])
    finally:
        ctx.media.close()  # an encode no answer waits for any more does not hold up the exit
