"""POST /v1/videos takes its fields as a form too (OpenAI's SDK posts multipart/form-data): the same job
as the same fields in JSON, and a field the form gets wrong is a 400 naming it, as in JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.api.test_http_api import ScriptedBackend, make_client

FIELDS = {"prompt": "waves", "size": "32x16", "num_frames": "5", "fps": "8", "num_inference_steps": "2", "seed": "7"}
SAME = ("status", "size", "num_frames", "fps", "seed", "total_steps", "seconds")


def _posted(tmp_path: Path, **body: Any) -> tuple[Any, ScriptedBackend]:
    """The answer to a POST /v1/videos of `body` (httpx's files, data, json, content, headers), and the
    workers' stand-in, which records what reached it."""
    backend = ScriptedBackend()
    with make_client(backend, tmp_path) as c:
        return c.post("/v1/videos", **body), backend


def test_a_form_makes_the_job_the_same_fields_in_json_make(tmp_path: Path) -> None:
    as_json, _ = _posted(tmp_path, json={**FIELDS, "num_frames": 5, "fps": 8, "num_inference_steps": 2, "seed": 7})
    multipart, _ = _posted(tmp_path / "m", files={k: (None, v) for k, v in FIELDS.items()})
    urlencoded, _ = _posted(tmp_path / "u", data=FIELDS)
    assert as_json.status_code == multipart.status_code == urlencoded.status_code == 200, multipart.text
    for answer in (multipart, urlencoded):
        assert {k: answer.json()[k] for k in SAME} == {k: as_json.json()[k] for k in SAME}
    assert multipart.headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("files", "param", "says"),
    [
        ({**FIELDS, "num_frames": "five"}, "num_frames", "valid integer"),
        ({**FIELDS, "seconds": "4"}, "seconds", "were both given"),
        ({**FIELDS, "bogus": "1"}, "bogus", "not permitted"),
        ({k: v for k, v in FIELDS.items() if k != "prompt"}, "prompt", "required"),
    ],
)
def test_a_form_field_the_contract_refuses_is_a_400_naming_it(files, param, says, tmp_path: Path) -> None:
    r, backend = _posted(tmp_path, files={k: (None, v) for k, v in files.items()})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert says in r.json()["error"]["message"].lower(), r.json()
    assert backend.calls == []


def test_a_file_part_a_video_request_does_not_take_is_named(tmp_path: Path) -> None:
    reference, _ = _posted(tmp_path, files={"prompt": (None, "w"), "input_reference": ("a.png", b"x", "image/png")})
    other, _ = _posted(tmp_path / "o", files={"prompt": (None, "w"), "clip": ("a.mp4", b"x", "video/mp4")})
    assert reference.status_code == 400 and reference.json()["error"]["param"] == "input_reference"
    assert "videos are made from text only" in reference.json()["error"]["message"]
    assert other.status_code == 400 and other.json()["error"]["param"] == "clip"
    assert "takes text fields only" in other.json()["error"]["message"]


def test_a_form_field_given_twice_or_not_utf8_is_named(tmp_path: Path) -> None:
    form = {"content-type": "application/x-www-form-urlencoded"}
    twice, _ = _posted(tmp_path, content=b"prompt=a&prompt=b", headers=form)
    latin, _ = _posted(tmp_path / "l", content=b"prompt=caf%E9", headers=form)
    assert twice.status_code == 400 and twice.json()["error"]["message"] == "prompt: given more than once"
    assert latin.status_code == 400 and latin.json()["error"]["param"] == "prompt"
    assert "must be UTF-8 text" in latin.json()["error"]["message"]


def test_an_image_request_still_takes_json_only(tmp_path: Path) -> None:
    with make_client(ScriptedBackend(), tmp_path, kind="image") as c:
        r = c.post("/v1/images/generations", data={"prompt": "fox", "size": "32x16"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"], r.text


def test_the_openapi_schema_offers_the_form_beside_json(tmp_path: Path) -> None:
    with make_client(ScriptedBackend(), tmp_path) as c:
        body = c.get("/openapi.json").json()["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert body["multipart/form-data"]["schema"] == body["application/json"]["schema"]
