"""Every answer says where its time went: a `Server-Timing` header naming the queue of each role, each
role's stage and each transfer between roles, whose parts add up to no more than the total
(head/triptych_head/timeline.py; docs/serving.md, "Where the time goes")."""

from __future__ import annotations

import time

import pytest

from tests.e2e.harness import deployment
from triptych.client import TriptychClient
from triptych.roles import Role
from triptych_head.timeline import parse_server_timing

pytestmark = pytest.mark.slow

# Simulated stages of a known length: 50 ms each, so each role's part is visibly there.
STAGES = ("--simulate-seconds", "0.05", "--simulate-seconds-per-unit", "0")
ROLE_FLAGS = {role: STAGES for role in (Role.ENCODER, Role.DENOISER, Role.DECODER)}
PARTS = [
    "queue-encoder", "encoder",
    "queue-denoiser", "transfer-encoder-denoiser", "denoiser",
    "queue-decoder", "transfer-denoiser-decoder", "decoder",
]  # fmt: skip


def check_consistent(header: str | None) -> dict[str, float]:
    assert header, "no Server-Timing header"
    parts = parse_server_timing(header)
    assert sorted(parts) == sorted([*PARTS, "total"]), header
    assert all(ms >= 0 for ms in parts.values()), header
    for role in ("encoder", "denoiser", "decoder"):
        assert parts[role] >= 50 * 0.9, header  # the simulated stage's time, as the worker reports it
    assert sum(parts[name] for name in PARTS) <= parts["total"] + 0.01, header  # rounding to microseconds
    return parts


def test_image_and_video_answers_carry_a_consistent_server_timing_header(tiny_models, tmp_path):
    with deployment(tiny_models["tiny-wan"], tmp_path, simulate=True, role_flags=ROLE_FLAGS) as dep:
        with dep.client(timeout=30) as c:
            body = {"prompt": "x", "size": "32x32", "num_frames": 5, "num_inference_steps": 2, "seed": 1}
            job = c.post("/v1/videos", json=body).json()
            deadline = time.monotonic() + 30
            while (status := c.get(f"/v1/videos/{job['id']}")).json()["status"] != "completed":
                assert time.monotonic() < deadline, status.json()
                time.sleep(0.1)
            check_consistent(status.headers.get("server-timing"))
            content = c.get(f"/v1/videos/{job['id']}/content")
            assert content.status_code == 200
            assert content.headers.get("server-timing") == status.headers["server-timing"]


def test_an_image_answer_and_its_idempotent_first_run_carry_the_header(tiny_models, tmp_path):
    with deployment(tiny_models["tiny-flux"], tmp_path, simulate=True, role_flags=ROLE_FLAGS) as dep:
        with dep.client(timeout=30) as c:
            body = {"prompt": "x", "size": "64x32", "num_inference_steps": 2, "seed": 1}
            r = c.post("/v1/images/generations", json=body)
            assert r.status_code == 200, r.text
            check_consistent(r.headers.get("server-timing"))
            first = c.post("/v1/images/generations", json=body, headers={"Idempotency-Key": "k1"})
            check_consistent(first.headers.get("server-timing"))
            streamed = list(TriptychClient(dep.http, timeout=30).stream_images(body))  # headers went out first:
            assert streamed[-1].event == "completed", streamed[-1]  # its completed event carries the value
            check_consistent(streamed[-1].data["server_timing"])
            replay = c.post("/v1/images/generations", json=body, headers={"Idempotency-Key": "k1"})
            assert replay.headers.get("idempotent-replayed") == "true"
            assert "server-timing" not in replay.headers  # no run: nothing was timed
            metrics = c.get("/metrics").text
            for name in ("triptych_queue_seconds_count", "triptych_stage_seconds_count", "triptych_request_seconds"):
                assert name in metrics
