"""The generation endpoints' JSON bodies (application/json, application/<x>+json, or no type) are
served in front of FastAPI's router (api/direct.py); a body of another type reaches FastAPI's route.
A client cannot tell the two apart: same status, same answer, same error naming the same field (the
tests compare them by leaving one JSON type, DECLARED, to FastAPI's route: `declared`)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend
from triptych.families import ModelInfo
from triptych_head.api import direct, images, videos
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext
from triptych_head.api.direct import DirectRoute

FLUX = ModelInfo("tiny-flux", "FluxPipeline", "image", 4, 3.5, size_multiple=8, max_steps=50)
WAN = ModelInfo("tiny-wan", "WanPipeline", "video", 4, 5.0, size_multiple=16, frame_step=4)
DIRECT = ("application/json", "application/json; charset=utf-8", "application/x+json")
# FastAPI reads it as JSON, and so do the direct routes; where a test takes the `declared` fixture, the
# direct routes leave it to FastAPI's declared route, the one their answers are compared with.
DECLARED = "application/vnd.triptych+json"

BODIES = [
    b'{"prompt": "fox", "size": "16x16", "seed": 3, "n": 2}',
    b'{"prompt": "fox", "size": "16x16", "seed": 3.0}',  # a whole float is an integer on both paths
    b'{"prompt": "\\ud800", "size": "16x16"}',  # a lone surrogate: only json.loads parses it
    b'{"prompt": "fox", "size": "17x16"}',  # the family's limits (the head's own check)
    b'{"prompt": "fox", "size": "16x16", "n": NaN}',
    b'{"prompt": "fox", "size": "16x16", "bogus": 1}',
    b'{"prompt": "fox", "size": "16x16", "model": "other"}',
    b'{"prompt": 3, "size": "16x16"}',
    b"{not json",
    b'["prompt"]',
    b'"fox"',
    b"",
]
# Bodies the direct route refuses before any parser recurses (deeply nested) or that are not UTF-8: a
# 400 about the body. Only the direct route is sent the deep ones: FastAPI's json.loads would raise a
# RecursionError in this process, after which CPython 3.11's ast.parse fails (other tests use it).
DEEP = [b"[" * 5000 + b"]" * 5000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", b"[" * 300 + b"]" * 300]


def client(model: ModelInfo, folder: Path) -> TestClient:
    ctx = HeadContext(backend=ScriptedBackend(), model=model, output_path=folder, registry=CollectorRegistry())
    return TestClient(create_app(ctx))


@pytest.fixture
def declared(monkeypatch: pytest.MonkeyPatch) -> str:
    """DECLARED bodies go to FastAPI's declared route (its json.loads and its model) from now on."""
    reader = DirectRoute.reader

    def leave_declared(self: DirectRoute, scope: dict[str, object]) -> object:
        return None if direct._content_type(scope) == DECLARED else reader(self, scope)

    monkeypatch.setattr(DirectRoute, "reader", leave_declared)
    return DECLARED


