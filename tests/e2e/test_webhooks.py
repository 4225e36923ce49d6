"""--webhook-url on a real head process: a video job's end reaches a receiver the test runs, signed
with the key of --webhook-secret-file, as the job the API shows."""

from __future__ import annotations

import base64
import time

import pytest

from tests.e2e.harness import deployment
from tests.e2e.test_server_timing import ROLE_FLAGS
from tests.webhook_receiver import verified, webhook_receiver

pytestmark = pytest.mark.slow

KEY = b"triptych-webhook-test-key-32bytes"


def test_a_head_posts_a_finished_video_job_signed_to_its_webhook(tiny_models, tmp_path):
    (tmp_path / "webhook.secret").write_text("whsec_" + base64.b64encode(KEY).decode() + "\n")
    with webhook_receiver(answers=[503]) as hooks:  # the first attempt is refused: the head tries again
        flags = ("--webhook-url", hooks.url, "--webhook-secret-file", str(tmp_path / "webhook.secret"))
        wan = tiny_models["tiny-wan"]
        with (
            deployment(wan, tmp_path, simulate=True, role_flags=ROLE_FLAGS, head_flags=flags) as dep,
            dep.client(timeout=30) as c,
        ):
            body = {"prompt": "waves", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
            job = c.post("/v1/videos", json=body).json()
            deadline = time.monotonic() + 120
            while (shown := c.get(f"/v1/videos/{job['id']}").json())["status"] != "completed":
                assert time.monotonic() < deadline and shown["status"] != "failed", shown
                time.sleep(0.1)
            first, again = hooks.wait(2)
            metrics = c.get("/metrics").text
    assert first.headers["webhook-id"] == again.headers["webhook-id"] and verified(again, KEY), again.headers
    event = again.event
    assert (event["type"], event["data"]["id"], event["data"]["status"]) == ("video.completed", job["id"], "completed")
    assert event["data"]["content_url"] == f"/v1/videos/{job['id']}/content"
    assert 'triptych_webhook_deliveries_total{outcome="delivered",type="video.completed"} 1.0' in metrics
