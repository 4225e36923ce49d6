"""A video job outlives its head: one left running by a head that died or shut down is taken over
by another head (or the next one on the same store), run again from the start with the same
parameters and seed, and its events end with its completion wherever the client reconnects."""

from __future__ import annotations

import json
import threading
import time

import msgspec
import pytest

from tests.api.test_http_api import ScriptedBackend, make_client, wait_for
from triptych.params import GenerationParams
from triptych_head.api.schemas import VideoJob
from triptych_head.results import ResultStore
from triptych_head.sightings import CLOCK_SKEW_S

VIDEO = {"prompt": "waves", "size": "32x16", "num_frames": 5, "num_inference_steps": 4, "seed": 7}


def _orphan(store: ResultStore, job_id: str = "video_orphan", lease_until: float | None = None) -> GenerationParams:
    """What a head that died mid-job (SIGKILL) leaves in the shared store: the job, running, with the
    parameters to run it again, a lease that ran out long ago (beyond any clocks' difference: a head
    takes it over at first sight, sightings.py), and its entry among the running jobs."""
    params = GenerationParams(prompt="waves", width=32, height=16, num_frames=5, num_inference_steps=4, seed=7)
    job = VideoJob(id=job_id, model="tiny", status="in_progress", state="DENOISING_RUNNING", step=2, total_steps=4,
                   created_at=int(time.time()), size="32x16", num_frames=5, fps=16, seed=7)  # fmt: skip
    run = {"params": json.loads(msgspec.json.encode(params)), "preview_every": 0}
    store.save_job(job, lease_until if lease_until is not None else time.time() - 2 * CLOCK_SKEW_S, run)
    store.mark_running(job_id)
    return params


def test_a_job_still_running_when_its_head_shuts_down_is_run_again_by_the_next_head(tmp_path):
    slow = ScriptedBackend()
    slow.step_delay = 1.0
    with make_client(slow, tmp_path) as first:
        job_id = first.post("/v1/videos", json={**VIDEO, "num_inference_steps": 100}).json()["id"]
    saved = ResultStore(tmp_path).load_job(job_id)
    assert saved is not None and saved.job.status in ("queued", "in_progress"), saved  # left running, not failed
    assert saved.lease_until is None and saved.run is not None  # no head holds it; the next can run it

    fresh = ScriptedBackend()
    with make_client(fresh, tmp_path) as second:
        job = wait_for(second, job_id, "completed")
        assert job["restarts"] == 1 and job["error"] is None
        assert second.get(f"/v1/videos/{job_id}/content").content.startswith(b"\x00\x00\x00")  # an MP4
    assert [p.seed for p in fresh.calls] == [slow.calls[0].seed]  # the same request, seed included
    assert fresh.calls[0] == slow.calls[0]
    assert ResultStore(tmp_path).running_jobs() == []


def test_a_job_whose_head_died_is_taken_over_and_its_events_end_with_its_completion(tmp_path):
    params = _orphan(ResultStore(tmp_path))
    backend = ScriptedBackend()
    backend.step_delay = 0.05
    with make_client(backend, tmp_path) as c:
        with c.stream("GET", "/v1/videos/video_orphan/events") as events:
            text = "".join(events.iter_text())
        assert "event: completed" in text, text
        job = c.get("/v1/videos/video_orphan").json()
        assert job["status"] == "completed" and job["restarts"] == 1
        assert "triptych_video_job_takeovers_total 1.0" in c.get("/metrics").text
    assert backend.calls == [params]


def test_a_job_whose_lease_is_live_stays_its_head_s(tmp_path):
    _orphan(ResultStore(tmp_path), lease_until=time.time() + 60)  # its head is alive, just not this one
    backend = ScriptedBackend()
    with make_client(backend, tmp_path) as c:
        time.sleep(0.5)
        job = c.get("/v1/videos/video_orphan").json()
        assert job["status"] == "in_progress" and job["restarts"] == 0
    assert backend.calls == []


def test_a_draining_head_takes_over_no_orphan(tmp_path):
    """A head that drains would only hand an adopted job over again (run again from the start by the
    next head, and its drain held up): neither its scan nor a GET takes an orphan over."""
    backend = ScriptedBackend()
    with make_client(backend, tmp_path) as c:
        c.app.state.ctx.draining = True
        _orphan(ResultStore(tmp_path))
        c.portal.call(c.app.state.video_jobs.take_over_orphans)  # type: ignore[union-attr]
        job = c.get("/v1/videos/video_orphan").json()
        assert job["status"] == "in_progress" and job["restarts"] == 0
    assert backend.calls == []


