"""Full-pipeline pools: a head with only --denoiser-urls, two denoisers that each run every stage
(--disagg-full-pipeline). Real processes and ZMQ on CPU with the tiny models: pixels byte for byte
equal to stock diffusers (and so to monolithic mode, test_pixels.py), no transfer message ever sent,
both workers used, progress and previews streamed, image edits (Kontext) included."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import triptych_dev
from tests.e2e.harness import deployment
from tests.e2e.test_image_edits import PARAMS as EDIT_PARAMS
from tests.e2e.test_image_edits import edit, pixels_of
from tests.e2e.test_parallel_roles import rank_processes
from tests.e2e.test_pixels import IMAGE, VIDEO, http_image, http_video, stock_image, stock_video
from tests.e2e.test_progress_events import IMAGE as STREAMED
from tests.e2e.test_progress_events import VAE_SCALE, png_size
from tests.worker.test_role_pipelines import stock_kontext_edit
from triptych.client import TriptychClient
from triptych.config import DEFAULT_ENCODER_CACHE_BYTES
from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_dev.localdeploy import LocalDeployment
from triptych_worker.pipeline import load_role_pipeline
from triptych_worker.transfer.listeners import listening_sockets

pytestmark = pytest.mark.slow

# test_pixels' IMAGE and VIDEO requests as the head hands them on (what monolithic mode runs in-process).
MONOLITHIC_PARAMS = {
    "tiny-flux": GenerationParams(IMAGE["prompt"], 64, 48, num_inference_steps=3, guidance_scale=3.5, seed=1234,
                                  num_outputs=2),
    "tiny-wan": GenerationParams(VIDEO["prompt"], 48, 32, num_frames=5, num_inference_steps=3, guidance_scale=5.0,
                                 negative_prompt="blurry", seed=99),
}  # fmt: skip
TRANSFER_MESSAGES = ("transfer_alloc", "transfer_push", "transfer_ready")
HEARTBEAT_S = 1.5  # a worker heartbeat (1 s) and a head tick (0.5 s)


def samples(http: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The head's /metrics samples named `name`: (labels, value) each."""
    text = httpx.get(f"{http}/metrics", timeout=30).text
    return [
        (s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples if s.name == name
    ]


def messages_sent(http: str) -> dict[str, float]:
    """The head's triptych_worker_messages_sent_total by message type."""
    return {labels["type"]: value for labels, value in samples(http, "triptych_worker_messages_sent_total")}


def cache_counts(http: str) -> tuple[float, float]:
    """(hits, misses) of every worker's prompt-embedding cache, as the head last heard them."""
    hits = sum(value for _, value in samples(http, "triptych_encoder_cache_hits"))
    return hits, sum(value for _, value in samples(http, "triptych_encoder_cache_misses"))


def assert_full_pipeline_served(dep: LocalDeployment, requests: int) -> None:
    """Both workers took work, each as a full-pipeline worker, and no transfer message was sent."""
    health = httpx.get(f"{dep.http}/health", timeout=30).json()
    assert health["topology"] == "full_pipeline"
    assert list(health["workers"]) == ["denoiser"]
    denoisers = health["workers"]["denoiser"]
    assert [w["full_pipeline"] for w in denoisers] == [True, True]
    assert all(w["dispatched"] >= 1 for w in denoisers) and sum(w["dispatched"] for w in denoisers) == requests
    sent = messages_sent(dep.http)
    assert sent.get("work") == requests, sent
    assert all(sent.get(kind, 0) == 0 for kind in TRANSFER_MESSAGES), sent


@pytest.mark.parametrize(
    ("package", "fetch", "stock"),
    [("tiny-flux", http_image, stock_image), ("tiny-wan", http_video, stock_video)],
    ids=["flux-image", "wan-video"],
)
def test_a_pool_of_two_full_pipeline_workers_returns_stock_diffusers_pixels_without_transfers(
    tiny_models, tmp_path, package, fetch, stock
):
    model = tiny_models[package]
    with deployment(model, tmp_path, denoisers=2, full_pipeline=True) as dep, dep.client(timeout=300) as c:
        first, second = fetch(c), fetch(c)  # round robin: one request on each worker
        assert_full_pipeline_served(dep, requests=2)
    reference = stock(model)
    assert first.dtype == np.uint8
    assert np.array_equal(first.reshape(reference.shape), reference), "pixels differ from stock diffusers"
    assert np.array_equal(second, first), "the two workers' pixels differ"
    mono = load_role_pipeline(str(model), Role.MONOLITHIC).generate(MONOLITHIC_PARAMS[package], lambda *_: None)
    assert np.array_equal(first.reshape(mono.shape), mono), "pixels differ from monolithic mode's pipeline"


@pytest.mark.parametrize(
    ("package", "fetch", "stock", "flags"),
    [
        ("tiny-flux", http_image, stock_image, ()),  # Ulysses 2, derived from the heads
        ("tiny-wan", http_video, stock_video, ("--cfg-parallel-size", "2")),
    ],
    ids=["flux-ulysses2", "wan-cfg2"],
)
def test_a_full_pipeline_worker_on_two_ranks_returns_stock_diffusers_pixels(
    tiny_models, tmp_path, package, fetch, stock, flags
):
    """`--num-gpus 2 --disagg-full-pipeline`: rank 0 encodes and decodes, both ranks denoise; degrees
    whose two ranks make one rank's bytes give stock diffusers' pixels."""
    model = tiny_models[package]
    with deployment(
        model, tmp_path, denoisers=1, full_pipeline=True, role_flags={Role.DENOISER: flags},
        devices={Role.DENOISER: [["cpu", "cpu"]]},
    ) as dep, dep.client(timeout=300) as c:  # fmt: skip
        pixels = fetch(c)
        sent = messages_sent(dep.http)
        assert sent.get("work") == 1 and all(sent.get(kind, 0) == 0 for kind in TRANSFER_MESSAGES), sent
        log = (dep.workdir / "denoiser-0.log").read_text(errors="replace")
        # No bind shim here (no Mooncake in this mode): the ranks' store is on loopback all the same.
        rank0 = dep.workers(Role.DENOISER)[0].popen.pid
        for pid in (rank0, *rank_processes(rank0)):
            wildcard = {(a, port) for a, port in listening_sockets(pid) if a in ("0.0.0.0", "::")}
            assert not wildcard, f"rank process {pid} listens on {wildcard}"
        if package == "tiny-flux":  # rank 0 holds the whole latents after each step: it previews them
            events = list(TriptychClient(dep.http).stream_images({**STREAMED, "preview_every": 2}))
            steps = [e.data for e in events if e.event == "step"]
            assert [s["step"] for s in steps if "preview" in s] == [2, 4], [e.event for e in events]
    reference = stock(model)
    assert np.array_equal(pixels.reshape(reference.shape), reference), "pixels differ from stock diffusers"
    assert "full pipeline on 2 ranks" in log


@pytest.fixture(scope="module")
def flux_pool(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    with deployment(tiny_models["tiny-flux"], tmp_path_factory.mktemp("flux"), denoisers=2, full_pipeline=True) as d:
        yield d


def test_a_streamed_request_gets_every_step_with_previews_and_its_pixels(flux_pool: LocalDeployment):
    client = TriptychClient(flux_pool.http)
    events = list(client.stream_images({**STREAMED, "preview_every": 2}))
    names = [e.event for e in events]
    assert names[-1] == "completed" and "error" not in names, names
    states = [e.data["state"] for e in events if e.event == "state"]
    assert states == ["DENOISING_WAITING", "DENOISING_RUNNING"], states  # one hop, which ends the request
    steps = [e.data for e in events if e.event == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["step"] for s in steps if "preview" in s] == [2, 4]
    assert png_size(steps[1]["preview"]) == (64 // VAE_SCALE, 48 // VAE_SCALE)
    streamed = events[-1].data["data"][0]["b64_json"]
    assert client.generate_images(STREAMED)[0] == base64.b64decode(streamed)


def test_pipeline_view_and_triptych_status_say_full_pipeline(flux_pool: LocalDeployment):
    view = httpx.get(f"{flux_pool.http}/v1/pipeline", timeout=30).json()
    assert view["topology"] == "full_pipeline"
    assert [i["full_pipeline"] for i in view["roles"]["denoiser"]["instances"]] == [True, True]
    done = subprocess.run(
        [sys.executable, "-m", "triptych", "status", "--url", flux_pool.http], capture_output=True, text=True,
        timeout=120, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "full pipeline" in done.stdout and done.stdout.count("ready") == 2, done.stdout


def test_a_repeated_prompt_is_a_cache_hit_on_each_worker_and_the_head_exports_it(flux_pool: LocalDeployment):
    body = {"prompt": "a cache test", "size": "32x32", "num_inference_steps": 1, "seed": 4}
    time.sleep(HEARTBEAT_S)  # what the workers did before is in the head's metrics
    hits, misses = cache_counts(flux_pool.http)
    client = TriptychClient(flux_pool.http)
    images = [client.generate_images(body)[0] for _ in range(4)]  # round robin: two on each worker
    assert len(set(images)) == 1, "a cache hit changed the pixels"
    deadline = time.monotonic() + 10 * HEARTBEAT_S
    while cache_counts(flux_pool.http)[0] < hits + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cache_counts(flux_pool.http) == (hits + 2, misses + 2)
    capacity = samples(flux_pool.http, "triptych_encoder_cache_capacity_bytes")
    assert [value for _, value in capacity] == [DEFAULT_ENCODER_CACHE_BYTES] * 2


def test_a_worker_of_the_other_topology_gets_no_work(tiny_models, tmp_path):
    """A full-pipeline worker behind a head that routes through roles would return pixels where latents
    are due: it heartbeats, but is never ready."""
    flags = {Role.DENOISER: ("--disagg-full-pipeline",)}
    head = ("--disagg-no-instance-wait", "3")
    with deployment(tiny_models["tiny-flux"], tmp_path, role_flags=flags, head_flags=head) as dep:
        denoiser = httpx.get(f"{dep.http}/health", timeout=30).json()["workers"]["denoiser"][0]
        assert denoiser["alive"] and denoiser["wrong_topology"] and not denoiser["ready"]
        with dep.client(60) as c:
            r = c.post("/v1/images/generations", json={"prompt": "x", "size": "32x32", "num_inference_steps": 1})
        assert r.status_code == 503, r.text
        assert "none ready (1 started with --disagg-full-pipeline" in r.json()["error"]["message"]


def test_an_edit_in_a_full_pipeline_pool_equals_stock_diffusers(tiny_models, tmp_path):
    model = tiny_models["tiny-flux-kontext"]
    with triptych_dev.launch_pool(model, full_pipeline=True, workdir=tmp_path) as pool:
        with pool.deployment.client(300) as c:
            got = pixels_of(edit(c))
        assert messages_sent(pool.url).get("transfer_alloc", 0) == 0
    assert np.array_equal(got, stock_kontext_edit(model, EDIT_PARAMS).numpy())


LONG = {"prompt": "a lighthouse at dusk", "size": "64x64", "seed": 7, "num_inference_steps": 300}


def busy_worker(dep: LocalDeployment, seconds: float = 60) -> str:
    """The URL of a full-pipeline worker the head has given a request to."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        workers = httpx.get(f"{dep.http}/health", timeout=30).json()["workers"]["denoiser"]
        if busy := [w["url"] for w in workers if w["free_slots"] < w["capacity"]]:
            return busy[0]
        time.sleep(0.02)
    raise AssertionError("no worker ever got the request")


def test_a_cancelled_video_stops_on_its_full_pipeline_worker_and_frees_it(tiny_models, tmp_path):
    with deployment(tiny_models["tiny-wan"], tmp_path, denoisers=1, full_pipeline=True) as dep:
        client = TriptychClient(dep.http)
        job = client.create_video({"prompt": "waves", "size": "32x32", "num_frames": 5, "num_inference_steps": 500})
        busy_worker(dep)
        assert client.cancel_video(job["id"])["status"] == "cancelled"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            (worker,) = httpx.get(f"{dep.http}/health", timeout=30).json()["workers"]["denoiser"]
            if worker["free_slots"] == worker["capacity"]:
                break
            time.sleep(0.1)
        assert worker["free_slots"] == worker["capacity"], worker
        assert messages_sent(dep.http).get("cancel_work", 0) >= 1
        quick = {"prompt": "waves", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
        done = client.create_video(quick)
        assert [e.event for e in client.video_events(done["id"])][-1] == "completed"  # the worker is free again


def test_sigterm_to_a_busy_full_pipeline_worker_finishes_its_request_then_exits(tiny_models, tmp_path):
    body = {**LONG, "num_inference_steps": 60}
    with deployment(tiny_models["tiny-flux"], tmp_path, denoisers=2, full_pipeline=True) as dep:
        client = TriptychClient(dep.http)
        with ThreadPoolExecutor(1) as pool:
            drained = pool.submit(client.generate_images, body)
            url = busy_worker(dep)
            victim = next(p for p in dep.workers(Role.DENOISER) if p.url == url)
            code = dep.stop_worker(victim, drain=True, timeout=120)
            image = drained.result(timeout=120)[0]
        assert code == 0
        assert not [s for s in samples(dep.http, "triptych_retries_total") if s[1]], "the drained request was retried"
        assert client.generate_images(body)[0] == image  # the other worker, the same pixels
