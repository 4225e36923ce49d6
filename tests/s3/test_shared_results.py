"""Results any head can serve: two heads over one result store, a directory (a ReadWriteMany volume)
or an S3 bucket on a real S3-compatible server (SeaweedFS, tests/s3/seaweedfs.py).

A video job made through head A is read through head B (its status as A last wrote it, then its
content); a URL image made by A is fetched through B; retention run by either head removes a
result for both and never a job another head is running; a webhook event one head handed over is
delivered by the other; a bad store stops the head at start-up with one line naming the flag.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend, validate, wait_for
from tests.api.test_large_bodies import noise
from tests.api.test_takeover import _orphan
from tests.e2e.harness import deployment
from tests.folders import head_folder
from tests.s3.seaweedfs import S3Server
from tests.webhook_receiver import verified, webhook_receiver
from triptych.families import ModelInfo
from triptych_head.api.app import create_app
from triptych_head.api.auth import APIKeys, parse_entries
from triptych_head.api.context import HeadContext
from triptych_head.api.key_quotas import PERIODS
from triptych_head.api.schemas import VideoJob
from triptych_head.backend import GenerationOutput
from triptych_head.objects import DirectoryObjects, ObjectStore, S3Location, S3Objects, StoreError
from triptych_head.results import ResultStore, Retention
from triptych_head.sightings import CLOCK_SKEW_S
from triptych_head.store_owner import MARKER, claim_store
from triptych_head.webhook_outbox import Outbox
from triptych_head.webhooks import Webhooks, WebhookTarget

VIDEO = {"prompt": "waves", "size": "32x16", "num_frames": 5, "num_inference_steps": 2}
IMAGE = {"prompt": "a cat", "size": "32x32", "response_format": "url"}
MODEL = ModelInfo("tiny", "WanPipeline", "video", 4, 3.5)


@pytest.fixture(params=["directory", "s3"])
def shared_store(request, tmp_path) -> ObjectStore:  # type: ignore[no-untyped-def]
    """What each head opens: the same folder, or the same bucket and prefix."""
    if request.param == "directory":
        return DirectoryObjects(tmp_path / "results")
    server: S3Server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return S3Objects(S3Location.parse(f"s3://{bucket}/{request.node.name}"), server.endpoint)


def open_store(store: ObjectStore) -> ObjectStore:
    """A second head's own client of the same store (nothing shared in memory)."""
    if isinstance(store, DirectoryObjects):
        return DirectoryObjects(store.root)
    assert isinstance(store, S3Objects)
    return S3Objects(store.location, store.endpoint)


@contextmanager
def head(
    store: ObjectStore,
    backend: ScriptedBackend | None = None,
    retention: Retention | None = None,
    presign: int = 0,
    api_keys: Path | None = None,
) -> Iterator[TestClient]:
    with head_folder("triptych-s3-head-") as folder:  # unused beside the store, but its own
        ctx = HeadContext(
            backend=backend or ScriptedBackend(), model=MODEL, output_path=folder,
            registry=CollectorRegistry(), validate=validate, retention=retention or Retention(),
            results_store=open_store(store), results_presign_s=presign,
            api_keys=APIKeys(api_keys) if api_keys else None,
        )  # fmt: skip
        with TestClient(create_app(ctx)) as client:
            yield client


