"""The operator's door to the API server: how handlers call the synchronous client."""

from __future__ import annotations

import asyncio
import contextvars
import threading

from triptych_operator import kube

HANDLER_CONTEXT: contextvars.ContextVar[str] = contextvars.ContextVar("handler_context")


def test_a_call_sees_the_handlers_context_variables() -> None:
    # kopf.event() reads kopf's settings from a context variable; a bare executor call loses it.
    async def handler() -> str:
        HANDLER_CONTEXT.set("pipeline p000")
        return await kube.run(HANDLER_CONTEXT.get)

    assert asyncio.run(handler()) == "pipeline p000"


def test_api_concurrency_calls_run_at_once() -> None:
    # Each call waits until all of them have started: with fewer threads than that, the barrier breaks.
    barrier = threading.Barrier(kube.API_CONCURRENCY, timeout=10)

    async def burst() -> list[int]:
        return await asyncio.gather(*(kube.run(barrier.wait) for _ in range(kube.API_CONCURRENCY)))

    assert sorted(asyncio.run(burst())) == list(range(kube.API_CONCURRENCY))
