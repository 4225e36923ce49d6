"""The head's sockets to its workers: one PUSH per instance (the edge half of membership.Transport).

Work sockets use ZMQ_IMMEDIATE, so a send to an instance that is not connected fails at once
instead of queueing work for a worker that may never come.
"""

from __future__ import annotations

from typing import Any

import zmq

from triptych.security import ControlPlane
from triptych.sockets import connect, send_message


class WorkerLinks:
    def __init__(self, ctx: zmq.Context, security: ControlPlane | None = None):
        self._ctx = ctx
        self._security = security
        self._sockets: dict[str, zmq.Socket] = {}

    def open(self, url: str) -> str | None:
        if url in self._sockets:
            return None
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        try:
            if self._security is not None:
                self._security.client(sock)
            connect(sock, url)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            return str(exc)
        self._sockets[url] = sock
        return None

    def close(self, url: str) -> None:
        sock = self._sockets.pop(url, None)
        if sock is not None:
            sock.close(linger=0)

    def send(self, url: str, msg: Any) -> bool:
        sock = self._sockets.get(url)
        if sock is None:
            return False
        try:
            send_message(sock, msg, (), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close_all(self, linger_ms: int = 0) -> None:
        """Close every socket; messages still queued get up to `linger_ms` to leave."""
        for sock in self._sockets.values():
            sock.close(linger=linger_ms)
        self._sockets.clear()
