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
from triptych.roles import Role
from triptych_dev.localdeploy import LocalDeployment, free_port_block

pytestmark = pytest.mark.slow

RING_PIXEL_TOLERANCE = 1  # uint8 levels; the latents differ by ~2e-6 (bench/parallel_bench.py reports it)
TP_PIXEL_TOLERANCE = 1  # uint8 levels: the all-reduce sums each row-parallel matmul in another order
WORK = re.compile(r"attention work per rank \[([\d, ]+)\]")
HELD = re.compile(r"parameter bytes per rank \[([\d, ]+)\]")


def denoiser_flags(*degrees: str) -> dict[Role, tuple[str, ...]]:
    return {Role.DENOISER: ("--master-port", str(free_port_block(1)), *degrees)}


def fetch_pixels(model: Path, tmp: Path, fetch, *degrees: str) -> tuple[np.ndarray, list[int]]:  # type: ignore[no-untyped-def]
    """Pixels of one request through a deployment whose denoiser runs `degrees`, and its per-rank attention work."""
    pixels, log = fetch_with_log(model, tmp, fetch, *degrees)
    return pixels, per_rank(WORK, log)


def fetch_with_log(model: Path, tmp: Path, fetch, *degrees: str) -> tuple[np.ndarray, str]:  # type: ignore[no-untyped-def]
    with deployment(model, tmp, role_flags=denoiser_flags(*degrees) if degrees else None) as dep:
        with dep.client(timeout=300) as c:
            pixels = fetch(c)
        return pixels, dep.workers(Role.DENOISER)[0].log.read_text(errors="replace")


def per_rank(pattern: re.Pattern[str], log: str) -> list[int]:
    """The last per-rank list rank 0 logged for `pattern`."""
    found = pattern.findall(log)
    return [int(x) for x in found[-1].split(",")] if found else []


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


def tp_shard_bytes(model: Path, family: str, tp: int) -> tuple[int, int]:
    """(the whole transformer's parameter bytes, what one of `tp` ranks holds when every planned module keeps
    1/tp of its weights and a row-parallel layer keeps its whole bias)."""
    import fnmatch

    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    from triptych_worker.parallel.tensor import COLWISE, tp_plan

    cls = WanTransformer3DModel if family == "wan" else FluxTransformer2DModel
    transformer = cls.from_pretrained(model / "transformer")
    plan = tp_plan(transformer, family)
    full = held = 0
    for name, param in transformer.named_parameters():
        size = param.numel() * param.element_size()
        module, _, kind = name.rpartition(".")
        style = next((s for p, s in plan.items() if fnmatch.fnmatchcase(module, p)), None)
        full += size
        whole = style is None or (kind == "bias" and style != COLWISE)
        held += size if whole else size // tp
    return full, held


@pytest.mark.parametrize("package", ["tiny-wan", "tiny-flux"])
def test_two_rank_tp_denoiser_holds_half_the_weights_and_is_within_the_tp_tolerance(
    tiny_models, tmp_path, request, package
):
    single = request.getfixturevalue("wan_single" if package == "tiny-wan" else "flux_single")
    fetch = http_video if package == "tiny-wan" else http_image
    pixels, log = fetch_with_log(tiny_models[package], tmp_path, fetch, "--num-gpus", "2", "--denoiser-tp", "2")
    assert pixels.shape == single.shape
    diff = np.abs(pixels.astype(np.int16) - single.astype(np.int16))
    assert diff.max() <= TP_PIXEL_TOLERANCE, f"max pixel difference {diff.max()}"
    work = per_rank(WORK, log)
    assert len(work) == 2 and min(work) > 0 and work[0] == work[1], work
    full, shard = tp_shard_bytes(tiny_models[package], package.removeprefix("tiny-"), 2)
    assert per_rank(HELD, log) == [shard, shard] and shard < 0.8 * full, (per_rank(HELD, log), full)


@pytest.mark.parametrize(
    ("package", "degrees"),
    [("tiny-wan", ("--cfg-parallel-size", "2")), ("tiny-flux", ("--denoiser-ring", "2"))],
    ids=["wan-tp2-cfg2", "flux-tp2-ring2"],
)
def test_tp_combines_with_cfg_and_ring_parallelism(tiny_models, tmp_path, request, package, degrees):
    single = request.getfixturevalue("wan_single" if package == "tiny-wan" else "flux_single")
    fetch = http_video if package == "tiny-wan" else http_image
    flags = ("--num-gpus", "4", "--denoiser-tp", "2", *degrees)
    pixels, log = fetch_with_log(tiny_models[package], tmp_path, fetch, *flags)
    diff = np.abs(pixels.astype(np.int16) - single.astype(np.int16))
    assert diff.max() <= max(TP_PIXEL_TOLERANCE, RING_PIXEL_TOLERANCE), f"max pixel difference {diff.max()}"
    work = per_rank(WORK, log)
    assert len(work) == 4 and min(work) > 0 and len(set(work)) == 1, work
    _, shard = tp_shard_bytes(tiny_models[package], package.removeprefix("tiny-"), 2)
    assert per_rank(HELD, log) == [shard] * 4


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
