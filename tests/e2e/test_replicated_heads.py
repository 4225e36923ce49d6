"""Replicated heads over shared workers (real processes, real ZMQ and Mooncake, the tiny FLUX model).

Every worker serves both heads (`--disagg-server-addr` lists each): concurrent requests through
both give each request its own pixels, equal to stock diffusers; no worker ever holds more than its
capacity across the heads (its own count, in its heartbeats); and a head killed with SIGKILL has
what it held on the workers released within a heartbeat timeout while the other head's requests
complete.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.e2e.harness import deployment
from triptych_dev.rollout import ServiceLoad, roll_heads

pytestmark = pytest.mark.slow

BODY = {"prompt": "a lighthouse at dusk", "size": "32x32", "num_inference_steps": 2}
HEARTBEAT = ("--disagg-heartbeat-timeout", "2")  # a killed head is noticed within 2 s


def stock(model: Path, seeds: list[int]) -> dict[int, np.ndarray]:
    """Stock diffusers' own pixels for BODY at each seed."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model).to("cpu")
    out = {}
    for seed in seeds:
        image = pipe(
            BODY["prompt"], width=32, height=32, num_inference_steps=2, guidance_scale=3.5,
            generator=torch.Generator("cpu").manual_seed(seed), output_type="pil",
        ).images[0]  # fmt: skip
        out[seed] = np.array(image)
    return out


def generate(url: str, seed: int, **fields) -> np.ndarray:
    r = httpx.post(f"{url}/v1/images/generations", json={**BODY, "seed": seed, **fields}, timeout=300)
    assert r.status_code == 200, r.text
    return np.array(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))


def workers_seen_by(url: str) -> list[dict]:
    health = httpx.get(f"{url}/health", timeout=5).json()
    return [w for ws in health["workers"].values() for w in ws]


def wait_until_all_free(url: str, seconds: float) -> list[dict]:
    """The workers as `url` sees them once each holds nothing for any head (or as they are at the end)."""
    deadline = time.monotonic() + seconds
    while True:
        workers = workers_seen_by(url)
        free = all(w["held"] == 0 and w["others_busy"] == 0 and w["free_slots"] == w["capacity"] for w in workers)
        if free and all(w["free_bytes"] == w["pool_bytes"] for w in workers if w["pool_bytes"]):
            return workers
        if time.monotonic() > deadline:
            return workers
        time.sleep(0.2)


