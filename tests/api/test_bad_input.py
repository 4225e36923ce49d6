"""Unusual client input at the head's door: each is a 4xx whose message says what is wrong, in words
that fit it, and whose `param` names the field it is about; none is a 5xx."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from tests.api.test_direct_routes import DECLARED, DIRECT, FLUX, WAN, client
from tests.api.test_http_api import ScriptedBackend
from triptych.families import ModelInfo
from triptych_head.api.app import create_app
from triptych_head.api.auth import APIKeys
from triptych_head.api.context import HeadContext

IMAGES = "/v1/images/generations"
SMALL = {"prompt": "fox", "size": "16x16"}
NESTED = "[" * 5000 + "]" * 5000  # deeper than any JSON parser here recurses


def refusal(r: Any) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    return r.json()["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("text", [NESTED, "\ud800"], ids=["nested", "surrogate"])
@pytest.mark.parametrize("content_type", [*DIRECT, DECLARED])
def test_a_loras_string_no_parser_takes_is_a_400_naming_loras(content_type: str, text: str, tmp_path: Path) -> None:
    # `loras` may be the JSON array as text (an edit form's fields are text): that text is parsed
    # without recursing, so its nesting is a refusal of the field, not a RecursionError and a 500.
    raw = json.dumps({**SMALL, "loras": text}).encode()
    with client(FLUX, tmp_path) as c:
        error = refusal(c.post(IMAGES, content=raw, headers={"content-type": content_type}))
    assert error["param"] == "loras" and error["message"].startswith("loras:"), error


def test_a_number_of_more_digits_than_python_converts_is_not_called_undecodable(tmp_path: Path) -> None:
    raw = b'{"prompt": "fox", "size": "16x16", "seed": ' + b"9" * 5000 + b"}"
    with client(FLUX, tmp_path) as c:
        error = refusal(c.post(IMAGES, content=raw, headers={"content-type": "application/json"}))
    assert "a number has too many digits" in error["message"] and "UTF-8" not in error["message"], error


def test_an_undecodable_body_is_still_called_so(tmp_path: Path) -> None:
    with client(FLUX, tmp_path) as c:
        error = refusal(c.post(IMAGES, content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"}))
    assert "not UTF-8 text" in error["message"], error


def test_a_query_parameter_s_error_names_the_parameter_not_its_location(tmp_path: Path) -> None:
    with client(WAN, tmp_path) as c:
        error = refusal(c.get("/v1/videos/video_x/content", params={"variant": "bogus"}))
    assert error["param"] == "variant" and error["message"].startswith("variant: "), error


@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("guidance_scale", "NaN"),
        ("guidance_scale", "Infinity"),
        ("guidance_scale", "-Infinity"),
        ("guidance_scale", '"nan"'),
        ("deadline_seconds", "NaN"),
        ("step_cache_threshold", "NaN"),
        ("loras", '[{"name": "ink", "weight": NaN}]'),
    ],
)
def test_a_float_that_is_not_finite_is_refused_as_such_not_as_out_of_range(
    field: str, raw: str, tmp_path: Path
) -> None:
    text = json.dumps({**SMALL, "step_cache": "first_block", field: "RAW"}).replace('"RAW"', raw)
    with client(FLUX, tmp_path) as c:
        error = refusal(c.post(IMAGES, content=text.encode(), headers={"content-type": "application/json"}))
    assert error["param"] == field and "finite number" in error["message"], error
    assert "less than" not in error["message"] and "greater than" not in error["message"], error


@pytest.mark.parametrize("size", ["\uff13\uff12x\uff13\uff12", "\u0663\u0662x\u0663\u0662", "32x\uff13\uff12"])
def test_a_size_takes_ascii_digits_only(size: str, tmp_path: Path) -> None:
    with client(FLUX, tmp_path) as c:
        error = refusal(c.post(IMAGES, json={**SMALL, "size": size}))
    assert error["param"] == "size" and "WIDTHxHEIGHT" in error["message"], error


def test_a_size_with_leading_zeros_is_the_size_it_reads_as(tmp_path: Path) -> None:
    with client(WAN, tmp_path) as c:
        r = c.post("/v1/videos", json={"prompt": "fox", "size": "0032x0032", "num_frames": 1})
    assert r.status_code == 200, r.text
    assert r.json()["size"] == "32x32"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml"])
def test_a_json_body_sent_as_another_type_is_told_to_send_it_as_json(content_type: str, tmp_path: Path) -> None:
    with client(FLUX, tmp_path) as c:
        error = refusal(c.post(IMAGES, content=json.dumps(SMALL).encode(), headers={"content-type": content_type}))
    assert "Content-Type: application/json" in error["message"] and content_type in error["message"], error
    assert "not a JSON object" not in error["message"], error


def test_a_body_that_is_no_object_is_still_called_so(tmp_path: Path) -> None:
    with client(FLUX, tmp_path) as c:
        error = refusal(c.post(IMAGES, content=b"[1]", headers={"content-type": DECLARED}))
    assert "not a JSON object" in error["message"], error


@pytest.mark.parametrize(
    ("model", "path", "field", "says"),
    [
        (WAN, "/v1/videos", "input_reference", "videos are made from text only"),
        (FLUX, IMAGES, "background", "images are opaque"),
        (FLUX, IMAGES, "partial_images", "give stream: true and preview_every"),
    ],
)
def test_an_openai_parameter_not_taken_says_what_to_give_instead(model, path, field, says, tmp_path: Path) -> None:
    with client(model, tmp_path) as c:
        error = refusal(c.post(path, json={**SMALL, field: "4"}))
    assert error["param"] == field and error["message"].startswith(f"{field}: not taken by this API; "), error
    assert says in error["message"], error


def test_an_unknown_field_is_still_called_unknown(tmp_path: Path) -> None:
    with client(FLUX, tmp_path) as c:
        error = refusal(c.post(IMAGES, json={**SMALL, "sedd": 3}))
    assert error["param"] == "sedd" and "not permitted" in error["message"], error


def test_an_unknown_model_is_echoed_short_and_names_are_bounded(tmp_path: Path) -> None:
    with client(FLUX, tmp_path) as c:
        huge = c.post(IMAGES, json={**SMALL, "model": "m" * 5_000_000})
        long = c.post(IMAGES, json={**SMALL, "model": "m" * 256})
        users = [c.post(IMAGES, json={**SMALL, field: "u" * 10_000}) for field in ("user", "quality", "style")]
    assert refusal(huge)["param"] == "model" and len(huge.content) < 1000, huge.text[:300]
    assert long.status_code == 404 and len(long.content) < 1000, long.text[:300]
    assert [refusal(r)["param"] for r in users] == ["user", "quality", "style"]


def keyed_client(tmp_path: Path) -> TestClient:
    (tmp_path / "keys").write_text("sk-a\n")
    model = ModelInfo("tiny", "FluxPipeline", "image", 4, 3.5)
    ctx = HeadContext(ScriptedBackend(), model, tmp_path, CollectorRegistry(), api_keys=APIKeys(tmp_path / "keys"))
    return TestClient(create_app(ctx))


@pytest.mark.parametrize("header", ["Bearer", "Bearer ", "Bearer\tsk-a", "Basic c2stYQ==", "sk-a"])
def test_a_malformed_authorization_header_is_told_its_form_not_called_missing(header: str, tmp_path: Path) -> None:
    with keyed_client(tmp_path) as c:
        malformed = c.get("/v1/models", headers={"Authorization": header})
        missing = c.get("/v1/models")
        good = c.get("/v1/models", headers={"Authorization": "bearer  sk-a "})
    assert malformed.status_code == 401 and malformed.headers["WWW-Authenticate"] == "Bearer"
    message = malformed.json()["error"]["message"]
    assert "missing" not in message and "'Bearer YOUR_KEY'" in message, message
    assert missing.status_code == 401 and missing.json()["error"]["message"].startswith("missing API key")
    assert good.status_code == 200