def test_a_video_job_made_through_one_head_is_followed_and_fetched_through_the_other(shared_store):
    slow = ScriptedBackend()
    slow.step_delay = 0.5
    with head(shared_store, slow) as a, head(shared_store) as b:
        job_id = a.post("/v1/videos", json={**VIDEO, "num_inference_steps": 6}).json()["id"]
        deadline = time.monotonic() + 10
        while (seen := b.get(f"/v1/videos/{job_id}")).json().get("status") != "in_progress":
            assert time.monotonic() < deadline, f"head B never saw the job running: {seen.text}"
            time.sleep(0.05)
        assert b.get(f"/v1/videos/{job_id}/content").status_code == 409  # not ready: as A would say
        refused = b.delete(f"/v1/videos/{job_id}")  # A alone can cancel it: a client retries, maybe reaching A
        assert refused.status_code == 409 and refused.headers["retry-after"] == "1", refused.text
        done = wait_for(a, job_id, "completed", timeout=60)
        assert wait_for(b, job_id, "completed", timeout=60) == done
        mp4 = a.get(f"/v1/videos/{job_id}/content")
        through_b = b.get(f"/v1/videos/{job_id}/content")
        assert through_b.status_code == 200 and through_b.headers["content-type"] == "video/mp4"
        assert through_b.content == mp4.content and mp4.content[4:8] == b"ftyp"
        frames = b.get(f"/v1/videos/{job_id}/content", params={"variant": "frames"})
        assert frames.content == a.get(f"/v1/videos/{job_id}/content", params={"variant": "frames"}).content
        events = b.get(f"/v1/videos/{job_id}/events").text
        assert "event: completed" in events and job_id in events


def _listed(client: TestClient) -> dict[str, str]:
    return {job["id"]: job["status"] for job in client.get("/v1/videos").json()["data"]}


def test_every_head_lists_every_head_s_video_jobs_as_they_change(shared_store):
    slow = ScriptedBackend()
    slow.step_delay = 0.3
    with head(shared_store, slow) as a, head(shared_store) as b:
        assert _listed(b) == {}  # read once: the listing below must see the store change under it
        running = a.post("/v1/videos", json={**VIDEO, "num_inference_steps": 8}).json()["id"]
        quick = wait_for(b, b.post("/v1/videos", json=VIDEO).json()["id"], "completed", timeout=60)["id"]
        assert _listed(a)[quick] == "completed" and _listed(b)[running] in ("queued", "in_progress")
        wait_for(a, running, "completed", timeout=60)
        deadline = time.monotonic() + 10
        while _listed(b)[running] != "completed":  # B's listing reads the job's JSON again once it changed
            assert time.monotonic() < deadline, _listed(b)
            time.sleep(0.05)
        assert a.delete(f"/v1/videos/{quick}").status_code == 200
        assert _listed(a) == _listed(b) == {running: "completed"}


def test_events_of_a_job_another_head_runs_end_with_its_completion(shared_store):
    slow = ScriptedBackend()
    slow.step_delay = 0.3
    with head(shared_store, slow) as a, head(shared_store) as b:
        job_id = a.post("/v1/videos", json={**VIDEO, "num_inference_steps": 8}).json()["id"]
        wait_for(b, job_id, "in_progress", timeout=60)
        stream = b.get(f"/v1/videos/{job_id}/events").text  # ends when the job does
    messages = [m for m in stream.split("\n\n") if m.startswith("event:")]
    assert messages[0].startswith("event: step") or messages[0].startswith("event: state"), stream
    assert messages[-1].startswith("event: completed"), stream
    assert json.loads(messages[-1].split("data: ", 1)[1])["status"] == "completed"


def test_a_url_image_made_by_one_head_is_served_by_the_other(shared_store):
    with head(shared_store) as a, head(shared_store) as b:
        url = a.post("/v1/images/generations", json=IMAGE).json()["data"][0]["url"]
        r = b.get(url)
        assert r.status_code == 200 and r.content.startswith(b"\x89PNG") and r.headers["content-type"] == "image/png"
        assert b.get(url.replace(".png", "x.png")).status_code == 404


def test_retention_on_either_head_removes_a_result_for_both_but_never_a_job_another_head_runs(shared_store):
    slow = ScriptedBackend()
    slow.step_delay = 0.5
    short = Retention(max_age_s=1.0, max_bytes=1 << 30)
    with head(shared_store, slow) as a:
        finished = a.post("/v1/videos", json=VIDEO).json()["id"]
        wait_for(a, finished, "completed", timeout=60)
        url = a.post("/v1/images/generations", json=IMAGE).json()["data"][0]["url"]
        running = a.post("/v1/videos", json={**VIDEO, "num_inference_steps": 40}).json()["id"]
        time.sleep(2.5)  # the finished results are past B's max age; the running job's JSON is too
        with head(shared_store, retention=short) as b:  # B sweeps at start and every 0.5 s
            deadline = time.monotonic() + 10
            while a.get(f"/v1/videos/{finished}").status_code != 404 or a.get(url).status_code != 404:
                assert time.monotonic() < deadline, "B's retention never removed A's finished results"
                time.sleep(0.1)
            assert b.get(f"/v1/videos/{finished}").status_code == 404
            time.sleep(1.5)  # more sweeps by B while A's job runs on
            assert b.get(f"/v1/videos/{running}").json()["status"] == "in_progress"
            assert a.get(f"/v1/videos/{running}").json()["status"] == "in_progress"


