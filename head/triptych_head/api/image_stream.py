"""POST /v1/images/generations and /v1/images/edits with `stream: true`: the request's progress as
Server-Sent Events (progress.py), every state and denoising step (a preview every `preview_every`
steps), then `completed` carrying what the plain answer would hold, or `error`. A large b64_json
`completed` is written as the plain answer is (image_body.py): one PNG and one chunk of its base64
at a time, never the event whole.

The request runs in its own task, which never waits for the client; a client that goes away
cancels it. Under an Idempotency-Key (idempotent.py) the key's one run streams here, and a retry of
a finished run gets its `completed` event alone (`Idempotent-Replayed: true`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from triptych.params import GenerationParams
from triptych_head.api.context import REQUEST_ID_HEADER, HeadContext, errors_named, new_request_id
from triptych_head.api.deadlines import Deadline, estimate_seconds, with_estimate
from triptych_head.api.errors import APIError, internal_error
from triptych_head.api.idempotent import REPLAYED, stream_once
from triptych_head.api.key_limits import key_limit
from triptych_head.api.ownership import owner_of
from triptych_head.api.progress import ProgressFeed, SSEMessage, StreamedMessage, error_message, sse_response
from triptych_head.backend import GenerationOutput
from triptych_head.deadline import Estimate
from triptych_head.idempotency import Answer, Body

log = logging.getLogger(__name__)

# The `completed` event's data: whole, or its JSON in pieces as it is encoded (a large b64_json answer).
Completed = dict[str, Any] | AsyncIterator[bytes]
Respond = Callable[[GenerationOutput, str], Awaitable[Completed]]  # the `completed` of an output and request id


class ImageStream:
    """One streamed image request: generated with its progress published to a feed."""

    def __init__(
        self,
        ctx: HeadContext,
        params: GenerationParams,
        request: Request,
        level: int,
        preview_every: int,
        respond: Respond,
    ) -> None:
        self.ctx, self.params, self.request, self.level = ctx, params, request, level
        self.preview_every, self.respond = preview_every, respond
        self.request_id = new_request_id("img")
        self.feed = ProgressFeed(self.request_id)

    def admitted(self, deadline: Deadline) -> Response:
        """Admit it (refused: an HTTP error) and stream its run."""
        estimate = self._admit(deadline)
        answer = asyncio.ensure_future(self._released())
        return with_estimate(progress_response(self.feed, answer), estimate_seconds(estimate))

    async def under_key(self, key: str, fingerprint: str, deadline: Deadline) -> Response:
        """The key's one run streamed here, or the earlier run's `completed` event alone; a key
        reused, still running after the wait, or a run refused before it started: an HTTP error."""
        estimates: list[Estimate | None] = []

        async def run(started: Callable[[], None]) -> Body:
            estimates.append(self._admit(deadline))
            started()
            done = await self._released()  # in pieces: stored as they are encoded, never whole
            return json.dumps(done, separators=(",", ":")).encode() if isinstance(done, dict) else done

        task, earlier = await stream_once(self.ctx, self.request, key, fingerprint, run)
        if earlier is not None:
            done = _completed_in(earlier)
            replayed: asyncio.Future[Completed] = asyncio.get_running_loop().create_future()
            replayed.set_result(done)
            request_id = done.get("id", self.request_id) if isinstance(done, dict) else self.request_id
            return progress_response(ProgressFeed(request_id), replayed, {REPLAYED: "true"})
        answer = asyncio.ensure_future(_completed_of(task))
        return with_estimate(
            progress_response(self.feed, answer), estimate_seconds(estimates[0] if estimates else None)
        )

    def _admit(self, deadline: Deadline) -> Estimate | None:
        """Count it in (APIError when refused: overloaded, past its deadline, over its key's limits)."""
        request = self.request
        with errors_named(self.request_id):
            return self.ctx.admit(
                self.request_id, self.params, deadline, key=key_limit(request), owner=owner_of(request)
            )

    async def _released(self) -> Completed:
        """The admitted request's run, released when it ends however it ends (even before it started)."""
        try:
            return await self._completed()
        finally:
            self.ctx.release(self.request_id)

    async def _completed(self) -> Completed:
        """Generate with the feed getting the progress events; the `completed` event's data."""
        ctx, request_id = self.ctx, self.request_id
        output = await ctx.generate(self.params, request_id, self.feed.on_event, self.preview_every, self.level)
        return await self.respond(output, request_id)


def progress_response(
    feed: ProgressFeed, answer: asyncio.Future[Completed], headers: dict[str, str] | None = None
) -> StreamingResponse:
    """The feed's events as SSE, then `completed` with what `answer` ends with, or `error`. A client
    that goes away cancels the answer."""
    sub = feed.subscribe()
    request_id = feed.request_id

    def publish(done: asyncio.Future[Completed]) -> None:
        if done.cancelled():
            feed.publish(error_message(request_id, "cancelled", "cancelled", 499))
        elif isinstance(exc := done.exception(), APIError):
            feed.publish(error_message(request_id, exc.message, exc.code, exc.status_code, exc.param))
        elif exc is not None:  # the stream must still end, with the error
            log.error("streamed image request %s failed", request_id, exc_info=exc)
            feed.publish(error_message(request_id, internal_error(request_id), "internal_error", 500))
        elif isinstance(data := done.result(), dict):
            feed.publish(SSEMessage("completed", data))
        else:  # a large b64_json answer: its pieces encoded as they are sent
            feed.publish(StreamedMessage("completed", data))

    answer.add_done_callback(publish)

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for chunk in sub.messages(request_id):
                yield chunk
        finally:  # the stream ended, or the client went away before the result
            feed.unsubscribe(sub)
            if not answer.done():
                answer.cancel()

    response = sse_response(stream())
    response.headers.update({REQUEST_ID_HEADER: request_id, **(headers or {})})
    return response


async def _completed_of(run: asyncio.Task[tuple[Answer, bool]]) -> Completed:
    """The `completed` data the key's run on this head answers (cancelled with it)."""
    body, _ = await run
    return _completed_in(body)


def _completed_in(stored: Answer) -> Completed:
    """A key's stored `completed` data: read, or (a large one) streamed out of the store as it is sent."""
    if isinstance(stored, bytes):
        return dict(json.loads(stored))
    return _pieces_of(stored)


async def _pieces_of(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    async for chunk in iterate_in_threadpool(chunks):  # blocking reads of the store, off the loop
        yield chunk
