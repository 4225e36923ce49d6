"""The progress routes over a scripted backend: a streamed image ends with the plain answer's
pixels or with the error, a video's events end with the job, and the playground's files."""

from __future__ import annotations

import time

import pytest

from tests.api.test_http_api import ScriptedBackend, make_client
from triptych.client import iter_sse
from triptych.protocol import RequestEvent
from triptych_head.api import videos
from triptych_head.backend import GenerationFailed


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend()


def events(client, method: str, path: str, **kwargs) -> list:
    with client.stream(method, path, **kwargs) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return list(iter_sse(r.iter_lines()))


def test_a_streamed_image_reports_each_step_then_the_same_pixels_as_the_plain_answer(backend, tmp_path):
    body = {"prompt": "cat", "size": "32x32", "seed": 1, "num_inference_steps": 3}
    with make_client(backend, tmp_path, kind="image") as c:
        got = events(c, "POST", "/v1/images/generations", json={**body, "stream": True})
        plain = c.post("/v1/images/generations", json=body).json()
    assert [e.event for e in got] == ["step", "step", "step", "completed"]
    assert [e.data["step"] for e in got[:3]] == [1, 2, 3] and got[0].data["role"] == "denoiser"
    assert got[-1].data["data"] == plain["data"]


def test_a_streamed_image_that_fails_ends_with_the_error(backend, tmp_path):
    backend.fail = GenerationFailed("the denoiser ran out of memory", 503, "FAILED")
    with make_client(backend, tmp_path, kind="image") as c:
        got = events(c, "POST", "/v1/images/generations", json={"prompt": "cat", "size": "32x32", "stream": True})
        assert c.get("/health").json()["admission"]["in_flight"] == 0
    assert got[-1].event == "error"
    assert got[-1].data["error"] == {"message": "the denoiser ran out of memory", "code": "failed", "status": 503}


def test_a_streamed_image_a_worker_refuses_ends_with_the_error_naming_the_field(backend, tmp_path):
    backend.fail = GenerationFailed("denoiser tcp://127.0.0.1:7: loras: adapter 'ink' does not exist", 400)
    with make_client(backend, tmp_path, kind="image") as c:
        got = events(c, "POST", "/v1/images/generations", json={"prompt": "cat", "size": "32x32", "stream": True})
    assert got[-1].event == "error"
    assert got[-1].data["error"]["param"] == "loras" and got[-1].data["error"]["status"] == 400


def test_a_video_s_events_end_with_the_job_and_a_finished_job_answers_at_once(backend, tmp_path, monkeypatch):
    monkeypatch.setattr(videos, "HISTORY_LINGER_S", 1.0)
    backend.step_delay = 0.05
    with make_client(backend, tmp_path) as c:
        job = c.post("/v1/videos", json={"prompt": "sea", "size": "32x32", "num_frames": 5}).json()
        got = events(c, "GET", f"/v1/videos/{job['id']}/events")
        assert [e.data["step"] for e in got if e.event == "step"] == [1, 2, 3, 4]
        assert got[-1].event == "completed" and got[-1].data["status"] == "completed"
        assert c.get(got[-1].data["content_url"]).content[4:8] == b"ftyp"
        # Asked again within a minute of the end: the same story at once (a fast job's client that asked
        # for its events after the POST); a minute (here a second) later only the end.
        again = events(c, "GET", f"/v1/videos/{job['id']}/events")
        assert [(e.event, e.data.get("step")) for e in again] == [(e.event, e.data.get("step")) for e in got]
        time.sleep(1.2)
        assert [e.event for e in events(c, "GET", f"/v1/videos/{job['id']}/events")] == ["completed"]
        assert c.get("/v1/videos/video_nope/events").status_code == 404


