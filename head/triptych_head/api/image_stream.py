"""POST /v1/images/generations and /v1/images/edits with `stream: true`: the request's progress as
Server-Sent Events (progress.py), every state and denoising step (a preview every `preview_every`
steps), then `completed` carrying what the plain answer would hold, or `error`.

The request runs in its own task, which never waits for the client; a client that goes away
cancels it. Under an Idempotency-Key (idempotent.py) the key's one run streams here, and a retry of
a finished run gets its `completed` event alone (`Idempotent-Replayed: true`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from triptych.params import GenerationParams
from triptych_head.api.context import HeadContext, new_request_id
from triptych_head.api.deadlines import Deadline, estimate_seconds, with_estimate
from triptych_head.api.errors import APIError
from triptych_head.api.idempotent import REPLAYED, stream_once
from triptych_head.api.key_limits import key_limit
from triptych_head.api.progress import ProgressFeed, SSEMessage, error_message, sse_response
from triptych_head.backend import GenerationOutput
from triptych_head.deadline import Estimate
from triptych_head.idempotency import Answer

log = logging.getLogger(__name__)

Respond = Callable[[GenerationOutput, str], Awaitable[BaseModel]]  # the plain answer of an output and request id
Completed = dict[str, Any]  # the `completed` event's data


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

        async def run(started: Callable[[], None]) -> bytes:
            estimates.append(self._admit(deadline))
            started()
            return json.dumps(await self._released(), separators=(",", ":")).encode()

        task, earlier = await stream_once(self.ctx, self.request, key, fingerprint, run)
        if earlier is not None:
            done = json.loads(earlier)
            replayed: asyncio.Future[Completed] = asyncio.get_running_loop().create_future()
            replayed.set_result(done)
            return progress_response(ProgressFeed(done.get("id", self.request_id)), replayed, {REPLAYED: "true"})
        answer = asyncio.ensure_future(_completed_of(task))
        return with_estimate(
            progress_response(self.feed, answer), estimate_seconds(estimates[0] if estimates else None)
        )

    def _admit(self, deadline: Deadline) -> Estimate | None:
        """Count it in (APIError when refused: overloaded, past its deadline, over its key's limits)."""
        return self.ctx.admit(self.request_id, self.params, deadline, key=key_limit(self.request))

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
        answer = await self.respond(output, request_id)
        return {"id": request_id, **answer.model_dump(), "server_timing": output.server_timing}  # headers went first


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
            feed.publish(error_message(request_id, f"{type(exc).__name__}: {exc}", "internal_error", 500))
        else:
            feed.publish(SSEMessage("completed", done.result()))

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
    response.headers.update(headers or {})
    return response


async def _completed_of(run: asyncio.Task[tuple[Answer, bool]]) -> Completed:
    """The `completed` data the key's run on this head answers (cancelled with it)."""
    body, _ = await run
    return dict(json.loads(body if isinstance(body, bytes) else b"".join(body)))