def wait_until_denoising(url: str, seconds: float) -> bool:
    """Whether the head at `url` dispatched a request to a denoiser and not yet to a decoder, within
    `seconds` (its own dispatch counts: immediate, unlike the workers' once-a-second heartbeats)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        roles = httpx.get(f"{url}/health", timeout=5).json()["workers"]
        if sum(w["dispatched"] for w in roles["denoiser"]) and not sum(w["dispatched"] for w in roles["decoder"]):
            return True
        time.sleep(0.02)
    return False


def test_two_heads_share_the_workers_each_request_gets_stock_pixels_and_no_worker_exceeds_capacity(
    tiny_models, tmp_path
):
    model = tiny_models["tiny-flux"]
    seeds = list(range(8))
    flags = ("--worker-capacity", "1")  # one slot per worker: the heads compete for every one
    with deployment(model, tmp_path, denoisers=2, heads=2, worker_flags=flags) as dep:
        a, b = dep.head_urls
        with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
            got = dict(zip(seeds, pool.map(lambda s: generate(a if s % 2 else b, s), seeds), strict=True))
        after = {url: wait_until_all_free(url, 10) for url in (a, b)}
    expected = stock(model, seeds)
    for seed in seeds:
        assert np.array_equal(got[seed], expected[seed]), f"seed {seed}: not stock diffusers' pixels"
    for url, workers in after.items():
        assert all(w["peak_held"] <= w["capacity"] == 1 for w in workers), (url, workers)
        assert all(w["held"] == 0 and w["free_slots"] == 1 for w in workers), (url, workers)
        assert all(w["free_bytes"] == w["pool_bytes"] for w in workers if w["pool_bytes"]), (url, workers)
        assert sum(w["dispatched"] for w in workers if w["url"]) >= 3 * 4, (url, workers)  # each head used the pools


def test_a_killed_head_loses_only_its_own_requests_and_its_slots_are_freed_within_a_heartbeat(tiny_models, tmp_path):
    model = tiny_models["tiny-flux"]
    with deployment(model, tmp_path, heads=2, head_flags=HEARTBEAT, worker_flags=HEARTBEAT) as dep:
        a, b = dep.head_urls
        head_b = next(p for p in dep.procs if p.url == b)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            on_a = [pool.submit(generate, a, s) for s in range(4)]
            on_b = [pool.submit(generate, b, s, num_inference_steps=500) for s in range(4, 8)]  # ~2 s each
            assert wait_until_denoising(b, 60), "b never dispatched a request to a denoiser"
            head_b.kill()  # SIGKILL: no drain, nothing said to the workers
            results_a = [f.result() for f in on_a]
            lost_b = [f.exception(timeout=300) for f in on_b]
        workers = wait_until_all_free(a, 15)
        after = generate(a, 100)  # every slot is usable again
    expected = stock(model, [*range(4), 100])
    assert all(np.array_equal(results_a[s], expected[s]) for s in range(4)), "a's requests must complete, unchanged"
    assert all(isinstance(e, httpx.HTTPError) for e in lost_b), f"b's requests died with it: {lost_b}"
    assert np.array_equal(after, expected[100])
    assert all(w["held"] == 0 and w["others_busy"] == 0 for w in workers), workers
    assert all(w["free_bytes"] == w["pool_bytes"] for w in workers if w["pool_bytes"]), workers


def test_the_client_sends_a_killed_head_s_image_request_to_the_other_head_and_it_runs_once(tiny_models, tmp_path):
    """TriptychClient with both heads' URLs (as `triptych ... --url A,B`): its request's head dies
    under it, so it sends the request again, same Idempotency-Key, to the other head, which waits
    out the dead head's lease and runs it: the pixels of the same request never interrupted."""
    from triptych.client import TriptychClient
    from triptych_head.idempotency import LEASE_S

    model = tiny_models["tiny-flux"]
    body = {**BODY, "num_inference_steps": 500, "seed": 11}  # about 2 s of denoising to be killed under
    with deployment(model, tmp_path, heads=2, head_flags=HEARTBEAT, worker_flags=HEARTBEAT) as dep:
        a, b = dep.head_urls
        head_b = next(p for p in dep.procs if p.url == b)
        client = TriptychClient([b, a], timeout=LEASE_S + 120)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.generate_images, body)
            assert wait_until_denoising(b, 60), "b never dispatched the request to a denoiser"
            head_b.kill()  # SIGKILL under the request, while it denoises
            (png,) = answer.result(timeout=LEASE_S + 150)
        assert client.url == a, "the client moved on to the head that answered"
        again = httpx.post(f"{a}/v1/images/generations", json=body, timeout=300)
        assert again.status_code == 200, again.text
    got = np.array(Image.open(io.BytesIO(png)))
    assert np.array_equal(got, np.array(Image.open(io.BytesIO(base64.b64decode(again.json()["data"][0]["b64_json"])))))


