"""A request's progress as Server-Sent Events, forwarded without ever holding up the pipeline.

Each request that someone may watch has a ProgressFeed. The backend reports its events
(RequestEvent: state changes, every denoising step, a preview PNG every k steps) on the event
loop; the feed turns each into one SSE message and offers it to every subscriber's bounded
queue, which never waits. A subscriber that does not keep up (a stalled connection) loses its
oldest messages (beyond 64 of them or 4 MiB) and is told how many (`dropped`); its last message,
how the request ended, always arrives. Previews have a bound of their own: a queue holds at most
MAX_PREVIEWS unread, so the oldest step still waiting there when another preview arrives is sent
without its image (a stalled client held 4 MiB of them, ~30). So a slow client costs the request nothing, and the head a
bounded buffer. The feed keeps the running request's recent history alike (64 messages, 1 MiB):
a subscriber joining late (a video's events asked for after the POST, a reloaded page) gets it
first, as if it had been there from the start, or told how many it missed. A video job's history
outlives the end by a minute (HISTORY_LINGER_S), so a client that asks for a fast job's events just
after its POST still sees its steps and previews; one joining later gets only the end (an image
stream's POST is its only subscriber: its history goes with the end).

    event: state      data: {"id", "state", "role"}
    event: step       data: {"id", "state", "role", "step", "total_steps", "preview"?: base64 PNG}
    event: suspended  data: {"id", "state", "role"}   its denoising stopped for a higher priority
    event: resumed    data: {"id", "state", "role"}   and runs again (docs/serving.md#priority-and-preemption)
    event: dropped    data: {"id", "dropped"}
    event: completed  data: the result (images: {"id", "created", "data", "server_timing"}; videos: the job)
                      a large b64_json image's written in pieces as it is encoded (StreamedMessage)
    event: error      data: {"id", "error": {"message", "code", "status", "param"?}}
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from triptych.protocol import RequestEvent

QUEUE_LIMIT = 64  # messages a subscriber may fall behind before it loses the oldest
QUEUE_BYTES = 4 << 20  # and bytes (previews are up to ~260 KB each as base64)
HISTORY_BYTES = 1 << 20  # what a running request's feed keeps for subscribers joining late
HISTORY_LINGER_S = 60.0  # and for how long after the end
KEEPALIVE_S = 15.0  # a comment line while nothing happens, so proxies keep the connection open
KEEPALIVE = b": keep-alive\n\n"
TERMINAL_EVENTS = ("completed", "error")
PREVIEW = "preview"  # a step's image
# Preview images one queue (and the history) holds unread: beyond, the oldest loses its image (its step
# stays). A client reading along gets every one; a late subscriber the last few; a stalled one holds
# MAX_PREVIEWS images, not 4 MiB of them.
MAX_PREVIEWS = 8


def role_of(event: RequestEvent) -> str | None:
    """The role a request is at, as the head named it (prompt_encoder, image_encoder, ...); None
    before or after its hops."""
    return event.role or None


@dataclass(frozen=True)
class SSEMessage:
    event: str
    data: dict[str, Any]

    @functools.cached_property
    def encoded(self) -> bytes:
        """The message on the wire (encoded once, whatever the number of subscribers)."""
        return f"event: {self.event}\ndata: {json.dumps(self.data, separators=(',', ':'))}\n\n".encode()

    @property
    def terminal(self) -> bool:
        return self.event in TERMINAL_EVENTS

    @property
    def previewed(self) -> bool:
        return self.event == "step" and PREVIEW in self.data

    @functools.cached_property
    def without_preview(self) -> SSEMessage:
        """The step without its image, once a newer preview replaced it in a queue (made once for all)."""
        return SSEMessage(self.event, {k: v for k, v in self.data.items() if k != PREVIEW})


class StreamedMessage:
    """A terminal message whose data, one line of JSON, is written in pieces as they are made (a large
    image's `completed`: image_body.py), never held whole. It can be sent once: only a feed with one
    subscriber (an image stream's) publishes one."""

    terminal = True
    encoded = b""  # what it adds to a queue's bytes: nothing yet

    def __init__(self, event: str, data: AsyncIterator[bytes]) -> None:
        self.event, self.data = event, data

    async def pieces(self) -> AsyncIterator[bytes]:
        yield f"event: {self.event}\ndata: ".encode()
        async for piece in self.data:
            yield piece
        yield b"\n\n"


Message = SSEMessage | StreamedMessage
# Ends a subscriber's stream without an event (ProgressFeed.close): the job moved to another head,
# and the client, its stream broken, reconnects to follow it there (any head follows it through the store).
CLOSE = SSEMessage("close", {})


def message_of(request_id: str, event: RequestEvent) -> SSEMessage:
    """One backend event as the SSE message clients see."""
    data: dict[str, Any] = {"id": request_id, "state": event.state, "role": role_of(event)}
    if event.preemption:
        return SSEMessage(event.preemption, data)
    if not event.total_steps:
        return SSEMessage("state", data)
    data.update(step=event.step, total_steps=event.total_steps)
    if event.preview:
        data["preview"] = base64.b64encode(event.preview).decode()
    return SSEMessage("step", data)


def error_message(request_id: str, message: str, code: str | None, status: int, param: str | None = None) -> SSEMessage:
    """The error event; `param`, when given: the request field the error names (as in an error body)."""
    error = {"message": message, "code": code, "status": status, **({"param": param} if param else {})}
    return SSEMessage("error", {"id": request_id, "error": error})


class Subscriber:
    """One client's bounded queue of messages: offering never blocks, the oldest go first when full,
    and at most MAX_PREVIEWS preview images wait (an older step still queued keeps its step, not its image)."""

    def __init__(self, limit: int = QUEUE_LIMIT, max_bytes: int = QUEUE_BYTES) -> None:
        self._queue: deque[Message] = deque()
        self._limit, self._max_bytes = limit, max_bytes
        self._bytes = 0
        self._previewed: deque[SSEMessage] = deque()  # the queued messages carrying a preview, in order
        self._wake = asyncio.Event()
        self.dropped = 0  # lost since the client last read
        self.previews_dropped = 0  # images replaced by a newer one before the client read them

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def offer(self, msg: Message) -> None:
        if isinstance(msg, SSEMessage) and msg.previewed:
            if len(self._previewed) >= MAX_PREVIEWS:
                self._drop_preview()
            self._previewed.append(msg)
        self._queue.append(msg)
        self._bytes += len(msg.encoded)
        while len(self._queue) > 1 and (len(self._queue) > self._limit or self._bytes > self._max_bytes):
            self._taken(self._queue.popleft())
            self.dropped += 1
        self._wake.set()

    def _drop_preview(self) -> None:
        """The oldest queued preview loses its image to a newer one."""
        old = self._previewed.popleft()
        for i, queued in enumerate(self._queue):  # at most `limit` of them
            if queued is old:
                self._queue[i] = old.without_preview
                self._bytes -= len(old.encoded) - len(old.without_preview.encoded)
                self.previews_dropped += 1
                return

    def _taken(self, msg: Message) -> None:
        """`msg` left the queue (read, or dropped)."""
        self._bytes -= len(msg.encoded)
        if self._previewed and msg is self._previewed[0]:  # both leave in order
            self._previewed.popleft()

    def replay(self, history: Subscriber) -> None:
        """Start with what `history` holds (and the count it lost), as if subscribed all along."""
        self.dropped += history.dropped
        for msg in history._queue:
            self.offer(msg)

    async def messages(self, request_id: str) -> AsyncIterator[bytes]:
        """The encoded messages, in order, until the terminal one; keep-alive comments in between."""
        while True:
            if not self._queue:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), KEEPALIVE_S)
                except TimeoutError:
                    yield KEEPALIVE
                continue
            if self.dropped:
                dropped, self.dropped = self.dropped, 0
                yield SSEMessage("dropped", {"id": request_id, "dropped": dropped}).encoded
            msg = self._queue.popleft()
            self._taken(msg)
            if msg is CLOSE:
                return
            if isinstance(msg, StreamedMessage):
                async for piece in msg.pieces():
                    yield piece
            else:
                yield msg.encoded
            if msg.terminal:
                return