def record_declared(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which requests reach FastAPI's declared routes from now on: they call the module's handler
    by name, while the direct routes hold the handler they were built with (before this patch)."""
    calls: list[str] = []
    for module, name in ((images, "create_images"), (videos, "create_video")):
        original = getattr(module, name)

        async def recorded(body, request, original=original, name=name):  # type: ignore[no-untyped-def]
            calls.append(name)
            return await original(body, request)

        monkeypatch.setattr(module, name, recorded)
    return calls


def post(c: TestClient, path: str, raw: bytes, content_type: str) -> tuple[int, object]:
    r = c.post(path, content=raw, headers={"content-type": content_type})
    body = r.json()
    if r.status_code == 200 and "data" in body:  # images: the same pixels (created may tick over)
        return 200, [base64.b64decode(d["b64_json"]) for d in body["data"]]
    return r.status_code, body


@pytest.mark.parametrize("raw", BODIES, ids=lambda b: b.decode()[:40] or "empty")
def test_an_image_request_is_answered_alike_on_either_path(raw: bytes, tmp_path: Path, declared: str) -> None:
    with client(FLUX, tmp_path) as c:
        answers = {ct: post(c, "/v1/images/generations", raw, ct) for ct in (*DIRECT, DECLARED)}
    status, answer = answers[DECLARED]
    for ct in DIRECT:
        assert answers[ct] == (status, answer), ct
    if status != 200:
        error = answer["error"]  # type: ignore[index]
        assert status == 400 or (status == 404 and error["param"] == "model")
        assert error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("raw", "paths"),
    [*((deep, DIRECT) for deep in DEEP), (b"\xff\xfe", (*DIRECT, DECLARED))],
    ids=["deep", "deep-field", "300-deep", "not-utf-8"],
)
def test_a_deep_or_undecodable_body_is_a_400_about_the_body(
    raw: bytes, paths: tuple[str, ...], tmp_path: Path, declared: str
) -> None:
    with client(FLUX, tmp_path) as c:
        for ct in paths:
            status, answer = post(c, "/v1/images/generations", raw, ct)
            error = answer["error"]  # type: ignore[index]
            assert status == 400 and error["param"] is None and "body" in error["message"], (ct, answer)
        assert post(c, "/v1/images/generations", BODIES[0], DIRECT[0])[0] == 200  # and the head serves on


def test_a_json_body_takes_the_direct_route_and_another_content_type_fastapi_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = b'{"prompt": "fox", "size": "16x16", "seed": 3}'
    with client(FLUX, tmp_path) as c:
        declared_calls = record_declared(monkeypatch)
        for ct in (*DIRECT, DECLARED):
            assert post(c, "/v1/images/generations", raw, ct)[0] == 200
        assert declared_calls == []
        status, answer = post(c, "/v1/images/generations", raw, "text/plain")
        assert status == 400 and "not JSON" in answer["error"]["message"], answer  # type: ignore[index]
        assert declared_calls == []  # FastAPI's route refused it before its handler
        # The declared route documents the body as before (the OpenAPI schema is FastAPI's).
        schema = c.get("/openapi.json").json()["paths"]["/v1/images/generations"]["post"]
        assert schema["operationId"].startswith("create_images")
        assert "$ref" in schema["requestBody"]["content"]["application/json"]["schema"]


def test_a_video_job_is_created_alike_on_either_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, declared: str
) -> None:
    raw = b'{"prompt": "waves", "size": "32x32", "num_frames": 5, "seed": 1}'
    with client(WAN, tmp_path) as c:
        declared_calls = record_declared(monkeypatch)
        jobs = [c.post("/v1/videos", content=raw, headers={"content-type": ct}) for ct in (DIRECT[0], DECLARED)]
        assert declared_calls == ["create_video"]
        assert [r.status_code for r in jobs] == [200, 200], [r.text for r in jobs]
        first, second = ({k: v for k, v in r.json().items() if k not in ("id", "created_at")} for r in jobs)
        assert first == second and first["status"] == "queued" and first["seed"] == 1
        assert jobs[0].headers["content-type"] == jobs[1].headers["content-type"] == "application/json"
        bad = [c.post("/v1/videos", content=b'{"prompt": "w", "size": "32x32", "num_frames": 6}',
                      headers={"content-type": ct}).json() for ct in (DIRECT[0], DECLARED)]  # fmt: skip
        assert bad[0] == bad[1] and bad[0]["error"]["param"] == "num_frames"


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"prompt": "fox", "size": "16x16", "n": ' + b"9" * 5000 + b"}", "a number has too many digits"),
        (b'{"prompt": "caf\xe9", "size": "16x16"}', "it is not UTF-8 text"),
        (b"[" * 100_000, "it is nested too deeply"),
    ],
    ids=["digits", "latin-1", "deep"],
)
@pytest.mark.parametrize("content_type", ["application/x+json", "Application/Problem+JSON; charset=utf-8"])
def test_an_application_plus_json_body_gets_the_direct_route_s_words(
    raw: bytes, says: str, content_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """application/*+json went to FastAPI's route: "There was an error parsing the body" for each, and
    the deep one to the json.loads recursion the direct route avoids (a RecursionError in the head)."""
    with client(FLUX, tmp_path) as c:
        declared_calls = record_declared(monkeypatch)
        status, answer = post(c, "/v1/images/generations", raw, content_type)
        good = post(c, "/v1/images/generations", BODIES[0], content_type)
    error = answer["error"]  # type: ignore[index]
    assert status == 400 and says in error["message"] and "error parsing" not in error["message"], answer
    assert good[0] == 200 and declared_calls == []
