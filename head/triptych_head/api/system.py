"""/v1/models, /health, /metrics and generated files."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from triptych_head.api.context import HeadContext
from triptych_head.api.errors import APIError
from triptych_head.api.schemas import ModelCard, ModelList

router = APIRouter(tags=["system"])


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    ctx: HeadContext = request.app.state.ctx
    card = ModelCard(id=ctx.model.id, created=ctx.started, pipeline=ctx.model.pipeline_class, kind=ctx.model.kind)
    return ModelList(data=[card])


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    ctx: HeadContext = request.app.state.ctx
    return {"status": "ok", "model": ctx.model.id, **ctx.health()}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx: HeadContext = request.app.state.ctx
    return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/files/{kind}/{name}", name="get_file")
async def get_file(kind: str, name: str, request: Request) -> FileResponse:
    ctx: HeadContext = request.app.state.ctx
    if kind not in ("images", "videos") or "/" in name or name.startswith("."):
        raise APIError(404, f"no file {kind}/{name}")
    path = ctx.output_path / kind / name
    if not path.is_file():
        raise APIError(404, f"no file {kind}/{name}")
    return FileResponse(path)
