"""Multi-device denoisers on CPU (gloo): `--num-gpus N` runs N real rank processes behind one worker.

Pixels through the head, same request, same seed: CFG parallel (Wan) and Ulysses (Wan, FLUX) on
two ranks equal the single-rank disaggregated pipeline byte for byte; Ulysses 2 x Ring 2 on four
ranks is within RING_PIXEL_TOLERANCE (the ring's log-sum-exp merge sums the softmax in another
order). Every rank did its share of the attention work (rank 0 logs the counts it gathers after
each job). A rank that dies takes the instance down, and the head sees it gone.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.harness import deployment
from tests.e2e.test_pixels import VIDEO, http_image, http_video
from triptych.localdeploy import LocalDeployment, free_port_block
from triptych.roles import Role

pytestmark = pytest.mark.slow

RING_PIXEL_TOLERANCE = 1  # uint8 levels; the latents differ by ~2e-6 (bench/parallel_bench.py reports it)
WORK = re.compile(r"attention work per rank \[([\d, ]+)\]")


def denoiser_flags(*degrees: str) -> dict[Role, tuple[str, ...]]:
    return {Role.DENOISER: ("--master-port", str(free_port_block(1)), *degrees)}


def fetch_pixels(model: Path, tmp: Path, fetch, *degrees: str) -> tuple[np.ndarray, list[int]]:  # type: ignore[no-untyped-def]
    """Pixels of one request through a deployment whose denoiser runs `degrees`, and its per-rank attention work."""
    with deployment(model, tmp, role_flags=denoiser_flags(*degrees) if degrees else None) as dep:
        with dep.client(timeout=300) as c:
            pixels = fetch(c)
        log = dep.workers(Role.DENOISER)[0].log.read_text(errors="replace")
    found = WORK.findall(log)
    work = [int(x) for x in found[-1].split(",")] if found else []
    return pixels, work


@pytest.fixture(scope="module")
def wan_single(tiny_models, tmp_path_factory) -> np.ndarray:  # type: ignore[no-untyped-def]
    return fetch_pixels(tiny_models["tiny-wan"], tmp_path_factory.mktemp("wan1"), http_video)[0]


@pytest.fixture(scope="module")
def flux_single(tiny_models, tmp_path_factory) -> np.ndarray:  # type: ignore[no-untyped-def]
    return fetch_pixels(tiny_models["tiny-flux"], tmp_path_factory.mktemp("flux1"), http_image)[0]


@pytest.mark.parametrize(
    "degrees",
    [("--num-gpus", "2", "--cfg-parallel-size", "2"), ("--num-gpus", "2", "--denoiser-ulysses", "2")],
    ids=["cfg2", "ulysses2"],
)
def test_two_rank_wan_denoiser_gives_the_single_rank_pixels(tiny_models, tmp_path, wan_single, degrees):
    pixels, work = fetch_pixels(tiny_models["tiny-wan"], tmp_path, http_video, *degrees)
    assert np.array_equal(pixels, wan_single), "2-rank pixels differ from the single-rank pipeline"
    assert len(work) == 2 and min(work) > 0 and work[0] == work[1], work


def test_two_rank_ulysses_flux_denoiser_gives_the_single_rank_pixels(tiny_models, tmp_path, flux_single):
    pixels, work = fetch_pixels(tiny_models["tiny-flux"], tmp_path, http_image, "--num-gpus", "2")  # ulysses derived
    assert np.array_equal(pixels, flux_single), "2-rank pixels differ from the single-rank pipeline"
    assert len(work) == 2 and min(work) > 0 and work[0] == work[1], work


@pytest.mark.parametrize("package", ["tiny-wan", "tiny-flux"])
def test_ulysses2_ring2_denoiser_is_within_the_ring_tolerance(tiny_models, tmp_path, request, package):
    single = request.getfixturevalue("wan_single" if package == "tiny-wan" else "flux_single")
    fetch = http_video if package == "tiny-wan" else http_image
    degrees = ("--num-gpus", "4", "--denoiser-ulysses", "2", "--denoiser-ring", "2")
    pixels, work = fetch_pixels(tiny_models[package], tmp_path, fetch, *degrees)
    assert pixels.shape == single.shape
    diff = np.abs(pixels.astype(np.int16) - single.astype(np.int16))
    assert diff.max() <= RING_PIXEL_TOLERANCE, f"max pixel difference {diff.max()}"
    assert len(work) == 4 and min(work) > 0 and len(set(work)) == 1, work


def test_a_cancelled_job_stops_every_rank_at_one_step_and_the_next_job_runs(tiny_models, tmp_path):
    body = {**VIDEO, "num_inference_steps": 200}  # long enough to cancel halfway
    flags = denoiser_flags("--num-gpus", "2", "--denoiser-ulysses", "2")
    with deployment(tiny_models["tiny-wan"], tmp_path, role_flags=flags) as dep, dep.client(timeout=300) as c:
        job = c.post("/v1/videos", json=body).json()
        deadline = time.monotonic() + 120
        while c.get(f"/v1/videos/{job['id']}").json()["step"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.delete(f"/v1/videos/{job['id']}").status_code in (200, 204)
        assert http_video(c).shape[0] == VIDEO["num_frames"]  # the ranks are in step for the next job
        assert dep.workers(Role.DENOISER)[0].popen.poll() is None
        log = dep.workers(Role.DENOISER)[0].log.read_text(errors="replace")
    assert "out of step" not in log and len(WORK.findall(log)) == 1  # only the finished job reports


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def followers_of(dep: LocalDeployment) -> tuple[int, list[int]]:
    rank0 = dep.workers(Role.DENOISER)[0].popen.pid
    deadline = time.monotonic() + 30
    while not (found := children(rank0)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return rank0, found


def wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


FAST_LOSS = ("--disagg-heartbeat-timeout", "2")


def test_a_dying_follower_takes_the_instance_down_and_the_head_sees_it_gone(tiny_models, tmp_path):
    flags = denoiser_flags("--num-gpus", "2")
    with deployment(tiny_models["tiny-flux"], tmp_path, role_flags=flags, head_flags=FAST_LOSS) as dep:
        with dep.client(timeout=60) as c:
            _, followers = followers_of(dep)
            assert len(followers) == 1
            os.kill(followers[0], signal.SIGKILL)
            proc = dep.workers(Role.DENOISER)[0].popen
            assert proc.wait(timeout=20) == 3, "rank 0 did not stop after its follower died"
            deadline = time.monotonic() + 20
            while c.get("/health").json()["workers"]["denoiser"][0]["alive"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert c.get("/health").json()["workers"]["denoiser"][0]["alive"] is False
        assert "rank 1 exited" in dep.workers(Role.DENOISER)[0].log.read_text(errors="replace")


def test_followers_die_with_rank_zero(tiny_models, tmp_path):
    flags = denoiser_flags("--num-gpus", "2")
    with deployment(tiny_models["tiny-flux"], tmp_path, role_flags=flags) as dep:
        rank0, followers = followers_of(dep)
        assert len(followers) == 1
        os.kill(rank0, signal.SIGKILL)
        assert wait_gone(followers, 20), "a follower outlived rank 0"