def test_a_running_job_whose_head_died_with_nothing_to_run_it_again_reads_failed_on_any_head(shared_store):
    job = VideoJob(id="video_lost", model="tiny", status="in_progress", created_at=1, size="32x16", num_frames=5,
                   fps=16, seed=1)  # fmt: skip
    store = ResultStore(open_store(shared_store))
    # Its head died long ago (a lease past any clocks' difference: taken at first sight, sightings.py; a
    # lease still live is left alone: tests/api/test_takeover.py), and kept no parameters.
    store.save_job(job, lease_until=time.time() - 2 * CLOCK_SKEW_S)
    with head(shared_store) as b:
        lost = b.get("/v1/videos/video_lost").json()
    assert lost["status"] == "failed" and lost["error"]["code"] == "head_restarted"
    saved = store.load_job("video_lost")
    assert saved is not None and saved.job.status == "failed"  # saved: every other head reads it too


def test_presigned_urls_let_clients_fetch_images_and_videos_from_the_bucket_itself(s3_server, s3_bucket):
    store = S3Objects(S3Location.parse(f"s3://{s3_bucket}/presigned-{uuid.uuid4().hex}"), s3_server.endpoint)
    with head(store, presign=300) as a, head(store, presign=300) as b:
        url = a.post("/v1/images/generations", json=IMAGE).json()["data"][0]["url"]
        assert url.startswith(f"{s3_server.endpoint}/{s3_bucket}/presigned-") and "X-Amz-Signature" in url
        png = httpx.get(url)
        assert png.status_code == 200 and png.content.startswith(b"\x89PNG")
        job_id = a.post("/v1/videos", json=VIDEO).json()["id"]
        wait_for(b, job_id, "completed", timeout=60)
        redirect = b.get(f"/v1/videos/{job_id}/content", follow_redirects=False)
        assert redirect.status_code == 307 and redirect.headers["location"].startswith(s3_server.endpoint)
        mp4 = httpx.get(redirect.headers["location"])
        assert mp4.status_code == 200 and mp4.content[4:8] == b"ftyp"
        assert mp4.headers["content-type"] == "video/mp4"
    unsigned = httpx.get(url.split("?", 1)[0])
    assert unsigned.status_code == 403  # the bucket is private: only a signed URL reads it


def test_a_running_job_whose_head_died_is_run_again_by_another_head_exactly_once(shared_store):
    store = ResultStore(open_store(shared_store))
    params = _orphan(store)  # its head died long ago: taken at first sight
    backends = [ScriptedBackend(), ScriptedBackend()]
    with head(shared_store, backends[0]) as a, head(shared_store, backends[1]) as b:
        for c in (a, b):  # both notice the orphan; one runs it, the other follows it
            c.get("/v1/videos/video_orphan")
        done = [wait_for(c, "video_orphan", "completed", timeout=60) for c in (a, b)]
    assert [job["restarts"] for job in done] == [1, 1]
    assert backends[0].calls + backends[1].calls == [params]  # the same request, run once more
    assert store.running_jobs() == []


