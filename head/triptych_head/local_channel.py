"""How the head's HTTP API reaches the DiffusionServer in its own process: a queue each way, no socket.

The API's event loop and the server's thread share the process, so a request needs neither a
socket nor an encoding to cross: the API puts the typed message (Submit, Cancel) on a queue and
wakes the server's poll through an eventfd it polls beside its sockets; the server hands each
answer (RequestEvent, RequestResult and its pixel frames) to the API's loop with
call_soon_threadsafe. Measured against the frontend ROUTER over loopback TCP this replaced
(docs/benchmarks.md, "HTTP"): no encode/decode, no ZMQ I/O thread, no asyncio socket bookkeeping.

The server's frontend ROUTER stays for clients in other processes (bench/head_bench.py, tests);
the core tells the two apart only by the client id it replies to (LOCAL_CLIENT here).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

# Replies to this client id go to the channel, never to the frontend ROUTER, whose messages from a peer
# that names itself so (ZMQ lets a peer choose its routing id) the server drops.
LOCAL_CLIENT = b"\x00local"

Deliver = Callable[[Any, Sequence[Any]], None]  # (message, frames), called on the server's thread


class ChannelClosed(RuntimeError):
    """The DiffusionServer's loop has ended: nothing put on its channel will be read."""


class LocalChannel:
    """Messages from the API to the server (put, on any thread; take, on the server's thread) and
    answers back (deliver, on the server's thread, to the callbacks the API connected)."""

    def __init__(self) -> None:
        self._inbox: deque[Any] = deque()
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # readable while the inbox may hold messages
        self._deliver: Deliver | None = None
        self._on_close: Callable[[], None] | None = None
        self._lock = threading.Lock()  # a put never writes to the fd once close() has released it
        self._closed = False

    def connect(self, deliver: Deliver, on_close: Callable[[], None] | None = None) -> None:
        """The API's receiver of answers, and what to call once the server's loop has ended (the
        requests it held will not be answered); neither may block (they schedule work on the API's loop)."""
        self._deliver, self._on_close = deliver, on_close

    def put(self, msg: Any) -> None:
        """A message for the server; wakes its poll. ChannelClosed once its loop has ended."""
        with self._lock:
            if self._closed:
                raise ChannelClosed("the head's DiffusionServer has stopped")
            self._inbox.append(msg)
            os.eventfd_write(self.fd, 1)

    def take(self, limit: int) -> list[Any]:
        """Up to `limit` queued messages, oldest first (the server's thread, when `fd` is readable).
        The wake-up is consumed first, so a message put meanwhile wakes the next poll."""
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass
        taken: list[Any] = []
        while self._inbox and len(taken) < limit:
            taken.append(self._inbox.popleft())
        if self._inbox:  # more than `limit`: poll again at once for the rest
            os.eventfd_write(self.fd, 1)
        return taken

    def reply(self, msg: Any, frames: Sequence[Any] = ()) -> None:
        """An answer for the API (the server's thread); dropped when no API is connected."""
        if self._deliver is not None:
            self._deliver(msg, frames)

    def close(self) -> None:
        """The server's loop has ended (its last answers are out): refuse puts, tell the API. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self.fd)
            self._inbox.clear()
        if self._on_close is not None:
            self._on_close()
