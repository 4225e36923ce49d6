"""POST /v1/images/edits at the head's door: the form, the reference and the size (a scripted backend)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend, validate
from triptych.families import ModelInfo
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext


def png(width: int = 40, height: int = 36) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


def client_for(backend: ScriptedBackend, tmp_path: Path, edits: bool = True) -> TestClient:
    model = ModelInfo("kontext", "FluxKontextPipeline", "image", 4, 3.5, edits=edits, size_multiple=16)
    ctx = HeadContext(
        backend=backend, model=model, output_path=tmp_path, registry=CollectorRegistry(), validate=validate
    )
    return TestClient(create_app(ctx))


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend()


def post(client: TestClient, files=None, **fields):  # type: ignore[no-untyped-def]
    files = {"image": ("r.png", png(), "image/png")} if files is None else files
    return client.post("/v1/images/edits", data={"prompt": "night", **fields}, files=files or None)


def test_an_upload_is_inlined_and_its_size_cropped_to_the_model_multiple(backend, tmp_path) -> None:
    with client_for(backend, tmp_path) as c:
        r = post(c, seed="3", n="2")
    assert r.status_code == 200, r.text
    (params,) = backend.calls
    assert params.image == png() and params.image_url is None
    assert (params.width, params.height, params.seed, params.num_outputs) == (32, 32, 3, 2)


def test_a_url_reference_is_passed_on_unfetched_and_needs_a_size(backend, tmp_path) -> None:
    with client_for(backend, tmp_path) as c:
        ok = post(c, files={}, image="https://example.com/r.png", size="64x48")
        no_size = post(c, files={}, image="https://example.com/r.png")
        not_http = post(c, files={}, image="file:///etc/passwd", size="64x48")
    assert ok.status_code == 200 and backend.calls[0].image_url == "https://example.com/r.png"
    assert no_size.status_code == 400 and no_size.json()["error"]["param"] == "size"
    assert not_http.status_code == 400 and not_http.json()["error"]["param"] == "image"


@pytest.mark.parametrize(
    ("files", "fields", "param"),
    [
        ({}, {}, "image"),  # no reference
        ({"image": ("r.png", b"GIF89a-not-really", "image/gif")}, {}, "image"),
        ({"image": ("r.png", png(8, 8), "image/png")}, {}, "image"),  # smaller than the multiple: no size
        ({"mask": ("m.png", png(), "image/png")}, {}, "mask"),
        (None, {"n": "0"}, "n"),
        (None, {"size": "10x10"}, "size"),
        (None, {"unknown": "1"}, "unknown"),
        (None, {"image": "https://example.com/r.png"}, "image"),  # a file and a URL
    ],
)
def test_bad_forms_get_a_400_naming_the_field(backend, tmp_path, files, fields, param) -> None:
    with client_for(backend, tmp_path) as c:
        r = post(c, files=files, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert backend.calls == []


def test_json_bodies_and_text_only_models_are_refused(backend, tmp_path) -> None:
    with client_for(backend, tmp_path) as c:
        assert c.post("/v1/images/edits", json={"prompt": "x"}).status_code == 400
    with client_for(backend, tmp_path, edits=False) as c:
        r = post(c)
    assert r.status_code == 400 and r.json()["error"]["param"] == "image"