def test_a_cancelled_video_s_events_end_with_a_cancelled_error(backend, tmp_path):
    backend.step_delay = 1.0
    with make_client(backend, tmp_path) as c:
        job = c.post("/v1/videos", json={"prompt": "sea", "size": "32x32", "num_frames": 5}).json()
        time.sleep(0.2)
        assert c.delete(f"/v1/videos/{job['id']}").json()["status"] == "cancelled"
        got = events(c, "GET", f"/v1/videos/{job['id']}/events")
    assert [e.event for e in got] == ["error"] and got[0].data["error"]["status"] == 499


def test_the_playground_is_served_at_the_root_with_its_files(backend, tmp_path):
    with make_client(backend, tmp_path) as c:
        page = c.get("/")
        assert page.status_code == 200 and "Content-Security-Policy" in page.headers
        assert '<script type="module" src="/static/app.js">' in page.text
        assert c.get("/static/app.js").headers["content-type"].startswith("text/javascript")
        assert c.get("/static/nope.js").status_code == 404
        files = [c.get(f"/static/{name}") for name in ("app.js", "style.css")]
        index = c.get("/static/index.html", follow_redirects=False)
    policy = page.headers["Content-Security-Policy"]
    assert "connect-src 'self';" in policy  # its own origin only
    assert "frame-ancestors 'none'" in policy and page.headers["X-Frame-Options"] == "DENY"  # no site frames it
    for file in files:  # the page's files under the page's policy, asked for again after an upgrade
        assert file.status_code == 200
        assert file.headers["Content-Security-Policy"] == policy and file.headers["Cache-Control"] == "no-cache"
    assert index.status_code == 308 and index.headers["location"] == "/"  # the page is served at / only


def test_with_presigned_content_the_page_may_fetch_and_play_from_the_bucket():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from triptych_head.api.playground import install_playground, origin_of

    app = FastAPI()
    install_playground(app, origin_of("http://seaweedfs.storage:8333/"))
    policy = TestClient(app).get("/").headers["Content-Security-Policy"]
    assert "connect-src 'self' http://seaweedfs.storage:8333;" in policy
    assert "media-src 'self' blob: http://seaweedfs.storage:8333;" in policy
    assert origin_of(None) is None and origin_of("not a url") is None


class PreviewBurst(ScriptedBackend):
    """Reports all its steps, each with a preview, in one go (no await between them): faster than any
    client can read them."""

    async def generate(self, request_id, params, on_event=None, preview_every=0, priority=1):  # type: ignore[no-untyped-def]
        for step in range(1, 51):
            on_event(RequestEvent(request_id, "DENOISING_RUNNING", step, 50, preview=bytes(20_000), role="denoiser"))
        return await super().generate(request_id, params, None, preview_every, priority)


def test_previews_faster_than_the_client_reads_leave_it_the_newest_ones_and_the_result(tmp_path):
    body = {"prompt": "cat", "size": "32x32", "seed": 1, "stream": True, "preview_every": 1}
    with make_client(PreviewBurst(), tmp_path, kind="image") as c:
        got = events(c, "POST", "/v1/images/generations", json=body)
    assert [e.data["step"] for e in got if e.event == "step"] == list(range(1, 51))
    assert [e.data["step"] for e in got if e.event == "step" and "preview" in e.data] == list(range(43, 51))
    assert got[-1].event == "completed" and len(got[-1].data["data"]) == 1


def test_a_streamed_image_that_fails_unexpectedly_ends_with_an_internal_error_naming_only_its_id(
    backend, tmp_path, caplog
):
    """An exception the head did not expect: the client's `error` event says internal_error and the
    request's id, never the exception's text (a host, a path); the head's log has that."""
    backend.fail = RuntimeError("connect to 10.0.3.7:9000 refused")  # type: ignore[assignment]
    with make_client(backend, tmp_path, kind="image") as c:
        got = events(c, "POST", "/v1/images/generations", json={"prompt": "cat", "size": "32x32", "stream": True})
    assert got[-1].event == "error"
    error = got[-1].data["error"]
    assert error["code"] == "internal_error" and error["status"] == 500, error
    assert error["message"].startswith("internal error (request img") and "10.0.3.7" not in error["message"], error
    assert "10.0.3.7" in caplog.text
