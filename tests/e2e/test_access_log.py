"""--access-log on a real head process: its log has a line per request, naming the id the answer gave
and the one the request came with (an ingress's)."""

from __future__ import annotations

import time

import pytest

from tests.e2e.harness import deployment
from tests.e2e.test_server_timing import ROLE_FLAGS

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
