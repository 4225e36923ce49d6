"""Results on disk: video jobs and URL images outlive the app that made them; retention removes
old ones by age and by total bytes, oldest first, never a running job's files."""

from __future__ import annotations

import os
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend, make_client, wait_for
from triptych.families import ModelInfo
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext
from triptych_head.api.schemas import VideoJob
from triptych_head.objects import DirectoryObjects
from triptych_head.results import ResultStore, Retention

VIDEO = {"prompt": "waves", "size": "32x16", "num_frames": 5, "num_inference_steps": 2}


def _file(path, nbytes: int, age_s: float) -> None:  # type: ignore[no-untyped-def]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * nbytes)
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_retention_removes_results_older_than_the_max_age_with_all_their_files(tmp_path):
    store = ResultStore(tmp_path, Retention(max_age_s=3600, max_bytes=1 << 30))
    for suffix in (".mp4", ".frames.npy", ".thumbnail.webp", ".json"):
        _file(tmp_path / "videos" / f"video_old{suffix}", 10, age_s=7200)
    _file(tmp_path / "videos" / "video_new.mp4", 10, age_s=60)
    _file(tmp_path / "images" / "img_old-0.png", 10, age_s=7200)
    assert sorted(store.sweep()) == ["img_old-0", "video_old"]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["video_new.mp4"]


def test_retention_removes_the_oldest_results_until_the_total_fits_and_keeps_running_jobs(tmp_path):
    store = ResultStore(tmp_path, Retention(max_age_s=3600, max_bytes=250))
    _file(tmp_path / "videos" / "video_running.json", 100, age_s=400)  # oldest, but still running
    for i, age in enumerate((300, 200, 100)):
        _file(tmp_path / "images" / f"img_{i}-0.png", 100, age_s=age)
    assert store.sweep(keep={"video_running"}) == ["img_0-0", "img_1-0"]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["img_2-0.png", "video_running.json"]


def test_a_finished_video_and_a_url_image_are_served_by_the_next_app_on_the_same_path(tmp_path):
    with make_client(ScriptedBackend(), tmp_path) as first:
        job = wait_for(first, first.post("/v1/videos", json=VIDEO).json()["id"], "completed")
        mp4 = first.get(f"/v1/videos/{job['id']}/content").content
        url = first.post("/v1/images/generations", json={"prompt": "c", "size": "32x32", "response_format": "url"})
        url = url.json()["data"][0]["url"]
    with make_client(ScriptedBackend(), tmp_path) as second:
        assert second.get(f"/v1/videos/{job['id']}").json() == job
        assert second.get(f"/v1/videos/{job['id']}/content").content == mp4
        assert second.get(url).content.startswith(b"\x89PNG")


def test_a_job_that_was_running_when_its_head_died_and_cannot_run_again_reports_failed_with_the_reason(tmp_path):
    store = ResultStore(tmp_path)
    running = VideoJob(id="video_x", model="tiny", status="in_progress", created_at=1, size="32x32", num_frames=5,
                       fps=16, seed=1)  # fmt: skip
    store.save_job(running)  # a head that died (SIGKILL) and kept nothing to run it again with (an older version)
    with make_client(ScriptedBackend(), tmp_path) as c:
        job = c.get("/v1/videos/video_x").json()
        assert job["status"] == "failed" and job["error"]["code"] == "head_restarted"
        assert "the head restarted while this job was running" in job["error"]["message"]
        assert c.get("/v1/videos/video_x/content").status_code == 409
    assert ResultStore(tmp_path).load_job("video_x").job.status == "failed"  # type: ignore[union-attr]  # saved, so it says so after the next restart too


def test_the_app_applies_retention_periodically_and_forgets_removed_jobs(tmp_path):
    with make_client(ScriptedBackend(), tmp_path, retention=Retention(max_age_s=0.5, max_bytes=1 << 30)) as c:
        job = wait_for(c, c.post("/v1/videos", json=VIDEO).json()["id"], "completed")
        deadline = time.monotonic() + 10
        while c.get(f"/v1/videos/{job['id']}").status_code != 404:
            assert time.monotonic() < deadline, "retention never removed the finished job"
            time.sleep(0.1)
        assert not list((tmp_path / "videos").iterdir())


