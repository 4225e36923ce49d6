"""API keys, the body limit and admission control in-process (the real-process tests are in
tests/e2e/test_http_guards.py): key files, constant-time comparison, the bound's arithmetic, and a
video job refused at its POST rather than failed later."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend
from triptych.families import ModelInfo
from triptych_head.admission import MAX_RETRY_AFTER_S, MIN_QUEUED, AdmissionControl, Overloaded, retry_after_seconds
from triptych_head.api.app import create_app
from triptych_head.api.auth import APIKeyError, APIKeys, parse_keys
from triptych_head.api.context import HeadContext
from triptych_head.metrics import HeadMetrics


def test_keys_file_takes_one_key_per_line_with_comments_and_blank_lines() -> None:
    assert parse_keys("# clients\n\nsk-a\n  sk-b  # team b\n#sk-old\n") == ["sk-a", "sk-b"]


def test_a_missing_or_keyless_file_stops_the_head_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(APIKeyError, match="--api-keys-file"):
        APIKeys(tmp_path / "absent")
    (tmp_path / "empty").write_text("# nothing yet\n")
    with pytest.raises(APIKeyError, match="lists no key"):
        APIKeys(tmp_path / "empty")


def test_every_key_is_compared_in_constant_time_whichever_matches(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a\nsk-b\nsk-c\n")
    keys = APIKeys(path)
    compared: list[bytes] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(b)
        return compare(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    assert keys.valid(b"sk-a") and keys.valid(b"sk-c") and not keys.valid(b"sk-x")
    assert compared == [b"sk-a", b"sk-b", b"sk-c"] * 3  # no early exit on a match


def test_a_changed_file_is_reread_and_an_unreadable_one_keeps_the_keys(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("triptych_head.api.auth.RECHECK_S", 0.0)
    path = tmp_path / "keys"
    path.write_text("sk-old\n")
    keys = APIKeys(path)
    new = tmp_path / "keys.new"
    new.write_text("sk-new\n")
    os.replace(new, path)  # as a Secret update swaps the file
    assert keys.valid(b"sk-new") and not keys.valid(b"sk-old")
    path.unlink()  # a failed re-read must not open the API, nor lock out the current clients
    assert keys.valid(b"sk-new") and not keys.valid(b"")


def test_the_bound_is_the_worker_slots_plus_twice_as_many_queued_at_least_eight() -> None:
    control = AdmissionControl(None, HeadMetrics())
    assert control.limit.max_in_flight == MIN_QUEUED  # no worker heartbeat yet: a few may still wait
    control.update(worker_slots=10, retry_after_s=3)
    assert (control.limit.max_queued, control.limit.max_in_flight) == (20, 30)
    explicit = AdmissionControl(0, HeadMetrics(), worker_slots=10)
    assert explicit.limit.max_in_flight == 10
    explicit.check(9)
    with pytest.raises(Overloaded, match="--max-queued-requests") as refused:
        explicit.check(10)
    assert refused.value.retry_after_s == explicit.limit.retry_after_s


def test_retry_after_is_the_slowest_roles_request_time_over_its_instances() -> None:
    assert retry_after_seconds(12.0, 4) == 3
    assert retry_after_seconds(0.01, 1) == 1  # whole seconds, at least one
    assert retry_after_seconds(10.0, 0) == 10  # no ready instance: as if one
    assert retry_after_seconds(1e6, 1) == MAX_RETRY_AFTER_S


def test_a_video_job_over_the_bound_is_refused_at_its_post_and_never_created(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    metrics = HeadMetrics(CollectorRegistry())
    ctx = HeadContext(
        backend=ScriptedBackend(),
        model=ModelInfo("tiny", "WanPipeline", "video", 4, 3.5),
        output_path=tmp_path,
        registry=metrics.registry,
        admission=AdmissionControl(0, metrics, worker_slots=0),
    )
    with TestClient(create_app(ctx)) as client:
        r = client.post("/v1/videos", json={"prompt": "x", "size": "32x32", "num_frames": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
        assert r.headers["Retry-After"].isdigit()
        assert client.get("/v1/videos").json() == []
        assert client.get("/health").json()["admission"] == {
            "in_flight": 0, "max_in_flight": 0, "worker_slots": 0, "max_queued": 0, "retry_after_s": 5,
        }  # fmt: skip
