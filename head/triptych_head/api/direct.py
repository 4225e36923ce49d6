"""The JSON endpoints every generation takes, served straight from ASGI in front of FastAPI's router.

At hundreds of requests per second, a third of the CPU the head's HTTP loop spends on an image
request went to FastAPI's per-request layers (its exception and exit-stack middlewares, routing,
the dependency solving of the body, the request and the response, the body's validation). A
`DirectRoute` takes its request as it is: the body validated once by the same pydantic model
FastAPI documents (the route stays declared there, for the OpenAPI schema and for a body of
another content type), the same handler, and an exception answered by the same handler the app
installed for it (errors.py), so a client cannot tell the two paths apart. It sits inside the API
key and body limit middlewares: a key is checked, and the body bounded, as for every route.

An endpoint that also takes a form (POST /v1/videos: OpenAI's SDK posts it as multipart/form-data)
names its reader (`form`, forms.py): a form body takes the same handler, read into the same model.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from triptych_head.api.errors import is_json_type
from triptych_head.api.forms import is_form, media_type

Handler = Callable[[Any, Request], Awaitable[BaseModel | Response]]
Reader = Callable[[Request], Awaitable[BaseModel]]  # the request's body, read and validated


@dataclass(frozen=True)
class DirectRoute:
    body: type[BaseModel]  # the JSON body's model (the endpoint's, built from the request contract)
    handler: Handler  # (body, request) -> the answer: a Response, or a model sent as its JSON
    form: Reader | None = None  # a form body's reader, where the endpoint takes forms too

    def reader(self, scope: Scope) -> Reader | None:
        """How this request's body is read here; None: FastAPI's route reads it (neither JSON, which
        includes application/*+json as FastAPI takes it, nor a form the endpoint takes)."""
        content_type = _content_type(scope)
        if content_type is None or is_json_type(content_type):
            return self._json
        if self.form is not None and is_form(content_type):
            return self.form
        return None

    async def _json(self, request: Request) -> BaseModel:
        return _body(self.body, await request.body())


class DirectRoutes:
    """ASGI middleware: (method, path) -> DirectRoute, for JSON bodies; the rest goes to `app`."""

    def __init__(self, app: ASGIApp, routes: Mapping[tuple[str, str], DirectRoute]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        read = None if route is None else route.reader(scope)
        if route is None or read is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            try:
                body = await read(request)
            except ClientDisconnect:  # gone before its whole body came: nobody to answer, nothing went wrong here
                return
            answer = await route.handler(body, request)
            response = answer if isinstance(answer, Response) else _json_response(answer)
        except Exception as exc:
            handle = _handler_for(scope["app"].exception_handlers, exc)
            if handle is None:
                raise  # as from a FastAPI route: the server error middleware answers 500
            response = await handle(request, exc)
        await response(scope, receive, send)


def _body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """The body, validated straight from its bytes. One that is refused is worked out again as
    FastAPI works out its bodies (json.loads, then the model), so its error reads the same on
    either path: the JSON parsers differ in their words, and on a lone surrogate ("\ud800"), which
    only FastAPI's way reports as the field's. Some exceptions, each a 400 about the body: one nested
    deeper than pydantic's parser goes (~200 levels) is refused here, never given to json.loads,
    and one that is not UTF-8, or holds a number of more digits than Python converts, is worded
    here (FastAPI's: "There was an error parsing the body")."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        if _too_deep(exc):  # refused here: json.loads would recurse (and a RecursionError unsettles CPython 3.11)
            raise _invalid_json(("body",), "it is nested too deeply") from None
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _invalid_json(("body", exc.pos), exc.msg) from None
    except UnicodeDecodeError as exc:
        raise _invalid_json(("body",), f"it is not UTF-8 text ({exc})") from None
    except RecursionError:  # nested deeper than the parser goes
        raise _invalid_json(("body",), "it is nested too deeply") from None
    except ValueError:  # the one other ValueError of json.loads: an integer of too many digits to convert
        raise _invalid_json(
            ("body",), f"a number has too many digits (at most {sys.get_int_max_str_digits()})"
        ) from None
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def _invalid_json(loc: tuple[str | int, ...], why: str) -> RequestValidationError:
    """The error FastAPI raises for a body json.loads refuses (errors.py words it)."""
    error: dict[str, Any] = {"type": "json_invalid", "loc": loc, "msg": "JSON decode error", "input": {}}
    return RequestValidationError([{**error, "ctx": {"error": why}}])


def _too_deep(exc: ValidationError) -> bool:
    """pydantic's JSON parser refused the body for its nesting (deeper than ~200 levels)."""
    errors = exc.errors(include_url=False)
    return bool(errors) and errors[0]["type"] == "json_invalid" and "recursion" in str(errors[0].get("ctx", ""))


def _content_type(scope: Scope) -> str | None:
    """The body's media type (forms.media_type); None when not given (FastAPI reads such a body as JSON too)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return media_type(value.decode("latin-1"))
    return None


def _json_response(answer: BaseModel) -> Response:
    return Response(answer.model_dump_json(), media_type="application/json")


def _handler_for(handlers: Mapping[Any, Any], exc: Exception) -> Any:
    """The app's handler for `exc`'s class or its nearest base, as Starlette's own lookup finds it."""
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None