def test_an_ended_job_says_when_retention_removes_it_on_every_head(tmp_path):
    slow = ScriptedBackend()
    slow.step_delay = 0.2
    day = Retention(max_age_s=86400, max_bytes=1 << 30)
    with make_client(slow, tmp_path, retention=day) as c:
        job_id = c.post("/v1/videos", json=VIDEO).json()["id"]
        assert wait_for(c, job_id, "in_progress")["expires_at"] is None  # a running job's files stay
        done = wait_for(c, job_id, "completed")
        assert done["expires_at"] == done["completed_at"] + 86400
    with make_client(ScriptedBackend(), tmp_path, retention=day) as c:  # the next head reads it from the store
        assert c.get(f"/v1/videos/{job_id}").json()["expires_at"] == done["expires_at"]
        assert c.get("/v1/videos").json()["data"][0]["expires_at"] == done["expires_at"]


class SlowJobWrites(DirectoryObjects):
    """A store whose job JSON takes a while to land, as over a network."""

    def put_bytes(self, name: str, data: bytes, content_type: str) -> None:
        if name.endswith(".json"):
            time.sleep(1.0)
        super().put_bytes(name, data, content_type)


def test_a_job_polled_while_its_last_save_is_in_flight_still_ends_saved_as_completed(tmp_path):
    # The job ends while its `in_progress` save is still being written: its last save waits for that one.
    model = ModelInfo("tiny", "WanPipeline", "video", 4, 3.5)
    store = SlowJobWrites(tmp_path)
    ctx = HeadContext(ScriptedBackend(), model, tmp_path, CollectorRegistry(), results_store=store)
    with TestClient(create_app(ctx)) as c:
        job_id = c.post("/v1/videos", json=VIDEO).json()["id"]
        seen = set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "completed" not in seen:
            seen.add(c.get(f"/v1/videos/{job_id}").json()["status"])  # reads race the final save
        assert seen <= {"queued", "in_progress", "completed"}, seen  # never read back as lost or stale
        time.sleep(3.0)  # every save has landed
        assert c.get(f"/v1/videos/{job_id}").json()["status"] == "completed"
    saved = ResultStore(tmp_path).load_job(job_id)
    assert saved is not None and saved.job.status == "completed" and saved.lease_until is None


def test_a_directory_store_never_reaches_outside_its_root(tmp_path):
    from triptych_head.objects import DirectoryObjects, ObjectMissing

    store = DirectoryObjects(tmp_path / "root")
    for name in ("/etc/passwd", "../secret", "images/../../x", ".staging/probe", "a/.hidden", "nul\x00byte"):
        with pytest.raises(ObjectMissing):
            store.get_bytes(name)


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_directory_store_creates_a_name_once_with_or_without_hard_links(tmp_path, monkeypatch, hard_links):
    if not hard_links:  # an SMB share: os.link fails, the store falls back to an exclusive open

        def no_links(src, dst):  # type: ignore[no-untyped-def]
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_links)
    store = DirectoryObjects(tmp_path)
    assert store.create("claims/a.json", b"first", "application/json")
    assert not store.create("claims/a.json", b"second", "application/json")
    assert store.get_bytes("claims/a.json") == b"first"
    assert [o.name for o in store.list("claims/a.")] == ["claims/a.json"]  # no temporary file left in sight


