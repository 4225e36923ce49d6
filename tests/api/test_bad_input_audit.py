"""Bad input found by an audit of the HTTP API: each gets the answer its kind calls for (a 413 for a
body past the limit, a 400 naming the header for a charset the form cannot be read in, a short error
for a huge value), a client gone mid-body costs the head no traceback, and the head serves on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.api.test_bad_input import refusal
from tests.api.test_direct_routes import FLUX, WAN, client
from tests.api.test_edits_form import client_for, form_with_prompt
from tests.api.test_http_api import ScriptedBackend
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext

IMAGES = "/v1/images/generations"
EDITS = "/v1/images/edits"
SMALL = {"prompt": "fox", "size": "16x16"}
HUGE = "x" * 1_000_000
FORM = {"Content-Type": "multipart/form-data; boundary=x"}


def chunks(body: bytes, size: int = 1024) -> Iterator[bytes]:
    """The body with no Content-Length: counted by the body limit as it arrives."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


def test_an_edit_form_sent_chunked_past_the_body_limit_is_a_413_not_an_unreadable_form(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    body = form_with_prompt(b"night " * 2000)  # ~12 KB of prompt alone, past an 8 KiB limit
    with client_for(backend, tmp_path, max_request_bytes=8 << 10) as c:
        r = c.post(EDITS, content=chunks(body), headers=FORM)
        good = c.post(EDITS, content=form_with_prompt(b"night"), headers=FORM)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"], error
    assert good.status_code == 200, good.text
    assert len(backend.calls) == 1


@pytest.mark.parametrize("charset", ["no-such-charset", "utf-16"])
def test_an_edit_form_in_a_charset_its_fields_cannot_be_read_in_is_a_400_naming_content_type(
    charset: str, tmp_path: Path
) -> None:
    """An unknown charset made starlette read the fields as latin-1, silently (the prompt ran as
    "cafÃ©"); utf-16 garbled every field's name."""
    backend = ScriptedBackend()
    with client_for(backend, tmp_path) as c:
        r = c.post(EDITS, content=form_with_prompt("café".encode()),
                   headers={"Content-Type": f"multipart/form-data; boundary=x; charset={charset}"})  # fmt: skip
        utf8 = c.post(EDITS, content=form_with_prompt("café".encode()),
                      headers={"Content-Type": "multipart/form-data; boundary=x; charset=UTF-8"})  # fmt: skip
    error = refusal(r)
    assert error["param"] == "Content-Type" and repr(charset) in error["message"], error
    assert "UTF-8" in error["message"], error
    assert utf8.status_code == 200, utf8.text
    assert [p.prompt for p in backend.calls] == ["café"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**SMALL, "size": HUGE}, "size"),
        ({**SMALL, HUGE: 1}, HUGE[:200]),
        ({**SMALL, "loras": [{"name": "ink", HUGE: 1}]}, "loras"),
    ],
    ids=["size", "unknown-field", "unknown-lora-field"],
)
def test_a_huge_value_or_field_name_is_refused_in_a_short_error(
    body: dict[str, Any], param: str, tmp_path: Path
) -> None:
    with client(FLUX, tmp_path) as c:
        r = c.post(IMAGES, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        good = c.post(IMAGES, json=SMALL)
    assert len(r.content) < 1000, len(r.content)
    error = refusal(r)
    assert error["param"] == param and error["message"].startswith(param[:20]), error
    assert good.status_code == 200, good.text


def test_a_huge_content_type_is_refused_in_a_short_error(tmp_path: Path) -> None:
    content_type = "text/" + "p" * 20_000
    with client(FLUX, tmp_path) as c:
        r = c.post(IMAGES, content=json.dumps(SMALL).encode(), headers={"content-type": content_type})
    assert len(r.content) < 1000, len(r.content)
    assert "Content-Type: application/json" in refusal(r)["message"]


@pytest.mark.parametrize("path", [IMAGES, "/v1/videos"])
def test_a_client_gone_before_its_json_body_ended_is_let_go_without_an_error(path: str, tmp_path: Path) -> None:
    """It declared more body than it sent, then disconnected: there is no one to answer, and nothing
    went wrong in the head (the direct route raised ClientDisconnect, logged as a server error)."""
    backend = ScriptedBackend()
    app = create_app(HeadContext(backend, FLUX if path == IMAGES else WAN, tmp_path, CollectorRegistry()))
    sent: list[dict[str, Any]] = []
    messages = [
        {"type": "http.request", "body": b'{"prompt": "fox", ', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "state": {},
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        "headers": [(b"host", b"test"), (b"content-type", b"application/json"), (b"content-length", b"400")],
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect
    assert sent == [] and backend.calls == []


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("seed", True, "seed: must be a number, not true"),
        ("num_inference_steps", False, "num_inference_steps: must be a number, not false"),
        ("guidance_scale", True, "guidance_scale: must be a number, not true"),
        ("stream", 1, "stream: must be true or false, not 1"),
        ("stream", 0.0, "stream: must be true or false, not 0.0"),
    ],
)
def test_a_json_boolean_is_no_number_and_a_number_no_boolean(
    field: str, value: object, said: str, tmp_path: Path
) -> None:
    """pydantic's lax mode read `true` as 1 and `1` as true, running a request the client never wrote;
    the message is ours alone (no "Value error, " in front)."""
    with client(FLUX, tmp_path) as c:
        r = c.post(IMAGES, json={**SMALL, field: value})
        good = c.post(IMAGES, json={**SMALL, "seed": 3, "stream": False})
    error = refusal(r)
    assert (error["param"], error["message"]) == (field, said), error
    assert good.status_code == 200, good.text


def test_an_edit_form_s_text_is_still_read_as_the_field_s_type(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    with client_for(backend, tmp_path) as c:
        body = form_with_prompt(b"night").replace(
            b"--x--", b'--x\r\nContent-Disposition: form-data; name="seed"\r\n\r\n5\r\n--x--'
        )
        r = c.post(EDITS, content=body, headers=FORM)
    assert r.status_code == 200, r.text
    assert [p.seed for p in backend.calls] == [5]


def _sent_until_closed(port: int, headers: bytes, limit_s: float = 10) -> tuple[bytes, bool]:
    """A chunked POST whose body never ends, over a raw socket, for at most `limit_s` after the answer
    came: (the answer's first bytes, whether the head closed the connection by then)."""
    import socket
    import time

    chunk = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"
    pending, answer, deadline = chunk, b"", time.monotonic() + 30
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n" + headers + b"\r\n")  # fmt: skip
        s.setblocking(False)
        while time.monotonic() < deadline:
            try:
                got = s.recv(65536)
                if not got:
                    return answer, True
                if not answer:
                    deadline = time.monotonic() + limit_s  # the answer came: the head has this long to close
                answer += got
            except BlockingIOError:
                pass
            except ConnectionResetError:
                return answer, True
            try:
                pending = pending[s.send(pending) :] or chunk  # whole chunks: the body stays well-formed
            except BlockingIOError:
                time.sleep(0.001)
            except (BrokenPipeError, ConnectionResetError):
                return answer, True
    return answer, False


@pytest.mark.parametrize("refused", ["401 no key", "413 chunked past the limit"])
def test_a_refused_request_s_connection_is_closed_and_its_body_not_read_on(refused: str, tmp_path: Path) -> None:
    """The answer says Connection: close and the head closes: left open, it read on whatever body the
    client went on sending (gigabytes, on one connection, from a client without a key)."""
    from tests.api.test_openai_sdk import serving
    from triptych_head.api.auth import APIKeys

    keys = tmp_path / "keys"
    keys.write_text("sk-acme tenant=acme\n")
    ctx = HeadContext(ScriptedBackend(), FLUX, tmp_path, CollectorRegistry(), api_keys=APIKeys(keys),
                      max_request_bytes=64 << 10)  # fmt: skip
    key = b"" if refused.startswith("401") else b"Authorization: Bearer sk-acme\r\n"
    with serving(ctx) as port:
        answer, closed = _sent_until_closed(port, key)
    assert closed, "the head still read the body 10 s after it answered"
    if answer:  # the reset of a connection closed on a body still coming may discard an answer not yet read
        status = refused.split()[0].encode()
        assert answer.startswith(b"HTTP/1.1 " + status) and b"connection: close" in answer.lower(), answer[:300]