def _contend(store: ObjectStore, name: str, me: int, barrier: threading.Barrier) -> bool:
    """One head creating `name` as Idempotency does: try, and after a loss try again until it exists."""
    barrier.wait(10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if store.create(name, str(me).encode(), "application/json"):
            return True
        if store.stat(name) is not None:
            return False
        time.sleep(random.uniform(0.01, 0.1))  # we withdrew together with a rival (S3): again, later
    raise AssertionError(f"nobody created {name} in 30 s")


def test_create_lets_exactly_one_of_many_contenders_write_a_name(shared_store):
    stores = [open_store(shared_store) for _ in range(6)]
    for _round in range(3):
        name, barrier = f"claims/race-{uuid.uuid4().hex}.json", threading.Barrier(len(stores))
        with concurrent.futures.ThreadPoolExecutor(len(stores)) as pool:
            won = list(pool.map(_contend, stores, [name] * len(stores), range(len(stores)), [barrier] * len(stores)))
        assert sum(won) == 1, won
        assert stores[0].get_bytes(name) == str(won.index(True)).encode()  # the winner's, never overwritten
        assert list(stores[0].list(f"{name}.claim-")) == []  # no claim left behind, the winner's included
        assert not stores[1].create(name, b"late", "application/json")


def _beside(store: ObjectStore, name: str) -> ObjectStore:
    """A store of its own next to `store` (a subfolder, or a longer prefix): a fresh one per round."""
    if isinstance(store, DirectoryObjects):
        return DirectoryObjects(store.root / name)
    assert isinstance(store, S3Objects)
    return S3Objects(S3Location.parse(f"s3://{store.location.bucket}/{store.location.prefix}{name}"), store.endpoint)


def _start_head(store: ObjectStore, barrier: threading.Barrier) -> None:
    barrier.wait(10)
    claim_store(store, "ml/flux", wait_s=60)


def test_heads_of_one_pipeline_starting_together_all_start_on_the_store_they_mark(shared_store):
    """On a bucket, heads that met claiming the marker all withdrew, and each refused to start: the
    default two heads of a new pipeline did, most times."""
    for _round in range(3):
        base = _beside(shared_store, f"round-{uuid.uuid4().hex}")
        stores, barrier = [open_store(base) for _ in range(6)], threading.Barrier(6)
        with concurrent.futures.ThreadPoolExecutor(len(stores)) as pool:
            list(pool.map(_start_head, stores, [barrier] * len(stores)))  # raises on any head's refusal
        assert json.loads(base.get_bytes(MARKER)) == {"pipeline": "ml/flux"}
        assert list(base.list(f"{MARKER}.claim-")) == []
        with pytest.raises(StoreError, match="holds the results of pipeline 'ml/flux'"):
            claim_store(open_store(base), "ml/wan", wait_s=5)


def test_a_contender_slower_than_a_third_of_the_stale_age_withdraws(s3_server, s3_bucket, monkeypatch):  # type: ignore[no-untyped-def]
    """A contender whose claim took long to check (a stalled connection, retried) wrote the object after
    a rival had taken its claim for a dead head's: both won. It withdraws now, and leaves no claim."""
    import triptych_head.objects as objects

    store = S3Objects(S3Location.parse(f"s3://{s3_bucket}/slow-{uuid.uuid4().hex}"), s3_server.endpoint)
    now = [1000.0]

    def slow_clock() -> float:
        now[0] += objects.CLAIM_STALE_S / 2  # from the claim to the checks' end: half the stale age
        return now[0]

    monkeypatch.setattr(objects, "monotonic", slow_clock)
    assert not store.create("claims/slow.json", b"late", "application/json")
    assert store.stat("claims/slow.json") is None and list(store.list("claims/slow.json.claim-")) == []
    monkeypatch.undo()
    assert store.create("claims/slow.json", b"on time", "application/json")
    assert store.get_bytes("claims/slow.json") == b"on time"


def test_an_idempotency_key_retried_through_either_head_runs_once(shared_store):
    backends = [ScriptedBackend(), ScriptedBackend()]
    for backend in backends:
        backend.step_delay = 0.1
    body = {"prompt": "a cat", "size": "32x32"}
    headers = {"Idempotency-Key": f"retry-{uuid.uuid4().hex}"}
    with head(shared_store, backends[0]) as a, head(shared_store, backends[1]) as b:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            post = lambda c: c.post("/v1/images/generations", json=body, headers=headers)  # noqa: E731
            answers = list(pool.map(post, [a, b, a, b]))
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert len({r.content for r in answers}) == 1
    assert len(backends[0].calls) + len(backends[1].calls) == 1


def test_a_key_s_monthly_quota_is_counted_by_every_head_together_and_outlives_them(shared_store, tmp_path):
    """`max_per_month=3` behind two heads: 3 admitted in all, whichever head takes them; the 4th is a
    429 naming the quota with the seconds until the month ends; a head started later refuses at once."""
    keys = tmp_path / "keys"
    keys.write_text("sk-metered max_per_month=3\nsk-open\n")
    (metered,) = [e.limit for e in parse_entries(keys.read_text()) if e.limit]
    month = PERIODS["month"]

    def post(client: TestClient, key: str = "sk-metered") -> httpx.Response:
        return client.post("/v1/images/generations", json=IMAGE, headers={"Authorization": f"Bearer {key}"})

    def sees(client: TestClient, used: int) -> None:
        ledger = client.app.state.ctx.key_limits.quotas  # type: ignore[attr-defined]
        deadline = time.monotonic() + 15
        while ledger.used(month, metered.key_id) < used:
            assert time.monotonic() < deadline, f"the head never read the other's counts ({used})"
            time.sleep(0.05)

    with head(shared_store, api_keys=keys) as a, head(shared_store, api_keys=keys) as b:
        assert [post(a).status_code for _ in range(2)] == [200, 200]
        sees(b, 2)  # a wrote its counts, b read them (each every SYNC_S)
        assert post(b).status_code == 200
        refused = post(b)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "key_quota_exceeded" and "max_per_month=3" in error["message"], error
        _, ends = month.bounds(time.time())
        assert abs(int(refused.headers["Retry-After"]) - (ends - time.time())) < 30
        sees(a, 3)
        assert post(a).status_code == 429
        assert post(a, "sk-open").status_code == 200  # other keys go on
        assert 'triptych_rejected_key_quota_requests_total{period="month"} 1.0' in b.get("/metrics").text
    with head(shared_store, api_keys=keys) as c:  # started after both stopped: their counts stand
        assert post(c).status_code == 429


def test_what_a_head_admitted_just_before_it_stopped_counts_for_the_heads_after_it(shared_store, tmp_path, monkeypatch):
    """The periodic sync never runs (an hour apart): the head's counts reach the store as it stops."""
    monkeypatch.setattr("triptych_head.api.app.SYNC_S", 3600.0)
    keys = tmp_path / "keys"
    keys.write_text("sk-metered max_per_month=1\n")
    headers = {"Authorization": "Bearer sk-metered"}
    with head(shared_store, api_keys=keys) as a:
        assert a.post("/v1/images/generations", json=IMAGE, headers=headers).status_code == 200
    with head(shared_store, api_keys=keys) as c:
        refused = c.post("/v1/images/generations", json=IMAGE, headers=headers)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "key_quota_exceeded", refused.text


def test_a_key_s_requests_per_minute_are_counted_by_every_head_together(shared_store, tmp_path):
    """`max_per_minute=2` behind two heads: what one head admitted is taken from the other's bucket
    once they have synced (every SYNC_S), so the key gets 2 a minute in all, not 2 on each head."""
    keys = tmp_path / "keys"
    keys.write_text("sk-rated max_per_minute=2\n")
    (rated,) = [e.limit for e in parse_entries(keys.read_text()) if e.limit]

    def post(client: TestClient) -> httpx.Response:
        return client.post("/v1/images/generations", json=IMAGE, headers={"Authorization": "Bearer sk-rated"})

    def heard(client: TestClient, remaining: int) -> None:
        limits = client.app.state.ctx.key_limits  # type: ignore[attr-defined]
        deadline = time.monotonic() + 15
        while limits.usage(rated)["per_minute"]["remaining"] > remaining:
            assert time.monotonic() < deadline, f"the head never heard the other's admissions ({remaining})"
            time.sleep(0.05)

    with head(shared_store, api_keys=keys) as a, head(shared_store, api_keys=keys) as b:
        assert post(a).status_code == 200
        heard(b, 1)  # a's admission taken from b's bucket (a token refills in 30 s: well after)
        assert post(b).status_code == 200
        refused = post(b)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "key_rate_limit", refused.text
        heard(a, 0)
        assert post(a).status_code == 429
    # As each head stopped it wrote its counts: nothing in flight, the 2 it admitted in all.
    bodies = [json.loads(shared_store.get_bytes(obj.name)) for obj in shared_store.list("live-counts/")]
    assert len(bodies) == 2 and all(body["in_flight"] == {} for body in bodies), bodies
    assert sum(n for body in bodies for n in body["admitted"].values()) == 2, bodies


class NoisePixels(ScriptedBackend):
    """Pixels PNG cannot compress (tests/api/test_large_bodies.py), so the stored answer is as large."""

    async def generate(self, request_id, params, on_event=None, preview_every=0, priority=1):  # type: ignore[no-untyped-def]
        self.calls.append(params)
        return GenerationOutput(pixels=noise(params.num_outputs, params.width))


def test_a_large_idempotent_answer_is_stored_as_it_is_encoded_and_replayed_by_the_other_head(shared_store):
    """An answer over the stream size (two 1024x1024 images of noise: 6 MiB of pixels, a ~8 MiB body)
    with an Idempotency-Key is spooled into the store (a file put; on S3 an upload) and streamed out
    of it; the other head replays the same bytes out of the store without running it, and no spooled
    file is left behind."""
    backends = [NoisePixels(), NoisePixels()]
    body = {"prompt": "a cat", "size": "1024x1024", "n": 2, "response_format": "b64_json", "seed": 3}
    headers = {"Idempotency-Key": f"large-{uuid.uuid4().hex}"}
    store_a, store_b = open_store(shared_store), open_store(shared_store)
    with head(store_a, backends[0]) as a, head(store_b, backends[1]) as b:
        first = a.post("/v1/images/generations", json=body, headers=headers)
        replay = b.post("/v1/images/generations", json=body, headers=headers)
    assert first.status_code == replay.status_code == 200, (first.text[:300], replay.text[:300])
    assert "content-length" not in first.headers and "content-length" not in replay.headers  # streamed
    assert replay.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers
    assert first.content == replay.content and len(first.content) > 6 << 20
    assert len(backends[0].calls) + len(backends[1].calls) == 1
    expected = noise(2, 1024)
    for i, item in enumerate(json.loads(replay.content)["data"]):
        decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))
        assert np.array_equal(decoded, expected[i, 0])
    for store in (shared_store, store_a, store_b):
        assert not list(store.staging.glob("answer-*")), "a spooled answer was left in the staging folder"


