"""The Idempotency-Key header on POST /v1/images/generations, /v1/images/edits and /v1/videos
(idempotency.py has the rules): a retry with the same key and body answers what the first run
answered (with `Idempotent-Replayed: true`), whichever head it reaches, and never starts a second
run while one is going. A streamed image request's answer is its `completed` event: a replay is
that one event."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from triptych.contract import CONTRACT
from triptych_head.api.auth import bearer_token
from triptych_head.api.context import HeadContext
from triptych_head.api.deadlines import FIELD as DEADLINE_FIELD
from triptych_head.api.errors import APIError
from triptych_head.api.reference import Reference
from triptych_head.idempotency import MAX_KEY_LENGTH, Answer, Body, InProgress, KeyReused, valid_key

HEADER = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"


def idempotency_key(request: Request) -> str | None:
    """The request's key, or None without one; 400 naming the header for one that cannot be a key."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not valid_key(key):
        raise APIError(
            400,
            f"{HEADER} {key[:80]!r} is not a key: use 1-{MAX_KEY_LENGTH} printable ASCII characters without "
            "spaces (a UUID, say)",
            HEADER,
        )
    return key


def fingerprint(endpoint: str, values: dict[str, Any], reference: Reference | None = None) -> str:
    """What makes two requests the same request: the endpoint, the body's fields, the reference image
    (not the deadline: a retry has less time left, and is still the same request). A field at the
    contract's default counts as not given: a release that adds a field (at a default that means "as
    before") gives a retry reaching it the fingerprint the first run's head gave it."""
    digest = hashlib.sha256(endpoint.encode())
    defaults = _defaults(endpoint)
    same = {k: v for k, v in values.items() if k != DEADLINE_FIELD and (k not in defaults or v != defaults[k])}
    digest.update(json.dumps(same, sort_keys=True, default=str).encode())
    if reference is not None:
        digest.update(reference.identity)
    return digest.hexdigest()


@functools.cache
def _defaults(endpoint: str) -> dict[str, Any]:
    """The contract's default of each optional field of `endpoint`'s body (worked out once)."""
    return {p.name: p.default_for(endpoint) for p in CONTRACT.taken_by(endpoint) if not p.required}


async def answer_once(
    ctx: HeadContext, request: Request, key: str, fingerprint: str, run: Callable[[], Awaitable[BaseModel | Body]]
) -> Response:
    """Run the request unless its key ran (or runs) already; answer the key's one run either way.
    `run` answers a response model, or the JSON body itself (bytes, or chunks as they are encoded:
    a large one is stored and sent back without ever being held whole)."""

    async def encoded() -> Body:
        answer = await run()
        return answer.model_dump_json().encode() if isinstance(answer, BaseModel) else answer

    try:
        body, replayed = await ctx.idempotency.once(_scope(request), key, fingerprint, encoded, ctx.idempotency_wait_s)
    except (KeyReused, InProgress) as exc:
        raise _key_error(key, exc) from None
    if replayed:
        ctx.idempotent_replays.inc()
    headers = {REPLAYED: "true"} if replayed else None
    if isinstance(body, bytes):
        return Response(body, media_type="application/json", headers=headers)
    return StreamingResponse(body, media_type="application/json", headers=headers)  # read from the store


Run = asyncio.Task[tuple[Answer, bool]]


async def stream_once(
    ctx: HeadContext,
    request: Request,
    key: str,
    fingerprint: str,
    run: Callable[[Callable[[], None]], Awaitable[Body]],
) -> tuple[Run, Answer | None]:
    """A streamed request (`stream: true`) under its key: answered before its response starts, so a
    key reused, still running elsewhere, or a run refused before it started (admission) is an HTTP
    error like a plain request's. `run(started)` is awaited only when this head runs the key's
    attempt, calls `started()` once it is under way, and returns the `completed` event's data (what
    a replay answers: whole, or in pieces as they are encoded, stored without being held whole).
    Returns (the key's run, None) when this head runs it: the caller streams its progress, and the
    run's task ends with its answer; (the ended run, the earlier answer) when the key ran before
    (whole, or a large one streamed out of the store)."""
    loop = asyncio.get_running_loop()
    started: asyncio.Future[None] = loop.create_future()

    def mark_started() -> None:
        if not started.done():
            started.set_result(None)

    async def attempt() -> Body:
        return await run(mark_started)

    task: Run = asyncio.ensure_future(
        ctx.idempotency.once(_scope(request), key, fingerprint, attempt, ctx.idempotency_wait_s)
    )
    try:
        either: set[asyncio.Future[Any]] = {task, started}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if started.done():
        return task, None
    try:
        body, _ = task.result()  # an ended task that never started a run here: a replay, or an error
    except (KeyReused, InProgress) as exc:
        raise _key_error(key, exc) from None
    ctx.idempotent_replays.inc()
    return task, body


def _scope(request: Request) -> str:
    return hashlib.sha256(bearer_token(request.scope) or b"").hexdigest()  # a tenant's keys are its own


def _key_error(key: str, exc: KeyReused | InProgress) -> APIError:
    if isinstance(exc, KeyReused):
        return APIError(
            422,
            f"{HEADER} {key!r} was used for a different request; use a new key for a new request",
            HEADER,
            code="idempotency_key_reused",
        )
    return APIError(
        409,
        f"the request with {HEADER} {key!r} is still running (on this head or another); retry to get its answer",
        HEADER,
        code="idempotency_key_in_progress",
        headers={"Retry-After": "5"},
    )
