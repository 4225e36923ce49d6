"""The request body limit (--max-request-bytes): 413, decided before the body is buffered.

A request that declares a larger Content-Length is refused before a byte of its body is read;
one that does not (chunked) is counted as it arrives and refused as soon as it passes the limit,
so the head never holds more than the limit (plus one network read) of any request.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from triptych_head.api.errors import error_body, send_json

TOO_LARGE = "request_too_large"


class RequestTooLarge(StarletteHTTPException):
    """Raised from `receive` once the body passes the limit; FastAPI lets HTTPExceptions through its
    body parsing, and the error handlers turn it into the OpenAI-style 413."""

    code = TOO_LARGE

    def __init__(self, limit: int) -> None:
        # The connection closes after the answer: left open, the server would read on whatever the client
        # still sends of the body (it resets the connection's idle timer with every packet).
        super().__init__(
            413, f"request body is larger than {limit} bytes (--max-request-bytes)", headers={"connection": "close"}
        )


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            body = error_body(400, "Content-Length is not a non-negative integer", code="invalid_content_length")
            await send_json(send, 400, body, {"connection": "close"})
            return
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except RequestTooLarge:
            if started:
                raise
            await self._refuse(send)  # a route read the body outside FastAPI's own parsing

    async def _refuse(self, send: Send) -> None:
        body = error_body(413, str(RequestTooLarge(self.max_bytes).detail), code=TOO_LARGE)
        # The unread rest of the body is not waited for: the connection closes after the answer.
        await send_json(send, 413, body, {"connection": "close"})


def _content_length(scope: Scope) -> int | None:
    """The declared length; None when absent, -1 when it is not a number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else -1
    return None
