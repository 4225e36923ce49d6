"""A webhook receiver for tests: a real HTTP server on loopback that records every POST and answers
each with the next of a scripted list of statuses (200 once the list is used up), and a check of a
delivery's signature written from the Standard Webhooks specification, not from the head's code."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.server
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Delivery:
    headers: dict[str, str]
    body: bytes

    @property
    def event(self) -> dict[str, Any]:
        return json.loads(self.body)


@dataclass
class Receiver:
    url: str
    answers: list[int] = field(default_factory=list)  # statuses to answer with, in turn; then 200
    retry_after: str | None = None  # sent with each scripted non-2xx answer
    received: list[Delivery] = field(default_factory=list)

    def wait(self, count: int, timeout: float = 30.0) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        while len(self.received) < count:
            assert time.monotonic() < deadline, f"{len(self.received)} of {count} webhook POSTs arrived"
            time.sleep(0.02)
        return self.received


def verified(delivery: Delivery, key: bytes, tolerance_s: float = 300.0) -> bool:
    """The specification's check: v1 = base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")) among the
    signatures, and a timestamp within the tolerance of now."""
    event_id, timestamp = delivery.headers["webhook-id"], delivery.headers["webhook-timestamp"]
    expected = base64.b64encode(
        hmac.new(key, f"{event_id}.{timestamp}.".encode() + delivery.body, hashlib.sha256).digest()
    ).decode()
    given = [s.split(",", 1)[1] for s in delivery.headers["webhook-signature"].split() if s.startswith("v1,")]
    fresh = abs(time.time() - int(timestamp)) <= tolerance_s
    return fresh and any(hmac.compare_digest(expected, s) for s in given)


@contextmanager
def webhook_receiver(answers: list[int] | None = None, retry_after: str | None = None) -> Iterator[Receiver]:
    receiver = Receiver("", list(answers or []), retry_after)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            receiver.received.append(Delivery({k.lower(): v for k, v in self.headers.items()}, body))
            status = receiver.answers.pop(0) if receiver.answers else 200
            self.send_response(status)
            if status >= 300 and receiver.retry_after is not None:
                self.send_header("Retry-After", receiver.retry_after)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_port}/hooks/triptych"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
