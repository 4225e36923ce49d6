"""A head's HTTP application called through ASGI in this process: no socket, no HTTP parsing, the
answer's body counted (and kept only when asked) as it is sent. For tests and benchmarks that
measure the application itself (its memory, its CPU), over a backend that answers at once."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from triptych_head.backend import GenerationOutput

IMAGES = "/v1/images/generations"


class FixedPixels:
    """A head's backend (triptych_head.backend) answering every request at once with the same
    pixels, made before any measurement starts."""

    def __init__(self, pixels: np.ndarray, server_timing: str = "total;dur=1") -> None:
        self.pixels = pixels
        self.server_timing = server_timing

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def cancel(self, request_id: str) -> None:
        pass

    async def generate(self, request_id, params, on_event=None, preview_every=0, priority=1):  # type: ignore[no-untyped-def]
        return GenerationOutput(pixels=self.pixels, server_timing=self.server_timing)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    size: int  # the body's bytes
    body: bytes  # empty unless kept


async def post(
    app: Any,
    body: dict[str, Any] | bytes,
    keep: bool = False,
    headers: list[tuple[bytes, bytes]] | None = None,
    content_type: bytes = b"application/json",
    path: str = IMAGES,
) -> Answer:
    """One POST of `body` (a dict is sent as its JSON) to `app`. The client stays connected until
    the answer's last byte, as a waiting client does (a handler watching for it to leave sees nothing)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {},
        "headers": [(b"host", b"test"), (b"content-type", content_type),
                    (b"content-length", str(len(raw)).encode()), *(headers or [])],
    }  # fmt: skip
    answered = asyncio.Event()
    delivered = False
    answer = Answer(0, {}, 0, b"")
    kept: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            answer.size += len(message.get("body", b""))
            if keep:
                kept.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    await app(scope, receive, send)
    answer.body = b"".join(kept)
    return answer
