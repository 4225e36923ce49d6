"""/v1/models, /v1/contract, /v1/usage, /health, /v1/pipeline, /ready, /metrics (results are served by files.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from triptych import startup
from triptych.contract import ENDPOINTS
from triptych_head.api.context import RETRY_AFTER_S, HeadContext
from triptych_head.api.key_limits import key_limit
from triptych_head.api.ownership import owner_of
from triptych_head.api.schemas import ModelCard, ModelList

router = APIRouter(tags=["system"])


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    ctx: HeadContext = request.app.state.ctx
    model = ctx.model
    cards = [  # one card per name a request may use, the model's id first
        ModelCard(id=name, created=ctx.started, pipeline=model.pipeline_class, kind=model.kind, edits=model.edits)
        for name in model.names
    ]
    return ModelList(data=cards)


@router.get("/v1/contract")
async def contract(request: Request) -> dict[str, Any]:
    """The parameters each endpoint takes, with this model's limits (its family narrows the
    contract's): what the playground builds its form from."""
    ctx: HeadContext = request.app.state.ctx
    endpoints = {path: ctx.contract.describe(path, ctx.model) for path in ENDPOINTS}
    return {"model": ctx.model.id, "kind": ctx.model.kind, "edits": ctx.model.edits, "endpoints": endpoints}


@router.get("/v1/usage")
async def usage(request: Request) -> dict[str, Any]:
    """The calling API key's limits and what it used of each (key_limits.py): requests in flight and
    tokens of the minute on this head, quotas of the hour, day or month across the pipeline."""
    ctx: HeadContext = request.app.state.ctx
    return ctx.key_limits.usage(key_limit(request))


@router.get("/health", response_model=None)
async def health(request: Request) -> dict[str, Any] | JSONResponse:
    """Liveness: the process serves HTTP and its DiffusionServer loop runs; it stays 200 while
    draining, so it is not killed mid-drain. A loop that stopped otherwise (a bug) answers 503, so
    that the kubelet restarts a head that can no longer serve anything."""
    ctx: HeadContext = request.app.state.ctx
    if not ctx.draining and not ctx.alive():
        return JSONResponse({"status": "stopped", "error": "the head's DiffusionServer loop stopped; restart it"}, 503)
    return {
        "status": "ok",
        "model": ctx.model.id,
        "draining": ctx.draining,
        "admission": ctx.admission_health(),
        "startup": startup.CLOCK.phases(),  # seconds since the process started, per phase (triptych.startup)
        **ctx.health(),
    }


@router.get("/v1/pipeline")
async def pipeline(request: Request) -> dict[str, Any]:
    """Each role's instances (alive, draining, free slots), queue and running requests, and the
    requests in flight with the role and instance each is at (with API keys, the caller's own);
    refreshed twice a second."""
    ctx: HeadContext = request.app.state.ctx
    view = ctx.pipeline_view()
    if (caller := owner_of(request)) is not None:  # with API keys: the caller's own requests (ownership.py)
        view = {**view, "requests": [r for r in view["requests"] if ctx.owners.get(r["id"]) == caller]}
    return {"model": ctx.model.id, "kind": ctx.model.kind, "draining": ctx.draining, **view}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 while this head takes new requests; 503 once it drains (SIGTERM) or its loop stopped."""
    ctx: HeadContext = request.app.state.ctx
    if ctx.draining:
        return JSONResponse({"status": "draining"}, 503, headers={"Retry-After": str(RETRY_AFTER_S)})
    if not ctx.ready():
        return JSONResponse({"status": "not ready"}, 503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx: HeadContext = request.app.state.ctx
    return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)
