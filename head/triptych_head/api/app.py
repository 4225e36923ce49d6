"""create_app: the FastAPI application over a backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from triptych import __version__
from triptych_head.api import images, system, videos
from triptych_head.api.context import HeadContext
from triptych_head.api.errors import install_error_handlers


def create_app(ctx: HeadContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ctx.backend.start()
        try:
            yield
        finally:
            await ctx.backend.close()

    app = FastAPI(title="Triptych", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    app.state.video_jobs = videos.VideoJobs()
    install_error_handlers(app)
    app.include_router(images.router)
    app.include_router(videos.router)
    app.include_router(system.router)
    return app
