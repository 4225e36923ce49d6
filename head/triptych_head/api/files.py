"""Results as HTTP responses, whichever head made them: a local file (directory store), the object
proxied through this head (S3, the default), or a redirect to a presigned URL (S3 with
--results-presign)."""

from __future__ import annotations

import asyncio
import mimetypes
import os
import re
import weakref
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from triptych_head.api.context import HeadContext
from triptych_head.api.errors import APIError
from triptych_head.api.store_calls import from_store
from triptych_head.objects import ObjectMissing
from triptych_head.results import IMAGES, ResultStore

router = APIRouter(tags=["system"])
FILE_NAME = re.compile(r"[A-Za-z0-9_-]{1,100}(\.[A-Za-z0-9]{1,10}){1,2}")  # img_<hex>-0-<random hex>.png


async def object_response(results: ResultStore, name: str, media_type: str, filename: str | None = None) -> Response:
    """The object `name` as a response; APIError 404 when there is none (never made, or removed)."""
    store = results.objects
    what = f"for {name[:200]}"
    stat = await from_store(what, store.stat, name)
    if stat is None:
        raise APIError(404, f"no file {name[:200]}")
    if results.presign_s:
        url = await from_store(what, store.presigned_url, name, results.presign_s, media_type, filename)
        if url is not None:
            return RedirectResponse(url, status_code=307)
    path = store.local_path(name)
    if path is not None:
        try:
            return await OpenFileResponse.open(path, media_type=media_type, filename=filename)
        except FileNotFoundError:  # removed since the stat (retention, here or on another head)
            raise APIError(404, f"no file {name[:200]}") from None
    chunks = store.stream(name)
    try:  # the first chunk here: an object removed since the stat is a 404, not a broken stream
        first = await from_store(what, next, chunks, b"")
    except ObjectMissing:
        raise APIError(404, f"no file {name[:200]}") from None

    async def body():  # type: ignore[no-untyped-def]
        yield first
        async for chunk in iterate_in_threadpool(chunks):
            yield chunk

    headers = {"Content-Length": str(stat.size)}
    if filename:
        headers["Content-Disposition"] = f"attachment; filename={filename}"
    return StreamingResponse(body(), media_type=media_type, headers=headers)


class OpenFileResponse(FileResponse):
    """A local file opened before any header is sent, and sent from that opening: retention removing
    it meanwhile (this head's or another's) leaves the answer whole, since Linux keeps a removed file
    readable while it is open (a FileResponse by path would find it gone and answer 500, or send its
    200 and then no body). Ranges and HEAD work as FileResponse's, through /proc/self/fd."""

    def __init__(self, fd: int, **kwargs: Any):
        super().__init__(f"/proc/self/fd/{fd}", stat_result=os.fstat(fd), **kwargs)
        self._close = weakref.finalize(self, os.close, fd)  # once: sent, failed, or never sent

    @classmethod
    async def open(cls, path: Path, **kwargs: Any) -> FileResponse:
        """FileNotFoundError when there is no file at `path` now."""
        if not os.path.isdir("/proc/self/fd"):  # not Linux: by path, as FileResponse sends it
            await asyncio.to_thread(os.stat, path)
            return FileResponse(path, **kwargs)
        fd = await asyncio.to_thread(os.open, path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return cls(fd, **kwargs)
        except BaseException:
            os.close(fd)
            raise

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()


@router.get("/v1/files/{kind}/{name}", name="get_file")
async def get_file(kind: str, name: str, request: Request) -> Response:
    ctx: HeadContext = request.app.state.ctx
    if kind != IMAGES or not FILE_NAME.fullmatch(name):  # a video's: GET /v1/videos/{id}/content (its owner's)
        raise APIError(404, f"no file {kind}/{name[:200]}")
    media_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return await object_response(ctx.results, f"{kind}/{name}", media_type)
