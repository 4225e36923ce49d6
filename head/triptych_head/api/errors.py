"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}, and for some errors more
fields beside them (a deadline_unachievable 429's estimate_seconds and deadline_seconds)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from triptych.contract import NOT_TAKEN

# pydantic's error types for a body that is missing or not an object (FastAPI's and its own words differ)
NOT_AN_OBJECT = frozenset({"missing", "model_type", "model_attributes_type", "dict_type"})
# Where FastAPI found a parameter: the first part of an error's location, not the parameter's name
LOCATIONS = frozenset({"body", "query", "path", "header", "cookie"})
JSON_TYPE = "application/json"
ECHO = 200  # characters of a client's field name or media type an error message repeats


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        details: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code
        self.headers = headers
        self.details = details  # more fields of the error object, for a client to act on (a 429's estimate)


def internal_error(request_id: str) -> str:
    """The message of an error the head did not expect: its request's id, which the head's log names
    with the cause; never the exception's own text (a store's host, a path, a library's repr)."""
    return f"internal error (request {request_id}); the head's log names its cause"


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    kind = "invalid_request_error" if 400 <= status_code < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code, **(details or {})}}


async def send_json(send: Send, status_code: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    """Answer from an ASGI middleware, before (or instead of) the application."""
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status_code, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


def not_taken(field: str) -> str:
    """Why an OpenAI parameter this API does not take (contract.NOT_TAKEN) is refused, and what to give."""
    return f"not taken by this API; {NOT_TAKEN[field]}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        body = error_body(exc.status_code, exc.message, exc.param, exc.code, exc.details)
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first: dict[str, Any] = dict(exc.errors()[0]) if exc.errors() else {"loc": (), "msg": "invalid request"}
        # A part is the client's own text for an unknown field: echoed at most ECHO characters, never whole.
        loc = [str(p)[:ECHO] for p in first.get("loc", ())]
        if loc and loc[0] in LOCATIONS:  # ("query", "variant") is about the parameter `variant`
            loc = loc[1:]
        param = loc[0] if loc else None  # the request's field; the message names the part within it
        said = first.get("msg")
        if first.get("type") == "value_error" and "error" in first.get("ctx", {}):  # our words, without pydantic's
            said = first["ctx"]["error"]  # "Value error, " in front
        if first.get("type") == "extra_forbidden" and len(loc) == 1 and loc[0] in NOT_TAKEN:  # an OpenAI parameter
            said = not_taken(loc[0])
        message = f"{'.'.join(loc)}: {said}" if loc else str(said)
        if first.get("type") == "json_invalid":  # its location is a character of the body, not a field
            where = f" (at character {loc[0]})" if loc else ""
            message = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}{where}"
            param = None
        elif tuple(first.get("loc", ())) == ("body",) and first.get("type") in NOT_AN_OBJECT:  # the body itself
            given = "has no body" if first.get("type") == "missing" else "body is not a JSON object"
            message = f'the request {given}: send a JSON object of its parameters, such as {{"prompt": "a red fox"}}'
            content_type = request.headers.get("content-type", JSON_TYPE).split(";", 1)[0].strip().lower()
            if first.get("type") != "missing" and not is_json_type(content_type):  # FastAPI read no JSON from it
                given = content_type[:ECHO] or "of no type"
                message = f"the request body is {given}, not JSON: send Content-Type: {JSON_TYPE}"
        return JSONResponse(error_body(400, message, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = getattr(exc, "code", None)  # e.g. the body limit's request_too_large (limits.py)
        return JSONResponse(error_body(exc.status_code, str(exc.detail), code=code), exc.status_code, exc.headers)


def is_json_type(content_type: str) -> bool:
    """A media type FastAPI reads a body of as JSON: application/json or application/*+json."""
    return content_type == JSON_TYPE or (content_type.startswith("application/") and content_type.endswith("+json"))
