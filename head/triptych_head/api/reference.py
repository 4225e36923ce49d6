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

Text fields are UTF-8 (a multipart form may name another charset in its Content-Type): a field
whose bytes are not is a 400 naming it. Starlette alone would read them as latin-1, silently, and
the request would run with a prompt the client never wrote; for a charset it does not know it would
too, so such a charset (or one whose field names are not ASCII, as utf-16's) is a 400 naming Content-Type.
"""

from __future__ import annotations

import asyncio
import codecs
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import FormParser, MultiPartParser

from triptych.contract import NOT_TAKEN, Limits
from triptych.reference import MAX_REFERENCE_BYTES, BadReference, check_reference_url, fetch_reference, open_reference
from triptych_head.api.errors import APIError, not_taken
from triptych_head.api.limits import RequestTooLarge
from triptych_head.api.schemas import RequestBody

FILE_FIELDS = ("image", "image[]")
MAX_FORM_FIELDS = 32
# multipart for uploads; a URL reference may also come url-encoded (no file part to carry)
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
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
    if not request.headers.get("content-type", "").lower().startswith(FORM_TYPES):  # media types ignore case
        raise APIError(400, "POST /v1/images/edits takes multipart/form-data (an `image` file and text fields)")
    _check_charset(request.headers["content-type"])
    try:
        form = await _read_form(request)
    except NotText as exc:
        raise APIError(400, str(exc), exc.field) from None
    except RequestTooLarge:  # a chunked body past --max-request-bytes: the 413 limits.py answers
        raise
    except Exception as exc:  # starlette's MultiPartException and the parser's own errors
        raise APIError(400, f"the multipart body cannot be read: {exc}") from None
    try:
        files = [(k, v) for k, v in form.multi_items() if isinstance(v, UploadFile)]
        texts = [(k, v) for k, v in form.multi_items() if isinstance(v, str)]
        for name, _ in files:
            if name in NOT_TAKEN:  # OpenAI's `mask`
                raise APIError(400, f"{name}: {not_taken(name)}", name)
            if name not in FILE_FIELDS:
                raise APIError(400, f"{name}: unexpected file field; upload the reference as `image`", name)
        if len(files) > 1:
            raise APIError(400, f"image: {len(files)} files given; this model takes one reference image", "image")
        fields = dict(texts)
        if len(fields) != len(texts):
            repeated = sorted({k for k, _ in texts if [n for n, _ in texts].count(k) > 1})
            raise APIError(400, f"{repeated[0]}: given more than once", repeated[0])
        try:
            body = model.model_validate(fields)
        except ValidationError as exc:  # located in the body, as FastAPI locates a JSON body's errors
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        url = fields.get("image")
        if files and url is not None:
            raise APIError(400, "image: give a file or a URL, not both", "image")
        if files:
            data = await files[0][1].read()
            return body, await asyncio.to_thread(_inline, data)
    finally:
        await form.close()
    if url is None:
        raise APIError(400, "image: required (a file, or an http(s) URL)", "image")
    try:
        url = check_reference_url(url)
    except BadReference as exc:
        raise APIError(400, str(exc), "image") from None
    if getattr(body, "size", None) is not None:
        return body, Reference(url=url)
    fetched = asyncio.get_running_loop().run_in_executor(_FETCHES, _fetched, url, min(max_bytes, MAX_REFERENCE_BYTES))
    return body, await fetched


def _check_charset(content_type: str) -> None:
    """APIError naming Content-Type for a form charset its fields cannot be read in: one Python does not
    know (starlette would read the fields as latin-1 instead, silently), or one whose field names are not
    ASCII (utf-16: every name would be garbled)."""
    charset = parse_options_header(content_type)[1].get(b"charset")
    if charset is None:
        return
    name = charset.decode("latin-1")
    try:
        readable = "name".encode(codecs.lookup(name).name) == b"name"
    except LookupError:
        readable = False
    if not readable:
        raise APIError(
            400,
            f"Content-Type: the form's charset {name[:40]!r} is not one its text fields can be read in; "
            "send them as UTF-8 (charset=utf-8, or no charset)",
            "Content-Type",
        )


class NotText(ValueError):
    """A text field whose bytes are not text in the form's charset."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field[:64]}: {message}")
        self.field = field


def _text(field: str, data: bytes | bytearray, charset: str) -> None:
    """NotText unless `data` decodes in `charset` (what starlette would read as latin-1 instead)."""
    try:
        data.decode(charset)
    except UnicodeDecodeError as exc:
        at = exc.start
        name = "UTF-8" if charset == "utf-8" else f"{charset} (the form's charset)"
        shown = f"{bytes(data[:40])!r}{'...' if len(data) > 40 else ''}"
        raise NotText(
            field, f"must be {name} text, and {shown} is not (byte 0x{data[at]:02x} at offset {at}); send it as UTF-8"
        ) from None


class _TextMultiPart(MultiPartParser):
    """Starlette's multipart parser, a text part that is not text in the form's charset (UTF-8 unless
    its Content-Type names another) refused rather than read as latin-1."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            _text(part.field_name, part.data, self._charset)
        super().on_part_end()


class _TextUrlEncoded(FormParser):
    """Starlette's url-encoded form parser, which reads a field's bytes as latin-1 and its %-escapes as
    UTF-8 with replacement characters: here the field's bytes, %-escaped or raw (as `curl -d` sends
    them), are read as UTF-8, and refused when they are not UTF-8 text."""

    def on_field_end(self) -> None:
        raw = unquote_to_bytes(bytes(self._field_value).replace(b"+", b" "))
        self._field_value = bytearray()  # decoded here once; the parent counts the field and reads its name
        super().on_field_end()
        field = self._items[-1][0]
        _text(field, raw, "utf-8")
        self._items[-1] = (field, raw.decode())


async def _read_form(request: Request) -> FormData:
    """The form (its content type checked by the caller), its text fields checked to be text (NotText)."""
    content_type, _ = parse_options_header(request.headers.get("content-type"))
    async with aclosing(request.stream()) as stream:
        parser: MultiPartParser | FormParser
        if content_type == b"multipart/form-data":
            parser = _TextMultiPart(request.headers, stream, max_files=len(FILE_FIELDS) + 1, max_fields=MAX_FORM_FIELDS)
        else:
            parser = _TextUrlEncoded(request.headers, stream, max_fields=MAX_FORM_FIELDS)
        return await parser.parse()


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
    try:
        image = open_reference(data)
    except BadReference as exc:
        raise APIError(400, str(exc), "image") from None
    return Reference(data=data, size=image.size, fetched_from=fetched_from)