# --- bad stores stop the head at start-up --------------------------------------------------------


def serve_head(model: Path, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`triptych serve` as a head whose workers are never reached: it stops (or not) at the store check."""
    argv = [sys.executable, "-m", "triptych", "serve", "--model-path", str(model), "--disagg-role", "server",
            "--encoder-urls", "tcp://127.0.0.1:9", "--denoiser-urls", "tcp://127.0.0.1:10",
            "--decoder-urls", "tcp://127.0.0.1:11", "--port", "9", *flags]  # fmt: skip
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def without_credentials() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


def credential_files(folder: Path, access_key: str, secret_key: str) -> dict[str, str]:
    """The credentials as the operator gives them: files (0440, a trailing newline) that *_FILE variables name."""
    env: dict[str, str] = {}
    for name, value in (("AWS_ACCESS_KEY_ID", access_key), ("AWS_SECRET_ACCESS_KEY", secret_key)):
        path = folder / name.lower()
        path.write_text(value + "\n")
        path.chmod(0o440)
        env[f"{name}_FILE"] = str(path)
    return env


@pytest.mark.parametrize(
    ("case", "flag", "says"),
    [
        ("unreachable endpoint", "--results-s3-endpoint", "cannot reach it"),
        ("missing bucket", "--results-store", "does not exist"),
        ("missing credentials", "--results-store", "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY not set"),
        ("wrong secret", "--results-store", "check AWS_SECRET_ACCESS_KEY"),
        ("wrong secret in its file", "--results-store", "check AWS_SECRET_ACCESS_KEY_FILE ("),
    ],
)
def test_a_store_the_head_cannot_use_stops_it_at_start_up_with_one_line_naming_the_flag(
    s3_server, s3_bucket, tiny_models, tmp_path, case, flag, says
):
    env, bucket, endpoint = {**os.environ}, s3_bucket, s3_server.endpoint
    if case == "unreachable endpoint":
        endpoint = "http://127.0.0.1:9"  # discard: nothing listens
    elif case == "missing bucket":
        bucket = "no-such-bucket-here"
    elif case == "missing credentials":
        env = without_credentials()
    elif case == "wrong secret":
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    else:  # the access key from its file is taken; the secret from its file does not sign
        env = {**without_credentials(), **credential_files(tmp_path, s3_server.access_key, "not-the-secret")}
    store = ("--results-store", f"s3://{bucket}/p", "--results-s3-endpoint", endpoint)
    done = serve_head(tiny_models["tiny-wan"], *store, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith(f"triptych: error: {flag}") and says in lines[0], lines


def test_a_directory_the_head_cannot_write_stops_it_at_start_up(tiny_models, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    done = serve_head(tiny_models["tiny-wan"], "--output-path", str(blocked / "results"), env={**os.environ})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("triptych: error: --output-path"), lines


# --- two real head processes over the same workers ------------------------------------------------

INSTANT = ("--simulate-seconds", "0", "--simulate-seconds-per-unit", "0")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["directory", "s3"])
def test_two_head_processes_serve_each_others_video_jobs(backend, tiny_models, tmp_path, request):
    flags: tuple[str, ...] = ()
    if backend == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        monkeypatch = request.getfixturevalue("monkeypatch")  # the heads read their credentials from files
        for name, path in credential_files(tmp_path, server.access_key, server.secret_key).items():
            monkeypatch.delenv(name.removesuffix("_FILE"))
            monkeypatch.setenv(name, path)
        flags = ("--results-store", f"s3://{bucket}/{uuid.uuid4().hex}", "--results-s3-endpoint", server.endpoint)
    with deployment(tiny_models["tiny-wan"], tmp_path, simulate=True, worker_flags=INSTANT, heads=2,
                    head_flags=flags) as dep:  # fmt: skip
        a, b = dep.head_urls
        job = httpx.post(f"{a}/v1/videos", json={**VIDEO, "size": "32x32"}, timeout=30)
        assert job.status_code == 200, job.text
        job_id = job.json()["id"]
        deadline = time.monotonic() + 120
        while (status := httpx.get(f"{b}/v1/videos/{job_id}", timeout=10).json())["status"] != "completed":
            assert status["status"] in ("queued", "in_progress") and time.monotonic() < deadline, status
            time.sleep(0.2)
        mp4_b = httpx.get(f"{b}/v1/videos/{job_id}/content", timeout=30)
        mp4_a = httpx.get(f"{a}/v1/videos/{job_id}/content", timeout=30)
        assert mp4_b.status_code == 200 and mp4_b.content == mp4_a.content and mp4_b.content[4:8] == b"ftyp"


def test_a_webhook_event_one_head_handed_over_is_delivered_by_the_other(shared_store):
    """Head A stops between attempts of a webhook: head B, on its own client of the same store, adopts
    the event and delivers it with the same id."""
    key = bytes(range(32))
    with webhook_receiver(answers=[503]) as hooks:
        a = Webhooks(WebhookTarget(hooks.url, key), CollectorRegistry(), Outbox(shared_store, "a"), (30.0,))
        b = Webhooks(WebhookTarget(hooks.url, key), CollectorRegistry(), Outbox(open_store(shared_store), "b"))

        async def run() -> None:
            a.job_ended({"id": "video_1", "status": "completed", "state": "DONE"})
            await asyncio.to_thread(hooks.wait, 1)
            await a.close(0.1)
            await b.adopt_orphans()
            await b.close(30)

        asyncio.run(run())
    first, second = hooks.received
    assert first.headers["webhook-id"] == second.headers["webhook-id"] and verified(second, key)
    assert list(shared_store.list("webhooks/")) == []  # delivered: nothing left, the adoption's marker neither
