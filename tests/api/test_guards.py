"""API keys, the body limit and admission control in-process (the real-process tests are in
tests/e2e/test_http_guards.py and tests/e2e/test_deadlines.py): key files, constant-time comparison,
the cap's arithmetic, deadlines over HTTP (429 deadline_unachievable, the estimate header, bad
deadlines), and a video job refused at its POST rather than failed later."""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend
from triptych.families import ModelInfo
from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_head.admission import MAX_RETRY_AFTER_S, AdmissionControl, Overloaded, retry_after_seconds
from triptych_head.api.app import create_app
from triptych_head.api.auth import APIKeyError, APIKeys, parse_keys
from triptych_head.api.context import HeadContext
from triptych_head.api.deadlines import ESTIMATE_HEADER
from triptych_head.deadline import LoadFigures, RoleFigures
from triptych_head.metrics import HeadMetrics

PARAMS = GenerationParams(prompt="p", width=32, height=32, num_inference_steps=2)


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


def test_without_the_flag_there_is_no_cap_in_requests_and_with_it_the_cap_is_slots_plus_queued() -> None:
    control = AdmissionControl(None, HeadMetrics())
    control.update(worker_slots=10, retry_after_s=3)
    assert (control.limit.max_queued, control.limit.max_in_flight) == (None, None)  # deadlines decide
    explicit = AdmissionControl(0, HeadMetrics(), worker_slots=10)
    assert explicit.limit.max_in_flight == 10
    explicit.admit("r", PARAMS, None, in_flight=9)
    with pytest.raises(Overloaded, match="--max-queued-requests") as refused:
        explicit.admit("r", PARAMS, None, in_flight=10)
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
        assert client.get("/v1/videos").json()["data"] == []
        assert client.get("/health").json()["admission"] == {
            "in_flight": 0, "max_in_flight": 0, "worker_slots": 0, "max_queued": 0, "retry_after_s": 5, "wait_s": {},
        }  # fmt: skip


# --- deadlines over HTTP ----------------------------------------------------------------------

DENOISER_BACKLOG_S = 20.0


def deadline_client(tmp_path: Path, kind: str = "image", timeout_s: float = 600.0) -> Any:
    """A head whose one denoiser has DENOISER_BACKLOG_S of work queued; a 32x32 2-step request's own
    work is about 0.013 s (encoder 0.01 s, then a second per megapixel-step and per megapixel)."""
    from fastapi.testclient import TestClient

    metrics = HeadMetrics(CollectorRegistry())
    admission = AdmissionControl(None, metrics)
    busy = {Role.DENOISER: DENOISER_BACKLOG_S}
    per_unit = {Role.ENCODER: 0.01, Role.DENOISER: 1.0, Role.DECODER: 1.0}
    roles = {r: RoleFigures(busy.get(r, 0.0), 1, s, True) for r, s in per_unit.items()}
    admission.update(3, 1, LoadFigures(roles))
    pipeline = "WanPipeline" if kind == "video" else "FluxPipeline"
    ctx = HeadContext(
        backend=ScriptedBackend(),
        model=ModelInfo("tiny", pipeline, kind, 4, 3.5),
        output_path=tmp_path,
        registry=metrics.registry,
        admission=admission,
        request_timeout_s=timeout_s,
    )
    return TestClient(create_app(ctx)), ctx.backend


SMALL = {"prompt": "x", "size": "32x32", "num_inference_steps": 2}


def test_a_deadline_before_the_estimate_gets_429_with_the_estimate_and_no_generation(tmp_path: Path) -> None:
    client, backend = deadline_client(tmp_path)
    with client:
        r = client.post("/v1/images/generations", json={**SMALL, "deadline_seconds": 5})
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"], error["deadline_seconds"]) == (
            "deadline_unachievable",
            "deadline_seconds",
            5,
        )
        assert error["estimate_seconds"] > DENOISER_BACKLOG_S and error["wait_seconds"] == DENOISER_BACKLOG_S
        assert "after its deadline of 5s" in error["message"]
        assert int(r.headers["Retry-After"]) == 16  # until 15 s of the backlog has drained
        assert backend.calls == []
        r = client.post("/v1/images/generations", json=SMALL, headers={"X-Deadline-Seconds": "2.5"})
        assert r.status_code == 429 and r.json()["error"]["param"] == "X-Deadline-Seconds"
        assert "triptych_rejected_deadline_requests_total 2.0" in client.get("/metrics").text


def test_an_accepted_request_carries_its_estimate(tmp_path: Path) -> None:
    client, backend = deadline_client(tmp_path)
    with client:
        for body, headers in (({**SMALL, "deadline_seconds": 60}, {}), (SMALL, {}), ({**SMALL, "stream": True}, {})):
            r = client.post("/v1/images/generations", json=body, headers=headers)
            assert r.status_code == 200, r.text
            assert DENOISER_BACKLOG_S < float(r.headers[ESTIMATE_HEADER]) < DENOISER_BACKLOG_S + 1
        assert len(backend.calls) == 3


def test_the_request_timeout_is_the_default_deadline_and_the_latest_one(tmp_path: Path) -> None:
    client, _ = deadline_client(tmp_path, timeout_s=10.0)
    with client:
        r = client.post("/v1/images/generations", json=SMALL)
        assert r.status_code == 429 and r.json()["error"]["param"] is None
        assert r.json()["error"]["deadline_seconds"] == 10.0
        r = client.post("/v1/images/generations", json={**SMALL, "deadline_seconds": 3600})
        assert r.status_code == 429 and r.json()["error"]["deadline_seconds"] == 10.0


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"deadline_seconds": 0}, {}, "deadline_seconds"),
        ({"deadline_seconds": -3}, {}, "deadline_seconds"),
        ({"deadline_seconds": "soon"}, {}, "deadline_seconds"),
        ({}, {"X-Deadline-Seconds": "0"}, "X-Deadline-Seconds"),
        ({}, {"X-Deadline-Seconds": "nan"}, "X-Deadline-Seconds"),
        ({}, {"X-Deadline-Seconds": "tomorrow"}, "X-Deadline-Seconds"),
        ({}, {"X-Deadline-Seconds": "1e-320"}, "X-Deadline-Seconds"),  # the body field's minimum holds here too
        ({}, {"X-Deadline-Seconds": "1e300"}, "X-Deadline-Seconds"),  # and its maximum
    ],
)
def test_a_deadline_that_is_not_a_positive_number_is_a_400_naming_it(tmp_path: Path, body, headers, param) -> None:
    client, backend = deadline_client(tmp_path)
    with client:
        r = client.post("/v1/images/generations", json={**SMALL, **body}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert backend.calls == []


def test_a_video_job_reports_its_estimate_in_its_status_and_a_late_one_is_never_created(tmp_path: Path) -> None:
    client, _ = deadline_client(tmp_path, kind="video")
    with client:
        body = {"prompt": "x", "size": "32x32", "num_frames": 1, "num_inference_steps": 2}
        r = client.post("/v1/videos", json={**body, "deadline_seconds": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "deadline_unachievable"
        assert client.get("/v1/videos").json()["data"] == []
        r = client.post("/v1/videos", json=body)
        assert r.status_code == 200, r.text
        estimate = r.json()["estimated_completion_seconds"]
        assert DENOISER_BACKLOG_S < estimate < DENOISER_BACKLOG_S + 1
        assert float(r.headers[ESTIMATE_HEADER]) == pytest.approx(estimate)
        assert client.get(f"/v1/videos/{r.json()['id']}").json()["estimated_completion_seconds"] == estimate
