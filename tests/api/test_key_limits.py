"""An API key's `max_in_flight=N` (head/triptych_head/api/key_limits.py): at most N of its generation
requests at once on the head, the next a 429 `key_concurrency_limit` with Retry-After that never
reaches the pipeline; other keys unaffected; the count freed as requests end. In-process over HTTP
with a scripted backend whose video jobs stay in flight while they run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend
from triptych.families import ModelInfo
from triptych_head.api.app import create_app
from triptych_head.api.auth import APIKeyError, APIKeys, parse_entries
from triptych_head.api.context import HeadContext
from triptych_head.api.key_limits import KeyLimit

KEYS = "sk-small max_in_flight=2\nsk-big max_priority=high max_in_flight=50\nsk-open\n"
VIDEO = {"prompt": "x", "size": "32x32", "num_inference_steps": 4, "num_frames": 1}
IMAGE = {"prompt": "x", "size": "32x32", "num_inference_steps": 1}


def test_a_keys_file_line_may_limit_its_key_in_flight() -> None:
    small, big, bare = parse_entries(KEYS)
    assert small.limit is not None and small.limit.max_in_flight == 2
    assert big.max_priority == "high" and big.limit is not None and big.limit.max_in_flight == 50
    assert bare.limit is None  # a bare key is not limited
    assert "sk-small" not in small.limit.key_id and small.limit.key_id != big.limit.key_id  # a digest names it


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", ""])
def test_a_limit_that_is_not_a_whole_number_stops_the_head_naming_the_line(tmp_path: Path, value: str) -> None:
    path = tmp_path / "keys"
    path.write_text(f"sk-a\nsk-b max_in_flight={value}\n")
    with pytest.raises(APIKeyError, match=rf"--api-keys-file .*line 2: max_in_flight='{value}' must be a whole"):
        APIKeys(path)


def client_for(tmp_path: Path, backend: ScriptedBackend) -> Any:
    from fastapi.testclient import TestClient

    (tmp_path / "keys").write_text(KEYS)
    model = ModelInfo("tiny", "WanPipeline", "video", 4, 3.5)
    ctx = HeadContext(backend, model, tmp_path, CollectorRegistry(), api_keys=APIKeys(tmp_path / "keys"))
    return TestClient(create_app(ctx)), ctx


def test_a_key_at_its_limit_gets_a_429_until_one_of_its_requests_ends(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    backend.step_delay = 0.25  # a job stays in flight ~1 s
    client, ctx = client_for(tmp_path, backend)
    with client:

        def post(key: str, path: str = "/v1/videos", body: dict[str, Any] = VIDEO) -> Any:
            return client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})

        first, second = post("sk-small"), post("sk-small")
        assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
        refused = post("sk-small")
        image = post("sk-small", "/v1/images/generations", IMAGE)  # one count for every generation endpoint
        for r in (refused, image):
            assert r.status_code == 429, r.text
            error = r.json()["error"]
            assert error["code"] == "key_concurrency_limit" and "max_in_flight=2" in error["message"], error
            assert int(r.headers["Retry-After"]) >= 1
        assert len(backend.calls) == 2, "a refused request never reaches the pipeline"
        assert post("sk-open").status_code == 200 and post("sk-big").status_code == 200  # other keys go on
        limit = parse_entries(KEYS)[0].limit
        assert isinstance(limit, KeyLimit) and ctx.key_limits.in_flight(limit.key_id) == 2

        deadline = time.monotonic() + 20
        while client.get(f"/v1/videos/{first.json()['id']}", headers={"Authorization": "Bearer sk-small"}).json()[
            "status"
        ] not in ("completed", "failed"):
            assert time.monotonic() < deadline, "the first job never ended"
            time.sleep(0.05)
        again = post("sk-small")
        assert again.status_code == 200, again.text  # the ended job's place is free
        metrics = client.get("/metrics").text
    assert "triptych_rejected_key_limit_requests_total 2.0" in metrics
