"""The operator's door to the API server: how handlers call the synchronous client."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

import pytest

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


def _live_deployment(monkeypatch: pytest.MonkeyPatch, labels: dict[str, str]) -> None:
    live = {"kind": "Deployment", "metadata": {"name": "svc-prompt-encoder", "labels": labels}}

    def get(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return live

    monkeypatch.setattr(kube, "_get", get)


def test_an_object_another_pipeline_has_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """svc's split prompt encoder and svc-prompt's combined encoder are both svc-prompt-encoder."""
    ours = {"app.kubernetes.io/managed-by": "triptych-operator", "app.kubernetes.io/instance": "svc"}
    _live_deployment(monkeypatch, ours)
    assert kube.get_managed("apps/v1", "Deployment", "svc-prompt-encoder", "ml", "svc") is not None
    with pytest.raises(kube.ApplyError) as refused:
        kube.get_managed("apps/v1", "Deployment", "svc-prompt-encoder", "ml", "svc-prompt")
    assert str(refused.value) == (
        "Deployment svc-prompt-encoder already belongs to DiffusionPipeline svc: metadata.name 'svc-prompt' "
        "renders the same name for one of its objects; rename this pipeline"
    )


def test_an_object_the_operator_does_not_manage_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _live_deployment(monkeypatch, {})
    with pytest.raises(kube.ApplyError, match="is not managed by triptych-operator"):
        kube.get_managed("apps/v1", "Deployment", "svc-prompt-encoder", "ml", "svc")