def _handed_over_at_the_drain(store: ResultStore, job_id: str) -> None:
    """Wait for a draining head's hand-over of `job_id`: saved running, without a lease."""
    deadline = time.monotonic() + 10
    while not ((s := store.load_job(job_id)) and s.lease_until is None and s.job.status == "in_progress"):
        assert time.monotonic() < deadline, "the draining head never handed the job over"
        time.sleep(0.05)


def _shows_restarts(client, job_id: str, restarts: int) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 10
    while (shown := client.get(f"/v1/videos/{job_id}").json()["restarts"]) != restarts:
        assert time.monotonic() < deadline, f"the job shows {shown} restarts, not {restarts}"
        time.sleep(0.05)


def _draining_head_running(tmp_path):  # type: ignore[no-untyped-def]
    """A head whose drain ends while it runs a video job: its DiffusionServer fails it with a 503."""
    from triptych_head.backend import GenerationFailed

    backend = ScriptedBackend()
    backend.step_delay = 0.05
    backend.fail = GenerationFailed("the head shut down before this request finished; retry it", 503)
    return backend


def test_a_job_handed_over_at_the_drain_is_not_saved_again_at_the_head_s_exit(tmp_path):
    """The head's exit saved its stale copy (running, restarts 0) over the record of the head that had
    taken the job over and completed it: it showed in_progress everywhere, for good."""
    store = ResultStore(tmp_path)
    with make_client(_draining_head_running(tmp_path), tmp_path) as a:
        job_id = a.post("/v1/videos", json={**VIDEO, "num_inference_steps": 10}).json()["id"]
        a.app.state.ctx.draining = True
        _handed_over_at_the_drain(store, job_id)
        with make_client(ScriptedBackend(), tmp_path) as b:
            assert wait_for(b, job_id, "completed")["restarts"] == 1
    saved = store.load_job(job_id)  # head A has exited
    assert saved is not None and saved.job.status == "completed" and saved.job.restarts == 1


def test_a_delete_through_the_head_that_handed_a_job_over_is_a_409_and_the_job_ends_once(tmp_path):
    """A DELETE on the draining head cancelled, there, a job another head ran: one job, two ends
    (cancelled and completed), two webhook events."""
    store, ends = ResultStore(tmp_path), []
    with make_client(_draining_head_running(tmp_path), tmp_path) as a:
        a.app.state.video_jobs.on_end = lambda job: ends.append(("a", job["status"]))
        job_id = a.post("/v1/videos", json={**VIDEO, "num_inference_steps": 10}).json()["id"]
        a.app.state.ctx.draining = True
        _handed_over_at_the_drain(store, job_id)
        slow = ScriptedBackend()
        slow.step_delay = 0.2
        with make_client(slow, tmp_path) as b:
            b.app.state.video_jobs.on_end = lambda job: ends.append(("b", job["status"]))
            _shows_restarts(b, job_id, 1)  # b takes it over
            refused = a.delete(f"/v1/videos/{job_id}")
            assert refused.status_code == 409 and "runs on another head" in refused.json()["error"]["message"]
            _shows_restarts(a, job_id, 1)  # a reads the store (b's save of its take-over), not its own copy
            wait_for(b, job_id, "completed")
    assert ends == [("b", "completed")]


