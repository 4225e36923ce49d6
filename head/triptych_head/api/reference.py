"""The reference image of a POST /v1/images/edits: read from the multipart form, checked, inlined.

An uploaded file is decoded once here (so a bad image is a 400 before any worker sees it) and
travels in the request as its encoded bytes; workers need no shared disk. A URL with a `size` is
only checked to be http(s): the image encoder fetches it. A URL without one is fetched here, since
the output keeps the reference's size and the head must know it before any worker runs: with the
image encoder's guards (public addresses or --reference-url-networks, redirects checked, a timeout;
triptych.reference), at most what the head takes as an upload (--max-request-bytes), and then
travels inlined, as an upload does. Those fetches run on their own few threads (FETCH_THREADS):
a URL that trickles its bytes holds one for up to 20 s, and on asyncio's default executor it would
hold up every other request's work there (Idempotency-Key lookups, url answers, video job saves).
The form itself (its text fields, the file part) is read as forms.py reads every form.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from triptych.contract import Limits
from triptych.reference import MAX_REFERENCE_BYTES, BadReference, check_reference_url, fetch_reference, open_reference
from triptych_head.api.errors import APIError
from triptych_head.api.forms import is_form, read_form
from triptych_head.api.schemas import RequestBody

# Head-side fetches of size-less edits' URLs: more wait their turn, never on the default executor.
FETCH_THREADS = 4
_FETCHES = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="reference-fetch")


@dataclass(frozen=True)
class Reference:
    """An edit's reference: inlined bytes (with the size read from them), or a URL the image encoder
    fetches."""

    data: bytes | None = None
    url: str | None = None  # fetched by the image encoder
    size: tuple[int, int] | None = None  # (width, height) of inlined bytes
    fetched_from: str | None = None  # the URL the head fetched `data` from

    @property
    def identity(self) -> bytes:
        """What makes two requests' references the same: the URL the client gave, or the bytes it uploaded."""
        url = self.fetched_from or self.url
        return url.encode() if url is not None else self.data or b""

    def default_size(self, sides: Limits) -> tuple[int, int]:
        """The output size when the client gives none: the reference's, cropped to the model's
        multiple (`sides`: the served model's limits of a side). APIError naming `image` when the
        model cannot make that size: the client sent no size to blame."""
        if self.size is None:  # read_edit_form fetches a URL given without a size
            raise APIError(400, "size: required with an image URL the image encoder fetches", "size")
        multiple = sides.step or 1
        width, height = (side // multiple * multiple for side in self.size)
        lo, hi = int(sides.minimum or multiple), int(sides.maximum or max(width, height))
        if not (lo <= width <= hi and lo <= height <= hi):
            raise APIError(
                400,
                f"image: the reference is {self.size[0]}x{self.size[1]}; without a size the output keeps its "
                f"size (cropped to a multiple of {multiple}), and this model makes {lo}..{hi} pixels a side: "
                "give a size (WIDTHxHEIGHT)",
                "image",
            )
        return width, height


def edit_form_schema(model: type[RequestBody]) -> dict[str, Any]:
    """The OpenAPI requestBody of POST /v1/images/edits: the edit model's fields as a multipart
    form, `image` a file or an http(s) URL."""
    schema = model.model_json_schema()
    schema["properties"]["image"] = {
        "description": schema["properties"]["image"].get("description", ""),
        "anyOf": [{"type": "string", "format": "binary"}, {"type": "string", "maxLength": 4096}],
    }
    schema["required"] = sorted({*schema.get("required", []), "image"})
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


async def read_edit_form(request: Request, model: type[RequestBody], max_bytes: int) -> tuple[RequestBody, Reference]:
    """The request's fields (as `model`) and its reference image, a URL without a size fetched (at
    most `max_bytes`); APIError (400, naming the field) for anything wrong."""
    if not is_form(request.headers.get("content-type", "")):
        raise APIError(400, "POST /v1/images/edits takes multipart/form-data (an `image` file and text fields)")
    form = await read_form(request, model, file_field="image")
    url = form.texts.get("image")
    if form.file is not None:
        if url is not None:
            raise APIError(400, "image: give a file or a URL, not both", "image")
        return form.body, await asyncio.to_thread(_inline, form.file)
    if url is None:
        raise APIError(400, "image: required (a file, or an http(s) URL)", "image")
    try:
        url = check_reference_url(url)
    except BadReference as exc:
        raise APIError(400, str(exc), "image") from None
    if getattr(form.body, "size", None) is not None:
        return form.body, Reference(url=url)
    fetched = asyncio.get_running_loop().run_in_executor(_FETCHES, _fetched, url, min(max_bytes, MAX_REFERENCE_BYTES))
    return form.body, await fetched


def _fetched(url: str, max_bytes: int) -> Reference:
    """The reference at `url`, fetched and inlined: the request gives no size, so the output keeps its own."""
    try:
        data = fetch_reference(url, "image", max_bytes)
    except BadReference as exc:
        raise APIError(
            400, f"{exc} (without a size the head fetches the reference; with one, the image encoder does)", "image"
        ) from None
    return _inline(data, fetched_from=url)


def _inline(data: bytes, fetched_from: str | None = None) -> Reference:
    if len(data) > MAX_REFERENCE_BYTES:  # an upload under a --max-request-bytes set higher: refused before any work
        raise APIError(
            413, f"image: the file is {len(data)} bytes, over the {MAX_REFERENCE_BYTES >> 20} MiB a reference may be; "
            "send a smaller one (it is resized to about a megapixel anyway)", "image",
        )  # fmt: skip
    try:
        image = open_reference(data)
    except BadReference as exc:
        raise APIError(400, str(exc), "image") from None
    return Reference(data=data, size=image.size, fetched_from=fetched_from)
