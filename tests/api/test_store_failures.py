"""A result store that fails (an S3 error, a full disk) under the video endpoints: each request is a
503 store_unavailable with Retry-After, naming what the store was asked, and leaves nothing behind
that no head would ever end (a job listed queued for ever, a request counted in flight, an
Idempotency-Key stuck running). A DELETE that takes over an orphaned job ends it, for good; one that
comes while a slow store still writes the job's last status removes it after that write, not before."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.test_http_api import ScriptedBackend, make_client, wait_for
from tests.api.test_takeover import _orphan
from triptych_head.api.video_jobs import VideoJobs
from triptych_head.objects import DirectoryObjects
from triptych_head.results import ResultStore

VIDEO = {"prompt": "waves", "size": "32x16", "num_frames": 5, "num_inference_steps": 2, "seed": 7}


def _failing(*args: Any, **kwargs: Any) -> Any:
    raise OSError(5, "Input/output error")


def _unavailable(r: Any, says: str) -> None:
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    error = r.json()["error"]
    assert error["code"] == "store_unavailable" and says in error["message"], error


def test_a_delete_that_takes_over_an_orphaned_job_cancels_it_for_good(tmp_path: Path, monkeypatch) -> None:
    async def no_scan(self: VideoJobs) -> None:  # the DELETE, not the background scan, takes the job over
        return None

    monkeypatch.setattr(VideoJobs, "take_over_orphans", no_scan)
    backend = ScriptedBackend()
    with make_client(backend, tmp_path) as c:
        _orphan(ResultStore(tmp_path), "video_orphan")
        deleted = c.delete("/v1/videos/video_orphan").json()
        assert (deleted["status"], deleted["deleted"]) == ("cancelled", False)
        assert c.get("/v1/videos/video_orphan").json()["status"] == "cancelled"
        assert not c.app.state.ctx.active  # not counted in flight
        stored = ResultStore(tmp_path).load_job("video_orphan")
        assert stored is not None and stored.job.status == "cancelled" and stored.lease_until is None
        assert c.delete("/v1/videos/video_orphan").json()["deleted"] is True  # now it can go
    assert backend.calls == []


def test_a_new_job_the_store_cannot_list_as_running_is_a_503_and_is_not_made(tmp_path: Path, monkeypatch) -> None:
    backend = ScriptedBackend()
    with make_client(backend, tmp_path) as c:
        with monkeypatch.context() as failing:
            failing.setattr(ResultStore, "mark_running", _failing)
            _unavailable(c.post("/v1/videos", json=VIDEO), "for a new video job")
        assert c.get("/v1/videos").json()["data"] == [] and not c.app.state.ctx.active
        assert not list(tmp_path.rglob("video_*")), "what was saved of it is removed"
        job = c.post("/v1/videos", json=VIDEO).json()  # the store is back: a job as any
        assert wait_for(c, job["id"], "completed")["status"] == "completed"
    assert len(backend.calls) == 1


def test_content_and_delete_answer_503_while_the_store_fails(tmp_path: Path, monkeypatch) -> None:
    with make_client(ScriptedBackend(), tmp_path) as c:
        job_id = c.post("/v1/videos", json=VIDEO).json()["id"]
        wait_for(c, job_id, "completed")
        with monkeypatch.context() as failing:
            failing.setattr(DirectoryObjects, "stat", _failing)
            _unavailable(c.get(f"/v1/videos/{job_id}/content"), f"for videos/{job_id}.mp4")
        with monkeypatch.context() as failing:
            failing.setattr(DirectoryObjects, "list", _failing)
            _unavailable(c.delete(f"/v1/videos/{job_id}"), f"deleting video {job_id}")
        assert c.delete(f"/v1/videos/{job_id}").json()["deleted"] is True  # the store is back


def test_an_answer_the_store_cannot_keep_still_reaches_its_client_and_the_key_is_not_left_running(
    tmp_path: Path, monkeypatch
) -> None:
    put_bytes = DirectoryObjects.put_bytes

    def no_answers(self: DirectoryObjects, name: str, data: bytes, content_type: str) -> None:
        if name.endswith(".response"):
            raise OSError(28, "No space left on device")
        put_bytes(self, name, data, content_type)

    monkeypatch.setattr(DirectoryObjects, "put_bytes", no_answers)
    key = {"Idempotency-Key": "k1"}
    with TestClient(make_client(ScriptedBackend(), tmp_path).app) as c:
        first = c.post("/v1/videos", json=VIDEO, headers=key)
        assert first.status_code == 200 and first.json()["status"] == "queued", first.text
        wait_for(c, first.json()["id"], "completed")
        retried = c.post("/v1/videos", json=VIDEO, headers=key)  # the attempt is recorded failed: run again,
        assert retried.status_code == 200, retried.text  # not a 409 until the attempt's lease runs out
        assert retried.json()["id"] != first.json()["id"]


@pytest.mark.parametrize("path", ["/v1/videos", "/v1/videos/video_x"])
def test_a_store_that_cannot_be_read_is_a_503_for_the_listing_and_a_job(path: str, tmp_path: Path, monkeypatch) -> None:
    with make_client(ScriptedBackend(), tmp_path) as c:
        monkeypatch.setattr(DirectoryObjects, "list", _failing)
        monkeypatch.setattr(DirectoryObjects, "get_bytes", _failing)
        _unavailable(c.get(path), "a listing of video jobs" if path == "/v1/videos" else "for video video_x")


def test_a_delete_while_the_last_save_is_under_way_is_not_undone_by_it(tmp_path: Path, monkeypatch) -> None:
    save_job = ResultStore.save_job

    def slow_last_save(self: ResultStore, job: Any, *args: Any) -> None:
        if job.status == "completed":
            time.sleep(0.5)  # a slow store: the DELETE comes while this write is under way
        save_job(self, job, *args)

    monkeypatch.setattr(ResultStore, "save_job", slow_last_save)
    with make_client(ScriptedBackend(), tmp_path) as c:
        job_id = c.post("/v1/videos", json=VIDEO).json()["id"]
        wait_for(c, job_id, "completed")  # this head answers from memory before the store has it
        assert c.delete(f"/v1/videos/{job_id}").json()["deleted"] is True
        time.sleep(0.7)
        assert c.get(f"/v1/videos/{job_id}").status_code == 404
    assert not list(tmp_path.rglob(f"{job_id}*"))


def test_events_of_a_job_another_head_runs_keep_alive_and_outlast_a_store_that_fails_once(
    tmp_path: Path, monkeypatch
) -> None:
    """Followed through the store, the stream says `: keep-alive` while nothing changes (a proxy's idle
    timeout would cut it), and one failed read of the store does not end it with an error: the job
    has not ended. It ends with the job's own end."""
    from triptych_head.api import video_jobs

    monkeypatch.setattr(video_jobs, "KEEPALIVE_S", 0.3)
    monkeypatch.setattr(video_jobs, "FOREIGN_POLL_S", 0.05)
    store = ResultStore(tmp_path)
    _orphan(store, "video_foreign", lease_until=time.time() + 300)  # another head, alive, runs it
    load_job = ResultStore.load_job
    failure = {"armed": False, "done": False}

    def fails_once(self: ResultStore, job_id: str) -> Any:
        if failure["armed"] and not failure["done"]:
            failure["done"] = True
            raise OSError(5, "Input/output error")
        return load_job(self, job_id)

    monkeypatch.setattr(ResultStore, "load_job", fails_once)
    lines: list[str] = []
    with make_client(ScriptedBackend(), tmp_path) as c:
        with c.stream("GET", "/v1/videos/video_foreign/events") as events:
            for line in events.iter_lines():
                lines.append(line)
                failure["armed"] = True  # the stream is under way: its next read of the store fails
                if line.startswith(": keep-alive") and failure["done"]:  # past the failure: the other head ends it
                    stored = load_job(store, "video_foreign")
                    assert stored is not None
                    job = stored.job
                    job.status, job.state, job.completed_at = "completed", "DONE", int(time.time())
                    store.save_job(job)
    assert ": keep-alive" in lines and "event: completed" in lines, lines
    assert "event: error" not in lines


