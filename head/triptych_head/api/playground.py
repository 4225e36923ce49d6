"""The web playground at `/`: static files shipped in the package (plain HTML, CSS and JavaScript,
no build step, nothing from a CDN). They are served without an API key; the page sends the key
the user enters with every API call it makes (auth.py)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parents[1] / "static"


def content_security_policy(store_origin: str | None = None) -> str:
    """The page loads only its own files; results and previews arrive as data: and blob: URLs. With
    presigned content (--results-presign), a video's content redirects to the S3 endpoint: its origin
    is allowed for fetches and media too."""
    extra = f" {store_origin}" if store_origin else ""
    return (
        f"default-src 'self'; connect-src 'self'{extra}; img-src 'self' data: blob:{extra}; "
        f"media-src 'self' blob:{extra}; object-src 'none'; base-uri 'none'"
    )


def origin_of(url: str | None) -> str | None:
    """scheme://host[:port] of `url` (an S3 endpoint), None without one."""
    if not url:
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else None


def install_playground(app: FastAPI, store_origin: str | None = None) -> None:
    """`/` and its files; `store_origin`: where presigned content is fetched from (None: the head)."""
    headers = {"Content-Security-Policy": content_security_policy(store_origin), "Cache-Control": "no-cache"}

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=headers)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