def test_a_directory_store_s_stat_says_missing_only_for_a_missing_file(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A stale NFS handle (EIO, ESTALE) read as "no such object" made an idempotent replay run the
    request again and remove the first run's answer."""
    import errno
    from pathlib import Path

    store = DirectoryObjects(tmp_path)
    store.put_bytes("idempotency/a.json", b"{}", "application/json")
    assert store.stat("idempotency/b.json") is None and store.stat("idempotency/a.json/x") is None
    assert store.stat("idempotency/a.json") is not None

    def stale(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ESTALE, "Stale file handle")

    monkeypatch.setattr(Path, "stat", stale)
    with pytest.raises(OSError, match="Stale file handle"):
        store.stat("idempotency/a.json")


def _send(response, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:  # type: ignore[no-untyped-def]
    """`response` sent through ASGI as a GET: (status, headers, body)."""
    import asyncio

    sent: list[dict] = []  # type: ignore[type-arg]

    async def receive() -> dict:  # type: ignore[type-arg]
        await asyncio.sleep(3600)  # no disconnect
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:  # type: ignore[type-arg]
        sent.append(message)

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "GET", "headers": raw, "http_version": "1.1"}
    asyncio.run(response(scope, receive, send))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_a_url_image_removed_by_retention_while_its_answer_is_sent_is_sent_whole_or_is_a_404(tmp_path, monkeypatch):
    """Retention (this head's thread, or another head on the shared volume) may remove a result between
    its GET's check and its body: the answer is then the whole file, or a 404; never a 500, nor a 200
    whose body never comes."""
    import asyncio

    from triptych_head.api.errors import APIError
    from triptych_head.api.files import object_response

    results = ResultStore(tmp_path, Retention(max_age_s=3600, max_bytes=1 << 30))
    name, data = "images/img_ab-0-cd.png", b"\x89PNG" + os.urandom(200_000)
    _file(tmp_path / name, 0, age_s=0)
    (tmp_path / name).write_bytes(data)
    whole = asyncio.run(object_response(results, name, "image/png"))
    ranged = asyncio.run(object_response(results, name, "image/png"))
    (tmp_path / name).unlink()  # removed after the answers were made, before they are sent
    status, headers, body = _send(whole)
    assert (status, headers["content-length"], headers["content-type"]) == (200, str(len(data)), "image/png")
    assert body == data
    status, headers, body = _send(ranged, {"Range": "bytes=10-19"})
    assert (status, body) == (206, data[10:20])

    (tmp_path / name).write_bytes(data)
    stat = results.objects.stat

    def stat_then_removed(what: str):  # type: ignore[no-untyped-def]
        found = stat(what)
        (tmp_path / name).unlink()
        return found

    monkeypatch.setattr(results.objects, "stat", stat_then_removed)
    with pytest.raises(APIError) as refused:
        asyncio.run(object_response(results, name, "image/png"))
    assert refused.value.status_code == 404


def test_an_encode_that_fails_midway_leaves_no_part_of_its_mp4(tmp_path, monkeypatch):
    import av
    import numpy as np

    from triptych_head.media import write_mp4

    made = av.VideoFrame.from_ndarray
    calls = []

    def full_disk_at_frame_50(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 50:
            raise OSError(28, "No space left on device")
        return made(*args, **kwargs)

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", full_disk_at_frame_50)
    with pytest.raises(OSError, match="No space"):
        write_mp4(np.zeros((60, 64, 64, 3), dtype=np.uint8), tmp_path / "v.mp4", 16, 1)
    assert list(tmp_path.iterdir()) == []


def test_retention_removes_what_writes_cut_short_left_behind_once_an_hour_old(tmp_path):
    """A head killed mid-encode leaves its staging files, and a write cut short its temporary file
    beside the result: no result's, so never listed; retention removes them once nobody writes them."""
    store = ResultStore(tmp_path, Retention(max_age_s=86400, max_bytes=1 << 30))
    left = [tmp_path / ".staging" / "video_a-1.part.mp4", tmp_path / "images" / ".img_b-0.png.1f.tmp"]
    live = [tmp_path / ".staging" / "video_c-2.npy", tmp_path / "videos" / ".video_d.json.2e.tmp"]
    kept = [tmp_path / "images" / "img_e-0.png", tmp_path / "images" / ".img_f-0.png"]  # a result; not a .tmp
    for path in left + kept:
        _file(path, 1000, age_s=2 * 3600)
    for path in live:
        _file(path, 1000, age_s=60)  # a write under way
    assert store.sweep() == []
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == sorted(live + kept)


def test_retention_goes_on_past_a_folder_it_cannot_read_and_a_leftover_it_cannot_remove(tmp_path, monkeypatch):
    """A volume mounted as the store's root holds a lost+found this head may not read; and a leftover
    may be another user's: neither stops retention of the results (it used to stop every sweep)."""
    import triptych_head.objects as objects

    store = ResultStore(tmp_path, Retention(max_age_s=3600, max_bytes=1 << 30))
    _file(tmp_path / "images" / "img_old-0.png", 10, age_s=7200)
    _file(tmp_path / "images" / ".img_x-0.png.3a.tmp", 10, age_s=7200)
    (tmp_path / "lost+found").mkdir()
    scandir, unlink = os.scandir, os.unlink

    def guarded_scandir(path):  # type: ignore[no-untyped-def]
        if str(path).endswith("lost+found"):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    def guarded_unlink(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).endswith(".tmp"):
            raise PermissionError(1, "Operation not permitted", str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(objects.os, "scandir", guarded_scandir)
    monkeypatch.setattr(objects.os, "unlink", guarded_unlink)
    assert store.sweep() == ["img_old-0"]
    monkeypatch.setattr(DirectoryObjects, "remove_leftovers", lambda self, before: 1 / 0)
    _file(tmp_path / "images" / "img_older-0.png", 10, age_s=7200)
    assert store.sweep() == ["img_older-0"]
