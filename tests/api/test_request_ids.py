"""An image answer names the request the head ran (X-Request-Id): the id its logs, its trace's root
span and its failure are known by, also on an error once the id was given. Refused before that
(a malformed body), or replayed from an earlier run (Idempotency-Key), an answer carries none; a
streamed replay names the run it replays, as its events do."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from tests.api.test_direct_routes import WAN
from tests.api.test_http_api import ScriptedBackend
from triptych.client import ClientError, TriptychClient
from triptych.families import ModelInfo
from triptych_head.api.app import create_app
from triptych_head.api.auth import APIKeys
from triptych_head.api.context import HeadContext
from triptych_head.backend import GenerationFailed

IMAGES = "/v1/images/generations"
BODY = {"prompt": "cat", "size": "32x32", "num_inference_steps": 2}
MODEL = ModelInfo("tiny", "FluxPipeline", "image", 4, 3.5)
ID = re.compile(r"img_[0-9a-f]{32}")


def head(tmp_path: Path, backend: ScriptedBackend, keys: str | None = None) -> TestClient:
    api_keys = None
    if keys is not None:
        (tmp_path / "keys").write_text(keys)
        api_keys = APIKeys(tmp_path / "keys")
    ctx = HeadContext(backend, MODEL, tmp_path, CollectorRegistry(), api_keys=api_keys)
    return TestClient(create_app(ctx))


def test_an_answer_and_a_failed_run_name_the_request_the_backend_ran(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    with head(tmp_path, backend) as c:
        ok = c.post(IMAGES, json=BODY)
        backend.fail = GenerationFailed("denoiser tcp://127.0.0.1:7 stopped responding", 503)
        failed = c.post(IMAGES, json=BODY)
        malformed = c.post(IMAGES, json={**BODY, "size": "big"})
    assert ok.status_code == 200, ok.text
    assert ID.fullmatch(ok.headers["x-request-id"]) and ok.headers["x-request-id"] == backend.request_ids[0]
    assert failed.status_code == 503, failed.text
    assert failed.headers["x-request-id"] == backend.request_ids[1] != backend.request_ids[0]
    assert malformed.status_code == 400 and "x-request-id" not in malformed.headers  # never given one


def test_a_request_refused_at_admission_is_named_too(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    with head(tmp_path, backend, "sk-trial max_per_minute=1\n") as c:
        key = {"Authorization": "Bearer sk-trial"}
        assert c.post(IMAGES, json=BODY, headers=key).status_code == 200
        refused = c.post(IMAGES, json=BODY, headers=key)
        streamed_refused = c.post(IMAGES, json={**BODY, "stream": True}, headers=key)
    for answer in (refused, streamed_refused):
        assert answer.status_code == 429, answer.text
        assert ID.fullmatch(answer.headers["x-request-id"]), answer.headers
    assert refused.headers["x-request-id"] != streamed_refused.headers["x-request-id"]
    assert len(backend.request_ids) == 1  # the refused ones never reached the pipeline


def test_a_streamed_answer_s_header_is_the_id_its_events_carry(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    with head(tmp_path, backend) as c, c.stream("POST", IMAGES, json={**BODY, "stream": True}) as r:
        header = r.headers["x-request-id"]
        events = r.read().decode()
    assert header == backend.request_ids[0]
    assert f'"id": "{header}"' in events or f'"id":"{header}"' in events, events[:500]


def test_a_replayed_answer_names_no_run(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    with head(tmp_path, backend) as c:
        first = c.post(IMAGES, json=BODY, headers={"Idempotency-Key": "k1"})
        replay = c.post(IMAGES, json=BODY, headers={"Idempotency-Key": "k1"})
    assert first.headers["x-request-id"] == backend.request_ids[0]
    assert replay.headers.get("idempotent-replayed") == "true" and "x-request-id" not in replay.headers


def test_a_streamed_replay_names_the_run_it_replays(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    streamed, key = {**BODY, "stream": True}, {"Idempotency-Key": "k2"}
    with head(tmp_path, backend) as c:
        with c.stream("POST", IMAGES, json=streamed, headers=key) as first:
            first.read()
        with c.stream("POST", IMAGES, json=streamed, headers=key) as replay:
            events = replay.read().decode()
    assert replay.headers.get("idempotent-replayed") == "true" and len(backend.request_ids) == 1
    assert first.headers["x-request-id"] == replay.headers["x-request-id"] == backend.request_ids[0]
    assert backend.request_ids[0] in events


def test_the_client_s_error_names_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    answer = httpx.Response(
        503,
        json={"error": {"message": "denoiser tcp://127.0.0.1:7 stopped responding"}},
        headers={"X-Request-Id": "img_" + "a" * 32},
    )
    client = TriptychClient("http://127.0.0.1:9", retries=0)
    monkeypatch.setattr(client.http, "request", lambda *args, **kwargs: answer)
    with pytest.raises(ClientError) as failed:
        client.generate_images(BODY)
    assert str(failed.value) == f"503: denoiser tcp://127.0.0.1:7 stopped responding (request img_{'a' * 32})"


def test_a_new_video_job_s_answer_names_it_and_its_replay_does_not(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    ctx = HeadContext(backend, WAN, tmp_path, CollectorRegistry())
    body = {"prompt": "waves", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
    with TestClient(create_app(ctx)) as c:
        made = c.post("/v1/videos", json=body, headers={"Idempotency-Key": "v1"})
        replay = c.post("/v1/videos", json=body, headers={"Idempotency-Key": "v1"})
        plain = c.post("/v1/videos", json=body)
    assert made.status_code == 200, made.text
    assert made.headers["x-request-id"] == made.json()["id"] and plain.headers["x-request-id"] == plain.json()["id"]
    assert replay.json()["id"] == made.json()["id"] and "x-request-id" not in replay.headers