def test_of_two_heads_that_find_one_orphan_at_once_exactly_one_runs_it(tmp_path):
    for i in range(5):
        _orphan(ResultStore(tmp_path), f"video_orphan{i}")
    backends = [ScriptedBackend(), ScriptedBackend()]
    started = threading.Barrier(2)
    done = []

    def head(backend: ScriptedBackend) -> None:
        with make_client(backend, tmp_path) as c:  # each looks for orphans as it starts
            started.wait(10)
            for i in range(5):
                c.get(f"/v1/videos/video_orphan{i}")  # and when asked for one
            for i in range(5):
                done.append(wait_for(c, f"video_orphan{i}", "completed")["restarts"])

    threads = [threading.Thread(target=head, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(done) == 10 and set(done) == {1}, done
    assert len(backends[0].calls) + len(backends[1].calls) == 5  # each job ran again exactly once


def test_a_job_taken_over_counts_against_its_key_and_is_charged_its_device_seconds(tmp_path):
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from tests.api.test_http_api import validate
    from triptych.families import ModelInfo
    from triptych_head.api.app import create_app
    from triptych_head.api.auth import APIKeys
    from triptych_head.api.context import HeadContext

    (tmp_path / "keys").write_text("sk-gpu max_device_seconds_per_day=1\n")
    gpu = {"Authorization": "Bearer sk-gpu"}

    def head(backend: ScriptedBackend) -> TestClient:
        model = ModelInfo("tiny", "WanPipeline", "video", 4, 3.5)
        ctx = HeadContext(backend, model, tmp_path, CollectorRegistry(), validate=validate,
                          api_keys=APIKeys(tmp_path / "keys"))  # fmt: skip
        return TestClient(create_app(ctx))

    slow = ScriptedBackend()
    slow.step_delay = 1.0
    with head(slow) as first:
        job_id = first.post("/v1/videos", json={**VIDEO, "num_inference_steps": 100}, headers=gpu).json()["id"]
    saved = ResultStore(tmp_path).load_job(job_id)
    assert saved is not None and saved.run is not None and len(saved.run["key_id"]) == 16  # a digest, not the key
    assert "sk-gpu" not in (tmp_path / "videos" / f"{job_id}.json").read_text()

    fresh = ScriptedBackend()
    fresh.device_seconds = 1.5  # past the key's quota: the take-over still runs (its key was admitted once)
    with head(fresh) as second:
        job = wait_for(second, job_id, "completed", headers=gpu)
        assert job["restarts"] == 1
        (day,) = second.get("/v1/usage", headers=gpu).json()["device_seconds"]
        assert (day["period"], day["limit"], day["used"]) == ("day", 1, 1.5)
        refused = second.post("/v1/videos", json=VIDEO, headers=gpu)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "key_quota_exceeded"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"params": {"shift": 3.0}}, "shift"),
        ({"priority": None}, "priority"),
        ({"preview_every": "x"}, "preview_every"),
    ],
)
def test_an_orphan_whose_saved_run_this_head_cannot_read_ends_failed_and_the_others_run(tmp_path, change, named):
    """A job saved by another version of Triptych (a field this head does not know) cannot run here: it
    ends failed, saying why, instead of being claimed and left in progress for ever; the scan goes on to
    the next orphan."""
    store = ResultStore(tmp_path)
    params = _orphan(store, "video_plain")
    _orphan(store, "video_newer")
    saved = store.load_job("video_newer")
    assert saved is not None and saved.run is not None
    run = {**saved.run, **change}
    if "params" in change:
        run["params"] = {**saved.run["params"], **change["params"]}
    store.save_job(saved.job, time.time() - 2 * CLOCK_SKEW_S, run)
    backend = ScriptedBackend()
    with make_client(backend, tmp_path) as c:
        c.portal.call(c.app.state.video_jobs.take_over_orphans)  # type: ignore[union-attr]
        job = c.get("/v1/videos/video_newer").json()
        assert job["status"] == "failed" and job["error"]["code"] == "unreadable_job", job
        assert named in job["error"]["message"] and "submit it again" in job["error"]["message"]
        assert wait_for(c, "video_plain", "completed")["restarts"] == 1
    assert backend.calls == [params]
    assert store.load_job("video_newer").job.status == "failed"  # type: ignore[union-attr]


