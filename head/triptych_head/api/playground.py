"""The web playground at `/`: static files shipped in the package (plain HTML, CSS and JavaScript,
no build step, nothing from a CDN). They are served without an API key; the page sends the key
the user enters with every API call it makes (auth.py)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parents[1] / "static"
# The page loads only its own files; results and previews arrive as data: and blob: URLs.
CSP = "default-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; object-src 'none'; base-uri 'none'"

router = APIRouter(include_in_schema=False)


@router.get("/")
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})


def install_playground(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
