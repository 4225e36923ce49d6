"""The web playground at `/`: static files shipped in the package (plain HTML, CSS and JavaScript,
no build step, nothing from a CDN). They are served without an API key; the page sends the key
the user enters with every API call it makes (auth.py)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

STATIC = Path(__file__).resolve().parents[1] / "static"


def content_security_policy(store_origin: str | None = None) -> str:
    """The page loads only its own files; results and previews arrive as data: and blob: URLs. With
    presigned content (--results-presign), a video's content redirects to the S3 endpoint: its origin
    is allowed for fetches and media too. No other site may frame the page (clickjacking its Generate
    button on a head without API keys)."""
    extra = f" {store_origin}" if store_origin else ""
    return (
        f"default-src 'self'; connect-src 'self'{extra}; img-src 'self' data: blob:{extra}; "
        f"media-src 'self' blob:{extra}; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    )


def origin_of(url: str | None) -> str | None:
    """scheme://host[:port] of `url` (an S3 endpoint), None without one."""
    if not url:
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else None


class PageFiles(StaticFiles):
    """The page's files, each answered with the page's headers (`headers`): its policy, and no-cache so
    that a browser asks again after an upgrade (an old app.js under a new page). The page itself is
    `/` only: /static/index.html redirects there."""

    def __init__(self, headers: dict[str, str]):
        super().__init__(directory=STATIC)
        self.headers = headers

    async def get_response(self, path: str, scope: Scope) -> Response:
        if path == "index.html":
            return RedirectResponse("/", status_code=308)
        response = await super().get_response(path, scope)
        response.headers.update(self.headers)
        return response


def install_playground(app: FastAPI, store_origin: str | None = None) -> None:
    """`/` and its files; `store_origin`: where presigned content is fetched from (None: the head)."""
    headers = {
        "Content-Security-Policy": content_security_policy(store_origin),
        "Cache-Control": "no-cache",
        "X-Frame-Options": "DENY",  # frame-ancestors for browsers that predate it
    }

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=headers)

    app.mount("/static", PageFiles(headers), name="static")