def test_a_head_whose_lease_lapsed_stops_its_run_once_another_head_took_the_job_over(tmp_path, monkeypatch):
    """The store out of reach longer than a lease: another head adopted the job, and the first, never
    told, ran on; its next save overwrote the adopter's record and both heads ended the job."""
    import asyncio

    import triptych_head.api.video_jobs as video_jobs
    from triptych_head.objects import DirectoryObjects

    monkeypatch.setattr(video_jobs, "JOB_LEASE_S", 1.0)
    started: list[str] = []

    async def scenario() -> None:
        first = video_jobs.VideoJobs(ResultStore(DirectoryObjects(tmp_path)), start=lambda entry: None)
        other = video_jobs.VideoJobs(ResultStore(DirectoryObjects(tmp_path)), start=lambda e: started.append(e.job.id))
        params = GenerationParams(prompt="waves", width=32, height=16, num_frames=5, num_inference_steps=4, seed=7)
        job = VideoJob(id="video_live", model="tiny", status="in_progress", created_at=int(time.time()),
                       size="32x16", num_frames=5, fps=16, seed=7)  # fmt: skip
        entry = video_jobs.JobEntry(job, made_here=True, params=params)
        entry.task = asyncio.create_task(asyncio.sleep(60))  # its run
        follower = entry.progress_feed().subscribe()  # a client following its events on this head
        await first.add(entry)
        await other.take_over_orphans()  # it sees the job's record as its head saved it: not an orphan
        assert started == []
        put = first.store.objects.put_bytes

        def unreachable(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise OSError("the store does not answer")

        first.store.objects.put_bytes = unreachable  # type: ignore[method-assign]
        await asyncio.sleep(1.5)  # its renewals fail past its lease
        await first.renew_leases()
        first.store.objects.put_bytes = put  # type: ignore[method-assign]
        await other.take_over_orphans()
        assert started == ["video_live"]
        load = first.store.load_job
        first.store.load_job = unreachable  # type: ignore[method-assign]
        await first.renew_leases()  # it cannot tell whether the job is still its own: it writes nothing
        assert load("video_live").job.restarts == 1 and not entry.taken  # type: ignore[union-attr]
        first.store.load_job = load  # type: ignore[method-assign]
        await first.renew_leases()  # finds the job taken over: stops its run, writes nothing
        await asyncio.sleep(0)
        assert entry.taken and entry.task.cancelled() and not entry.running_here

        async def followed() -> list[bytes]:
            return [chunk async for chunk in follower.messages("video_live")]

        assert await asyncio.wait_for(followed(), 5) == []  # its stream ends (it reconnects), with no end event
        entry.job.status = "completed"
        await first.save_async(entry)
        saved = first.store.load_job("video_live")
        assert saved is not None and saved.job.restarts == 1 and saved.job.status != "completed"

    asyncio.run(scenario())


def test_a_head_whose_clock_runs_ahead_takes_over_no_job_whose_head_renews_it(tmp_path, monkeypatch):
    """Head B's clock ran 25 s ahead of head A's: it read A's lease, renewed 10 s before, as run out
    and ran A's live job again from the start (A then stopped its own run)."""
    import types

    import triptych_head.api.video_jobs as video_jobs
    import triptych_head.sightings as sightings

    _orphan(ResultStore(tmp_path), lease_until=time.time() + 20)  # head A, alive, renewed it 10 s ago
    ahead = types.SimpleNamespace(time=lambda: time.time() + 25, monotonic=time.monotonic)
    monkeypatch.setattr(video_jobs, "time", ahead)  # head B's clock
    monkeypatch.setattr(sightings, "time", ahead)
    backend = ScriptedBackend()
    with make_client(backend, tmp_path) as b:
        c = b.app.state.video_jobs
        b.portal.call(c.take_over_orphans)
        job = b.get("/v1/videos/video_orphan").json()
        assert job["status"] == "in_progress" and job["restarts"] == 0
    assert backend.calls == []


def test_a_job_whose_head_died_moments_ago_is_taken_over_once_its_record_stood_unchanged_for_a_lease(tmp_path):
    import asyncio

    from tests.api.test_key_quotas import Clock
    from triptych_head.api.video_jobs import VideoJobs
    from triptych_head.results import JOB_LEASE_S
    from triptych_head.sightings import Sightings

    _orphan(ResultStore(tmp_path), lease_until=time.time() - 1)  # its head died a moment ago
    clock, started = Clock(100.0), []
    jobs = VideoJobs(ResultStore(tmp_path), start=started.append, sightings=Sightings(clock))
    asyncio.run(jobs.take_over_orphans())
    clock.now += JOB_LEASE_S - 1
    asyncio.run(jobs.take_over_orphans())
    assert started == []  # as far as this head can tell, its head may be renewing it
    clock.now += 1
    asyncio.run(jobs.take_over_orphans())
    assert [e.job.id for e in started] == ["video_orphan"]  # type: ignore[attr-defined]


def test_a_head_resumed_from_a_suspend_reads_the_store_before_it_saves_a_job_it_may_have_lost(tmp_path, monkeypatch):
    """A suspended VM's monotonic clock stands still: by it alone, the head resumed thought its lease
    fresh, saved blind over the record of the head that took its job over meanwhile, and ran on."""
    import asyncio
    import types

    import triptych_head.api.video_jobs as video_jobs
    from triptych_head.objects import DirectoryObjects

    async def scenario() -> tuple[video_jobs.JobEntry, ResultStore]:
        head = video_jobs.VideoJobs(ResultStore(DirectoryObjects(tmp_path)), start=lambda entry: None)
        params = GenerationParams(prompt="waves", width=32, height=16, num_frames=5, num_inference_steps=4, seed=7)
        job = VideoJob(id="video_live", model="tiny", status="in_progress", created_at=int(time.time()),
                       size="32x16", num_frames=5, fps=16, seed=7)  # fmt: skip
        entry = video_jobs.JobEntry(job, made_here=True, params=params)
        entry.task = asyncio.create_task(asyncio.sleep(60))  # its run
        await head.add(entry)
        store = ResultStore(DirectoryObjects(tmp_path))
        adopted = store.load_job("video_live")
        assert adopted is not None
        store.save_job(adopted.job.model_copy(update={"restarts": 1}), time.time() + 30, adopted.run)  # taken over
        frozen = time.monotonic()  # suspended from here: resumed a minute later by the wall clock
        monkeypatch.setattr(video_jobs, "time", types.SimpleNamespace(monotonic=lambda: frozen,
                                                                      time=lambda: time.time() + 60))  # fmt: skip
        entry.job.step = 3
        await head.save_async(entry)
        return entry, store

    entry, store = asyncio.run(scenario())
    assert entry.taken
    saved = store.load_job("video_live")
    assert saved is not None and saved.job.restarts == 1
