"""--access-log on a real head process: its log has a line per request, naming the id the answer gave
and the one the request came with (an ingress's)."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.e2e.harness import deployment
from tests.e2e.test_server_timing import ROLE_FLAGS
from triptych.roles import Role

pytestmark = pytest.mark.slow


def test_a_head_with_access_log_logs_each_request_with_its_id(tiny_models, tmp_path):
    with deployment(
        tiny_models["tiny-flux"], tmp_path, simulate=True, role_flags=ROLE_FLAGS, head_flags=("--access-log",)
    ) as dep, dep.client(timeout=30) as c:  # fmt: skip
        body = {"prompt": "x", "size": "64x32", "num_inference_steps": 2}
        answer = c.post("/v1/images/generations", json=body, headers={"X-Request-Id": "ingress-7f3a"})
        assert answer.status_code == 200, answer.text
        assert c.get("/health").status_code == 200
        assert c.get("/v1/videos/video_none").status_code == 404
        wanted = '"POST /v1/images/generations" 200 '
        deadline = time.monotonic() + 10
        while "/v1/videos/video_none" not in (text := dep.head.log.read_text(errors="replace")):
            assert time.monotonic() < deadline, dep.head.tail()
            time.sleep(0.1)
    (line,) = [line for line in text.splitlines() if wanted in line]
    assert line.endswith(f"id={answer.headers['x-request-id']} owner=- ref=ingress-7f3a"), line
    after = text.split(line, 1)[1]
    assert '"GET /v1/videos/video_none" 404 ' in after
    assert "/health" not in after  # a probe that answered is not logged


# a line Mooncake's engine writes itself, from C++ (glog's prefix, and glog's own first line)
GLOG = re.compile(r"[IWEF]\d{4} |WARNING: Logging before InitGoogleLogging\(\)")


def test_with_log_format_json_every_line_of_the_processes_is_an_object(tiny_models, tmp_path):
    json_logs = ("--log-format", "json")
    with deployment(
        tiny_models["tiny-flux"], tmp_path, simulate=True, role_flags=ROLE_FLAGS,
        head_flags=("--access-log", *json_logs), worker_flags=json_logs,
    ) as dep, dep.client(timeout=30) as c:  # fmt: skip
        answer = c.post("/v1/images/generations", json={"prompt": "x", "size": "64x32", "num_inference_steps": 2})
        assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 10
        while '"http"' not in dep.head.log.read_text(errors="replace"):
            assert time.monotonic() < deadline, dep.head.tail()
            time.sleep(0.1)
        logs = {p.role: p.log.read_text(errors="replace") for p in dep.procs}
    head = [json.loads(line) for line in logs[Role.SERVER].splitlines()]  # uvicorn's lines included
    assert {"time", "level", "process", "logger", "message"} <= set(head[0]) and head[0]["process"] == "server"
    (access,) = [line for line in head if "http" in line]
    assert access["http"]["request_id"] == answer.headers["x-request-id"] and access["http"]["status"] == 200
    assert access["request_id"] == answer.headers["x-request-id"]  # what a log query filters a request's lines by
    assert any(line["logger"].startswith("uvicorn") for line in head), "uvicorn logs through the same handler"
    for role in (Role.ENCODER, Role.DENOISER, Role.DECODER):
        lines = [line for line in logs[role].splitlines() if not GLOG.match(line)]
        assert lines and all(json.loads(line)["process"] == role.value for line in lines), logs[role][-2000:]
