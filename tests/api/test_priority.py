"""A request's priority at the head's door: the body field, its default, and the API key's ceiling
(403 naming `priority` and the ceiling), in-process over HTTP with a scripted backend. The queues
and preemption it drives are tests/unit/test_preemption.py's; real processes tests/e2e/test_preemption.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend
from triptych.families import ModelInfo
from triptych_head.api.app import create_app
from triptych_head.api.auth import APIKeyError, APIKeys, parse_entries, parse_keys
from triptych_head.api.context import HeadContext

BODY = {"prompt": "x", "size": "32x32", "num_inference_steps": 1}


def client_for(tmp_path: Path, backend: ScriptedBackend, keys: str | None, kind: str = "image") -> Any:
    from fastapi.testclient import TestClient

    api_keys = None
    if keys is not None:
        (tmp_path / "keys").write_text(keys)
        api_keys = APIKeys(tmp_path / "keys")
    model = ModelInfo("tiny", "WanPipeline" if kind == "video" else "FluxPipeline", kind, 4, 3.5)
    ctx = HeadContext(backend, model, tmp_path, CollectorRegistry(), api_keys=api_keys)
    return TestClient(create_app(ctx))


def test_a_keys_file_line_may_give_its_key_a_priority_ceiling_and_a_bare_key_means_normal() -> None:
    text = "sk-bare\nsk-high  max_priority=high  # interactive\nsk-low max_priority=low\n"
    ceilings = [(entry.key, entry.max_priority, entry.limit) for entry in parse_entries(text)]
    assert ceilings == [("sk-bare", "normal", None), ("sk-high", "high", None), ("sk-low", "low", None)]
    assert parse_keys(text) == ["sk-bare", "sk-high", "sk-low"]  # the keys as before: the file stays compatible


def test_an_unknown_option_or_level_stops_the_head_naming_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a\nsk-b max_priority=urgent\n")
    with pytest.raises(APIKeyError, match=r"--api-keys-file .*line 2: max_priority='urgent' is not one of low"):
        APIKeys(path)
    path.write_text("sk-a tier=gold\n")
    with pytest.raises(APIKeyError, match="unknown option 'tier'"):
        APIKeys(path)


def test_a_key_cannot_ask_above_its_ceiling_and_gets_up_to_it(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    keys = "sk-bare\nsk-high max_priority=high\nsk-low max_priority=low\n"
    with client_for(tmp_path, backend, keys) as client:

        def post(key: str, **extra: Any) -> Any:
            return client.post(
                "/v1/images/generations", json={**BODY, **extra}, headers={"Authorization": f"Bearer {key}"}
            )

        refused = post("sk-bare", priority="high")
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["param"] == "priority" and error["code"] == "priority_not_allowed"
        assert "'high'" in error["message"] and "ceiling 'normal'" in error["message"]
        assert post("sk-low", priority="normal").status_code == 403
        assert not backend.priorities, "a refused request never reaches the pipeline"
        assert post("sk-high", priority="high").status_code == 200
        assert post("sk-bare").status_code == 200  # the default, normal, is within a bare key's ceiling
        assert post("sk-low", priority="low").status_code == 200
        assert backend.priorities == [2, 1, 0]


def test_without_api_keys_any_level_is_taken_and_an_unknown_one_is_a_400(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    with client_for(tmp_path, backend, None) as client:
        assert client.post("/v1/images/generations", json={**BODY, "priority": "high"}).status_code == 200
        bad = client.post("/v1/images/generations", json={**BODY, "priority": "urgent"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text
    assert backend.priorities == [2]


def test_a_video_job_carries_its_priority_to_the_pipeline_within_the_ceiling(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    with client_for(tmp_path, backend, "sk-a max_priority=low\n", kind="video") as client:
        auth = {"Authorization": "Bearer sk-a"}
        body = {**BODY, "num_frames": 1}
        assert client.post("/v1/videos", json={**body, "priority": "high"}, headers=auth).status_code == 403
        job = client.post("/v1/videos", json={**body, "priority": "low"}, headers=auth)
        assert job.status_code == 200, job.text
        for _ in range(200):
            if client.get(f"/v1/videos/{job.json()['id']}", headers=auth).json()["status"] == "completed":
                break
    assert backend.priorities == [0]