class ProgressFeed:
    """The progress of one request, fanned out to its subscribers."""

    def __init__(self, request_id: str, linger_s: float = 0.0) -> None:
        """`linger_s`: how long the history outlives the end (HISTORY_LINGER_S for a video job, whose
        events are asked for after its POST; 0 for an image stream, whose POST is its only subscriber)."""
        self.request_id = request_id
        self.linger_s = linger_s
        self.subscribers: set[Subscriber] = set()
        self.history = Subscriber(QUEUE_LIMIT, HISTORY_BYTES)  # never read: what a late subscriber missed
        self.final: Message | None = None

    def on_event(self, event: RequestEvent) -> None:
        """The backend's callback (runs on the event loop; never waits)."""
        self.publish(message_of(self.request_id, event))

    def publish(self, msg: Message) -> None:
        if self.final is not None:
            return
        if msg.terminal:
            self.final = msg
        else:
            self.history.offer(msg)
        for sub in self.subscribers:
            sub.offer(msg)
        if msg.terminal:
            self.subscribers.clear()
            self._forget_history_later()

    def _forget_history_later(self) -> None:
        """After linger_s the end is all a later subscriber gets (at once without one, or outside an event loop)."""
        if self.linger_s > 0:
            try:
                asyncio.get_running_loop().call_later(self.linger_s, self._forget_history)
                return
            except RuntimeError:  # no running loop: nothing would ever call it
                pass
        self._forget_history()

    def _forget_history(self) -> None:
        self.history = Subscriber()

    def close(self) -> None:
        """End every subscriber's stream now, without an end event (the job is another head's now)."""
        for sub in self.subscribers:
            sub.offer(CLOSE)
        self.subscribers.clear()

    def subscribe(self) -> Subscriber:
        sub = Subscriber()
        sub.replay(self.history)
        if self.final is not None:
            sub.offer(self.final)
        else:
            self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    def response(self) -> StreamingResponse:
        """An SSE response for a new subscriber; it unsubscribes when the client goes or the stream ends."""
        sub = self.subscribe()

        async def stream() -> AsyncIterator[bytes]:
            try:
                async for chunk in sub.messages(self.request_id):
                    yield chunk
            finally:
                self.unsubscribe(sub)

        return sse_response(stream())


def sse_response(stream: AsyncIterator[bytes]) -> StreamingResponse:
    # X-Accel-Buffering: nginx (and ingress-nginx) must pass each event on at once.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
