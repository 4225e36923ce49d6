"""POST /v1/images/generations: synchronous text-to-image."""

from __future__ import annotations

import asyncio
import base64
import time

from fastapi import APIRouter, Request

from triptych_head.api.context import HeadContext, new_request_id
from triptych_head.api.schemas import ImageData, ImageGenerationRequest, ImageGenerationResponse
from triptych_head.media import png_bytes

router = APIRouter(tags=["images"])


@router.post("/v1/images/generations", response_model=ImageGenerationResponse)
async def create_images(body: ImageGenerationRequest, request: Request) -> ImageGenerationResponse:
    ctx: HeadContext = request.app.state.ctx
    ctx.refuse_if_draining()
    params = ctx.params_for(body)
    request_id = new_request_id("img")
    output = await ctx.generate(params, request_id)
    pngs = await asyncio.to_thread(lambda: [png_bytes(img[0]) for img in output.pixels])
    if body.response_format == "b64_json":
        data = [ImageData(b64_json=base64.b64encode(png).decode()) for png in pngs]
    else:
        data = []
        for i, png in enumerate(pngs):
            name = f"{request_id}-{i}.png"
            path = ctx.results.image_path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(png)
            data.append(ImageData(url=str(request.url_for("get_file", kind="images", name=name))))
    return ImageGenerationResponse(created=int(time.time()), data=data)
