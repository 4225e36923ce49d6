"""Dynamic batching against real processes (head, encoder, denoiser, decoder; ZMQ, Mooncake) with the
tiny FLUX package on CPU: concurrent compatible requests leave the head in groups and each worker runs
a group as one batched forward, as the batching metrics on /metrics show; their pixels equal the same
requests run alone within the tolerance tests/worker/test_batched_stages.py measures."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.harness import deployment
from triptych.client import Event, TriptychClient
from triptych.roles import Role
from triptych_dev.localdeploy import LocalDeployment

pytestmark = pytest.mark.slow

ROLES = ("encoder", "denoiser", "decoder")
HEAD_FLAGS = ("--batching-mode", "dynamic", "--batching-max-size", "4", "--batching-delay-ms", "50",
              "--enable-batching-metrics")  # fmt: skip
BASE = {"size": "64x48", "num_inference_steps": 3, "guidance_scale": 3.5}
PIXEL_TOLERANCE = 1
PIXEL_SHARE = 0.01


@pytest.fixture(scope="module")
def batching(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    with deployment(
        tiny_models["tiny-flux"], tmp_path_factory.mktemp("batching"), head_flags=HEAD_FLAGS,
        worker_flags=("--batching-max-size", "4"),
    ) as dep:  # fmt: skip
        yield dep


def histograms(client: httpx.Client, name: str) -> dict[str, dict[str, float]]:
    """role -> {"count", "sum", "le=<bound>"...} of one histogram on /metrics."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name != name:
            continue
        for sample in family.samples:
            role = out.setdefault(sample.labels["role"], {})
            if sample.name.endswith("_count"):
                role["count"] = sample.value
            elif sample.name.endswith("_sum"):
                role["sum"] = sample.value
            elif sample.name.endswith("_bucket"):
                role[f"le={float(sample.labels['le']):g}"] = sample.value
    return out


def delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]], role: str, key: str) -> float:
    return after.get(role, {}).get(key, 0.0) - before.get(role, {}).get(key, 0.0)


Deltas = Callable[[str, str], tuple[float, float]]
BATCH_HISTOGRAMS = ("triptych_batch_size", "triptych_worker_batch_size")  # the head's groups, the workers' batches


def batched_concurrently(dep: LocalDeployment, client: httpx.Client, requests: list[dict]) -> tuple[list, Deltas]:
    """`concurrently`, and how the head's groups (triptych_batch_size) and the workers' batches
    (triptych_worker_batch_size) moved meanwhile: deltas(role, key) -> (sent, ran)."""
    before = [histograms(client, name) for name in BATCH_HISTOGRAMS]
    images = concurrently(dep, requests)
    after = [histograms(client, name) for name in BATCH_HISTOGRAMS]

    def deltas(role: str, key: str) -> tuple[float, float]:
        sent, ran = (delta(a, b, role, key) for a, b in zip(after, before, strict=True))
        return sent, ran

    return images, deltas


def generate(client: httpx.Client, request: dict) -> np.ndarray:
    r = client.post("/v1/images/generations", json=request)
    assert r.status_code == 200, r.text
    (image,) = r.json()["data"]
    return np.array(Image.open(io.BytesIO(base64.b64decode(image["b64_json"]))))


BARRIER_S = 60  # the longest a request's thread waits for the others to be ready
RACE_S = 600  # every request of a race done, all together


def all_at_once(count: int, one: Callable[[int, threading.Barrier], Any]) -> list[Any]:
    """one(i, start) for i in range(count), each in its own daemon thread, `start` the barrier they
    pass together: what each returned or raised. A thread that fails breaks the barrier, so none
    waits on it; the threads get RACE_S in all and every one must have finished."""
    results: list[Any] = [None] * count
    start = threading.Barrier(count, timeout=BARRIER_S)

    def run(i: int) -> None:
        try:
            results[i] = one(i, start)
        except BaseException as exc:
            start.abort()
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + RACE_S
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    running = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not running, f"requests {running} still running after {RACE_S}s: {results}"
    return results


def concurrently(dep: LocalDeployment, requests: list[dict]) -> list[np.ndarray]:
    """Every request at once, each from its own thread and connection (opened beforehand), released together."""

    def one(i: int, start: threading.Barrier) -> np.ndarray:
        with dep.client() as c:
            assert c.get("/health").status_code == 200  # the connection is up before the race starts
            start.wait()
            return generate(c, requests[i])

    results = all_at_once(len(requests), one)
    failed = [r for r in results if not isinstance(r, np.ndarray)]
    assert not failed, f"requests did not return an image: {failed!r}"
    return results


def assert_close(batched: np.ndarray, alone: np.ndarray) -> None:
    assert batched.shape == alone.shape
    diff = np.abs(batched.astype(int) - alone.astype(int))
    assert diff.max() <= PIXEL_TOLERANCE and np.mean(diff > 0) <= PIXEL_SHARE