def test_the_cli_s_streamed_request_whose_head_is_killed_is_finished_by_the_other_head(tiny_models, tmp_path):
    """`triptych generate --url B,A` streams its progress under an Idempotency-Key: B dies while the
    request denoises, the CLI sends it again under the key to A, which waits out B's lease and runs it
    once; the PNG is the pixels of the same request never interrupted."""
    import subprocess
    import sys

    from triptych_head.idempotency import LEASE_S

    model = tiny_models["tiny-flux"]
    body = {**BODY, "num_inference_steps": 500, "seed": 12}
    with deployment(model, tmp_path, heads=2, head_flags=HEARTBEAT, worker_flags=HEARTBEAT) as dep:
        a, b = dep.head_urls
        head_b = next(p for p in dep.procs if p.url == b)
        out = tmp_path / "cli.png"
        cli = subprocess.Popen(
            [sys.executable, "-m", "triptych", "generate", body["prompt"], "-o", str(out), "--url", f"{b},{a}",
             "--size", body["size"], "--seed", "12", "--steps", "500"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            assert wait_until_denoising(b, 60), "b never dispatched the request to a denoiser"
            head_b.kill()  # SIGKILL under the streamed request
            output, _ = cli.communicate(timeout=LEASE_S + 150)
        finally:
            cli.kill()
        assert cli.returncode == 0, output[-3000:]
        again = httpx.post(f"{a}/v1/images/generations", json=body, timeout=300)
        assert again.status_code == 200, again.text
        a_ran = sum(w["dispatched"] for w in workers_seen_by(a) if w["url"])
    got = np.array(Image.open(out))
    assert np.array_equal(got, np.array(Image.open(io.BytesIO(base64.b64decode(again.json()["data"][0]["b64_json"])))))
    assert a_ran == 2 * 3, "a ran the CLI's request once (and `again` once): encoder, denoiser, decoder each"


def test_a_video_job_of_a_killed_head_is_run_to_completion_by_the_other_and_its_events_resume(tiny_models, tmp_path):
    from triptych_head.results import JOB_LEASE_S

    slow = ("--step-seconds", "0.05", *HEARTBEAT)
    with deployment(tiny_models["tiny-wan"], tmp_path, null_payload=4096, heads=2, head_flags=HEARTBEAT,
                    worker_flags=slow) as dep:  # fmt: skip
        a, b = dep.head_urls
        head_b = next(p for p in dep.procs if p.url == b)
        body = {"prompt": "waves", "size": "32x32", "num_frames": 5, "num_inference_steps": 200, "seed": 3}
        job = httpx.post(f"{b}/v1/videos", json=body, timeout=30).json()
        deadline = time.monotonic() + 60
        while httpx.get(f"{a}/v1/videos/{job['id']}", timeout=10).json()["step"] < 1:  # a reads b's saves
            assert time.monotonic() < deadline, "b's job never started"
            time.sleep(0.2)
        head_b.kill()  # SIGKILL: no drain, its lease is left to run out
        with httpx.stream("GET", f"{a}/v1/videos/{job['id']}/events", timeout=JOB_LEASE_S + 90) as events:
            text = "".join(events.iter_text())  # a client that reconnects to the head left
        assert "event: completed" in text, text[-2000:]
        done = httpx.get(f"{a}/v1/videos/{job['id']}", timeout=10).json()
        assert done["status"] == "completed" and done["restarts"] == 1 and done["seed"] == 3, done
        mp4 = httpx.get(f"{a}/v1/videos/{job['id']}/content", timeout=30)
        assert mp4.status_code == 200 and mp4.content[4:8] == b"ftyp"
        workers = wait_until_all_free(a, 15)
    assert all(w["held"] == 0 and w["others_busy"] == 0 for w in workers), workers


def test_a_rolling_restart_of_the_heads_under_continuous_load_fails_no_request(tiny_models, tmp_path):
    """As a Deployment rollout with a Service in front (triptych_dev.rollout): each head in turn
    leaves the Service's endpoints, gets SIGTERM after its preStop pause, drains what it accepted,
    and its replacement joins once it sees the workers. A request every 100 ms throughout."""
    flags = ("--step-seconds", "0.01")
    with deployment(tiny_models["tiny-flux"], tmp_path, null_payload=4096, heads=2, worker_flags=flags,
                    denoisers=2) as dep:  # fmt: skip
        with ServiceLoad(list(dep.head_urls), BODY, interval=0.1) as load:
            time.sleep(2)
            roll_heads(dep, load)
            time.sleep(2)
    failed = load.failed()
    assert not failed, f"{len(failed)} of {len(load.answers)} requests failed during the rollout: {failed[:5]}"
    assert len(load.answers) >= 50, len(load.answers)  # the rollout took at least 5 s of load
