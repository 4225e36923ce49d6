"""A lean HTTP/1.1 load client for the benchmarks: keep-alive connections on asyncio streams.

httpx spends about 2.4 ms of CPU per request in the client (measured 2026-12-03 on this project's
2-core machine against the head's 2.5 ms), so on a small machine an httpx closed loop measures
the client as much as the head. This client sends one pre-encoded request per connection at a
time and reads the answer by its Content-Length (or chunked encoding), checking the status: a
fraction of a millisecond per request, the head's cost is what is left.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

TIMEOUT_S = 60.0


class HTTPError(RuntimeError):
    pass


def post_json(path: str, host: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    """The bytes of a POST with a JSON body, sent as they are on every request of a run."""
    payload = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
             f"Content-Length: {len(payload)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response's status and body (Content-Length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head[:-4].split(b"\r\n")
    status = int(status_line.split(b" ", 2)[1])
    length, chunked = None, False
    for line in header_lines:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if length is not None:
        return status, await reader.readexactly(length)
    if not chunked:
        raise HTTPError(f"response without Content-Length or chunked encoding: {head[:200]!r}")
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        parts.append(await reader.readexactly(size + 2))
        if size == 0:
            return status, b"".join(p[:-2] for p in parts)


async def closed_loop(base: str, request: bytes, n: int, concurrency: int) -> float:
    """n requests over `concurrency` keep-alive connections, each one request at a time; requests/second.
    Any status but 200 raises HTTPError."""
    url = urlsplit(base)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    left = iter(range(n))

    async def connection() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            for _ in left:
                writer.write(request)
                status, body = await asyncio.wait_for(read_response(reader), TIMEOUT_S)
                if status != 200:
                    raise HTTPError(f"HTTP {status}: {body[:300]!r}")
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(min(concurrency, n))))
    return n / (time.perf_counter() - t0)
