"""Form bodies: an edit's (its reference image and text fields) and a video request's as OpenAI's SDK
sends it (`videos.create` posts multipart/form-data, text fields only), read into the endpoint's
request model as a JSON body is.

Text fields are UTF-8 (a multipart form may name another charset in its Content-Type): a field
whose bytes are not is a 400 naming it. Starlette alone would read them as latin-1, silently, and
the request would run with a prompt the client never wrote; for a charset it does not know it would
too, so such a charset (or one whose field names are not ASCII, as utf-16's) is a 400 naming Content-Type.
A field given twice, a file part the endpoint does not take, and a field the model refuses are each
a 400 naming it (OpenAI's file parameters this API does not take say what to give instead).
"""

from __future__ import annotations

import codecs
from contextlib import aclosing
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import FormParser, MultiPartParser

from triptych.contract import NOT_TAKEN
from triptych_head.api.errors import APIError, not_taken
from triptych_head.api.limits import RequestTooLarge
from triptych_head.api.schemas import RequestBody

MAX_FORM_FIELDS = 32
# multipart for uploads; a form with no file may also come url-encoded
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


@dataclass(frozen=True)
class Form:
    """A form read: its text fields as the endpoint's model, as they were sent, and its one file part."""

    body: RequestBody
    texts: dict[str, str]
    file: bytes | None = None  # the file part's bytes, when the endpoint takes one and it was given


def media_type(content_type: str) -> str:
    """A Content-Type's media type: lower case (media types ignore case), without its parameters."""
    return content_type.split(";", 1)[0].strip().lower()


def is_form(content_type: str) -> bool:
    """Whether a Content-Type is a form's."""
    return media_type(content_type) in FORM_TYPES


async def read_form(request: Request, model: type[RequestBody], file_field: str | None = None) -> Form:
    """The request's form (its content type a form's: `is_form`) as `model`, and the file part named
    `file_field` ("image", or "image[]" as some clients name it), if the endpoint takes one. APIError (400,
    naming the field) for anything wrong; RequestTooLarge for a chunked body past --max-request-bytes."""
    _check_charset(request.headers["content-type"])
    try:
        form = await _parse(request, max_files=2 if file_field else 1)
    except NotText as exc:
        raise APIError(400, str(exc), exc.field) from None
    except RequestTooLarge:  # the 413 limits.py answers
        raise
    except Exception as exc:  # starlette's MultiPartException and the parser's own errors
        raise APIError(400, f"the multipart body cannot be read: {exc}") from None
    try:
        files = [(k, v) for k, v in form.multi_items() if isinstance(v, UploadFile)]
        texts = [(k, v) for k, v in form.multi_items() if isinstance(v, str)]
        for name, _ in files:
            if name in NOT_TAKEN:  # OpenAI's `mask`, `input_reference`
                raise APIError(400, f"{name}: {not_taken(name)}", name)
            if file_field is None:
                raise APIError(400, f"{name}: unexpected file field; this endpoint takes text fields only", name)
            if name not in (file_field, f"{file_field}[]"):
                raise APIError(400, f"{name}: unexpected file field; upload the file as `{file_field}`", name)
        if len(files) > 1:
            raise APIError(400, f"{file_field}: {len(files)} files given; this endpoint takes one", file_field)
        fields = dict(texts)
        if len(fields) != len(texts):
            repeated = sorted({k for k, _ in texts if [n for n, _ in texts].count(k) > 1})
            raise APIError(400, f"{repeated[0]}: given more than once", repeated[0])
        try:
            body = model.model_validate(fields)
        except ValidationError as exc:  # located in the body, as FastAPI locates a JSON body's errors
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        return Form(body, fields, await files[0][1].read() if files else None)
    finally:
        await form.close()


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


async def _parse(request: Request, max_files: int) -> FormData:
    """The form (its content type checked by the caller), its text fields checked to be text (NotText)."""
    content_type, _ = parse_options_header(request.headers.get("content-type"))
    async with aclosing(request.stream()) as stream:
        parser: MultiPartParser | FormParser
        if content_type == b"multipart/form-data":
            parser = _TextMultiPart(request.headers, stream, max_files=max_files, max_fields=MAX_FORM_FIELDS)
        else:
            parser = _TextUrlEncoded(request.headers, stream, max_fields=MAX_FORM_FIELDS)
        return await parser.parse()