def test_eight_concurrent_compatible_requests_run_in_at_most_two_batches_per_stage(batching: LocalDeployment):
    requests = [{**BASE, "prompt": f"a lighthouse number {i}", "seed": 10 + i} for i in range(8)]
    with batching.client() as c:
        batched, deltas = batched_concurrently(batching, c, requests)
        for role in ROLES:
            # every request, in groups the head sent and batches the workers ran: at most two of each
            assert deltas(role, "sum") == (8, 8), role
            assert max(deltas(role, "count")) <= 2, (role, deltas(role, "count"))
        assert "triptych_batch_wait_seconds_count" in c.get("/metrics").text
        assert "triptych_batch_fill_ratio_bucket" in c.get("/metrics").text

        # The same requests one at a time: each alone in its batch, pixels within the tolerance.
        ran_before = histograms(c, "triptych_worker_batch_size")
        for request, image in zip(requests, batched, strict=True):
            assert_close(image, generate(c, request))
        ran_after = histograms(c, "triptych_worker_batch_size")
        for role in ROLES:
            assert delta(ran_after, ran_before, role, "count") == 8 == delta(ran_after, ran_before, role, "le=1")


def test_incompatible_requests_are_never_batched_together(batching: LocalDeployment):
    """Two requests of each of three incompatible kinds (sizes, steps), all at once: with groups of up
    to 4 a batcher that mixed them would form a group larger than 2."""
    kinds = [BASE, {**BASE, "size": "48x64"}, {**BASE, "num_inference_steps": 2}]
    requests = [{**kind, "prompt": f"a boat {i}", "seed": i} for kind in kinds for i in range(2)]
    with batching.client() as c:
        images, deltas = batched_concurrently(batching, c, requests)
        for role in ROLES:
            assert deltas(role, "sum") == (6, 6), role
            assert deltas(role, "le=2") == deltas(role, "count"), role  # no group or batch above 2
        assert [image.shape for image in images] == [(48, 64, 3)] * 2 + [(64, 48, 3)] * 2 + [(48, 64, 3)] * 2
        for request, image in zip(requests, images, strict=True):
            assert_close(image, generate(c, request))


def test_requests_in_one_batch_each_stream_their_own_steps_and_previews(batching: LocalDeployment):
    requests = [{**BASE, "prompt": f"a tower {i}", "seed": 40 + i, "preview_every": 1} for i in range(4)]

    def one(i: int, start: threading.Barrier) -> list[Event]:
        client = TriptychClient(batching.http)
        start.wait()
        return list(client.stream_images(requests[i]))

    with batching.client() as c:
        ran_before = histograms(c, "triptych_worker_batch_size")
        streams = all_at_once(len(requests), one)
        ran_after = histograms(c, "triptych_worker_batch_size")
    assert delta(ran_after, ran_before, "denoiser", "sum") == 4
    assert delta(ran_after, ran_before, "denoiser", "count") <= 2  # they shared batched forwards
    for events in streams:
        assert isinstance(events, list), events
        steps = [e.data for e in events if e.event == "step"]
        assert [s["step"] for s in steps] == [1, 2, 3] and all("preview" in s for s in steps)
        assert events[-1].event == "completed"


def test_a_full_pipeline_worker_batches_through_the_same_stages(tiny_models: dict[str, Path], tmp_path: Path):
    """A head with only --denoiser-urls and one --disagg-full-pipeline worker: every stage batched."""
    requests = [{**BASE, "prompt": f"a harbour {i}", "seed": 70 + i} for i in range(8)]
    with deployment(
        tiny_models["tiny-flux"], tmp_path, denoisers=1, full_pipeline=True, head_flags=HEAD_FLAGS,
        worker_flags=("--batching-max-size", "4"),
    ) as dep, dep.client() as c:  # fmt: skip
        batched = concurrently(dep, requests)
        ran = histograms(c, "triptych_worker_batch_size")
        assert ran["denoiser"]["sum"] == 8 and ran["denoiser"]["count"] <= 2, ran
        for request, image in zip(requests, batched, strict=True):
            assert_close(image, generate(c, request))


@pytest.mark.parametrize("full_pipeline", [False, True], ids=["denoiser", "full-pipeline"])
def test_a_two_rank_denoiser_runs_a_group_as_one_batched_forward_on_both_ranks(
    tiny_models: dict[str, Path], tmp_path: Path, full_pipeline: bool
):
    """`--num-gpus 2` (two CPU ranks, Ulysses derived from the heads) with `--batching-max-size 4`:
    four concurrent requests run on the denoiser (a role, or a full-pipeline worker that encodes and
    decodes on rank 0) in at most two batches, pixels within the tolerance of each alone."""
    requests = [{**BASE, "prompt": f"a lantern {i}", "seed": 90 + i} for i in range(4)]
    with deployment(
        tiny_models["tiny-flux"], tmp_path, head_flags=HEAD_FLAGS, worker_flags=("--batching-max-size", "4"),
        devices={Role.DENOISER: [["cpu", "cpu"]]}, denoisers=1, full_pipeline=full_pipeline,
    ) as dep, dep.client() as c:  # fmt: skip
        batched, deltas = batched_concurrently(dep, c, requests)
        sent, ran = deltas("denoiser", "count")
        assert deltas("denoiser", "sum") == (4, 4) and ran <= 2, (sent, ran)
        for request, image in zip(requests, batched, strict=True):
            assert_close(image, generate(c, request))