def test_a_url_image_the_store_cannot_keep_is_a_503_naming_it(tmp_path: Path, monkeypatch) -> None:
    """`response_format: url` writes the image to the store before answering: a store that fails then is
    the same 503 store_unavailable as any other store call, in the plain answer and in the stream."""
    body = {"prompt": "c", "size": "32x32", "response_format": "url"}
    with make_client(ScriptedBackend(), tmp_path) as c:
        with monkeypatch.context() as failing:
            failing.setattr(DirectoryObjects, "put_bytes", _failing)
            _unavailable(c.post("/v1/images/generations", json=body), "storing images/")
            streamed = c.post("/v1/images/generations", json={**body, "stream": True}).text
        assert '"code":"store_unavailable"' in streamed and "storing images/" in streamed, streamed
        assert c.post("/v1/images/generations", json=body).json()["data"][0]["url"]  # the store is back


def test_video_content_the_store_cannot_take_fails_the_job_as_store_unavailable_without_the_store_s_words(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """The MP4's upload failing (an S3 endpoint that does not answer) ends the job `failed` in state FAILED
    with a store_unavailable error naming what was stored and saying to retry; the exception's text (an
    internal host name, urllib3's repr) is in the head's log only, not in the job, its events or its record."""
    put_file = DirectoryObjects.put_file
    detail = "HTTPConnectionPool(host='minio.storage.svc.cluster.local', port=9000): Max retries exceeded"

    def no_mp4(self: DirectoryObjects, name: str, path: Path, content_type: str) -> None:
        if name.endswith(".mp4"):
            raise ConnectionError(detail)
        put_file(self, name, path, content_type)

    monkeypatch.setattr(DirectoryObjects, "put_file", no_mp4)
    with make_client(ScriptedBackend(), tmp_path) as c:
        job_id = c.post("/v1/videos", json=VIDEO).json()["id"]
        job = wait_for(c, job_id, "failed")
        ended = c.get(f"/v1/videos/{job_id}/events").text
    assert job["state"] == "FAILED", job
    error = job["error"]
    assert error["code"] == "store_unavailable", error
    assert f"storing the MP4 of video {job_id}" in error["message"] and "retry" in error["message"], error
    stored = ResultStore(tmp_path).load_job(job_id)
    assert stored is not None and stored.job.error == error
    for shown in (str(error), ended, str(stored.job.model_dump())):
        assert "minio" not in shown and "HTTPConnectionPool" not in shown, shown
    assert "minio.storage.svc.cluster.local" in caplog.text, "the cause is the head's log's"


def test_staging_that_fails_while_a_video_is_written_is_store_unavailable(tmp_path: Path, monkeypatch) -> None:
    """The store's staging folder full (numpy's OSError while the frames are saved): store_unavailable,
    not numpy's message with the staging path."""
    from triptych_head.api import videos

    def full(frames: Any, path: Path) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(videos, "save_frames", full)
    with make_client(ScriptedBackend(), tmp_path) as c:
        job_id = c.post("/v1/videos", json=VIDEO).json()["id"]
        job = wait_for(c, job_id, "failed")
    assert job["state"] == "FAILED" and job["error"]["code"] == "store_unavailable", job
    assert "No space" not in job["error"]["message"] and str(tmp_path) not in job["error"]["message"], job


def test_a_video_job_that_fails_unexpectedly_says_internal_error_with_its_id_and_nothing_of_the_cause(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """An exception the head did not expect (the encoder's own error) is an internal_error naming the job's
    id, whose cause the head's log has; the job ends in state FAILED, not left at DENOISING_RUNNING."""
    from triptych_head.api import videos

    def broken(*args: Any) -> None:
        raise RuntimeError("libx264 private detail /var/lib/head/staging")

    monkeypatch.setattr(videos, "write_mp4", broken)
    with make_client(ScriptedBackend(), tmp_path) as c:
        job_id = c.post("/v1/videos", json=VIDEO).json()["id"]
        job = wait_for(c, job_id, "failed")
    assert job["state"] == "FAILED", job
    assert job["error"] == {"message": f"internal error (request {job_id}); the head's log names its cause",
                            "code": "internal_error"}, job  # fmt: skip
    assert "libx264 private detail" in caplog.text
