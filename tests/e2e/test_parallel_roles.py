"""Multi-device roles beyond the denoiser's sequence and CFG parallelism, on CPU (gloo), through the head.

`--decoder-sp 2` (Wan): the VAE decode split by bands of rows with halo exchange gives the
single-rank decoder's pixels byte for byte, and both ranks decoded an equal, non-zero share.
`triptych_dev.launch_pool` with the reference design's `denoiser_gpus=[[1, 2], [3, 4]]` on CPU: two
denoiser
instances of two rank processes each, one instance per list to the head, both serving.
(The denoiser's TP tests are in test_parallel_ranks.py, beside the single-rank pixels they compare to.)
"""

from __future__ import annotations

import functools
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

import triptych_dev
from tests.e2e.harness import deployment
from tests.e2e.test_pixels import IMAGE, VIDEO, http_image, http_video
from triptych.roles import Role
from triptych_dev.localdeploy import free_port_block
from triptych_worker.transfer.listeners import listening_sockets

pytestmark = pytest.mark.slow

# 256x256: every band's activations are large enough that PyTorch's CPU convolution picks the
# kernel it picks for the whole frame (below ~20k elements per image it switches to its own
# im2col path, which sums in another order: docs/parallelism.md).
BIG_VIDEO = {**VIDEO, "size": "256x256", "num_inference_steps": 2}


def work_per_rank(log: str, kind: str) -> list[int]:
    found = re.findall(rf"{kind} work per rank \[([\d, ]+)\]", log)
    return [int(x) for x in found[-1].split(",")] if found else []


def run(model: Path, tmp: Path, fetch, role: Role, *flags: str) -> tuple[np.ndarray, str]:  # type: ignore[no-untyped-def]
    """One request through a deployment whose `role` runs `flags`; its pixels and that role's log."""
    role_flags = {role: ("--master-port", str(free_port_block(1)), *flags)} if flags else None
    with deployment(model, tmp, role_flags=role_flags) as dep:
        with dep.client(timeout=300) as c:
            pixels = fetch(c)
        return pixels, dep.workers(role)[0].log.read_text(errors="replace")


def test_two_rank_wan_decoder_gives_the_single_rank_pixels(tiny_models, tmp_path):
    fetch = functools.partial(http_video, request=BIG_VIDEO)
    single, _ = run(tiny_models["tiny-wan"], tmp_path / "one", fetch, Role.DECODER)
    pixels, log = run(tiny_models["tiny-wan"], tmp_path / "two", fetch, Role.DECODER, "--num-gpus", "2")
    assert pixels.shape == single.shape == (BIG_VIDEO["num_frames"], 256, 256, 3)
    assert np.array_equal(pixels, single), f"max pixel difference {np.abs(pixels.astype(int) - single).max()}"
    work = work_per_rank(log, "decode")
    assert len(work) == 2 and min(work) > 0 and work[0] == work[1], work


def rank_processes(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_a_pool_of_two_denoisers_of_two_cpu_ranks_each_from_the_specs_gpu_lists(tiny_models, tmp_path):
    # The spec's shape; device="cpu" runs each GPU list as that many CPU rank processes.
    with triptych_dev.launch_pool(
        tiny_models["tiny-flux"], denoiser_gpus=[[1, 2], [3, 4]], device="cpu", workdir=tmp_path
    ) as pool:
        denoisers = pool.deployment.workers(Role.DENOISER)
        assert len(denoisers) == 2
        assert [len(rank_processes(p.popen.pid)) for p in denoisers] == [1, 1]  # one follower rank each
        # Nothing of the ranks listens on every address: rank 0 binds the store's socket on 127.0.0.1
        # and hands it to torch.distributed (mesh.rendezvous_store), whose own would bind [::].
        for proc in denoisers:
            for pid in (proc.popen.pid, *rank_processes(proc.popen.pid)):
                wildcard = {(a, port) for a, port in listening_sockets(pid) if a in ("0.0.0.0", "::")}
                assert not wildcard, f"rank process {pid} listens on {wildcard}"
        with httpx.Client(base_url=pool.url, timeout=300) as c:
            health = c.get("/health").json()["workers"]["denoiser"]
            assert len(health) == 2 and all(w["alive"] for w in health)  # one instance per list, not per rank
            first, second = http_image(c, {**IMAGE, "n": 1}), http_image(c, {**IMAGE, "n": 1})
        logs = [p.log.read_text(errors="replace") for p in denoisers]
    assert np.array_equal(first, second)  # round robin: one image from each instance, the same pixels
    assert all("2 ranks joined" in log and work_per_rank(log, "attention") for log in logs), "a denoiser ran no job"


def test_launch_pool_disagg_server_runs_the_specs_example_as_written(tiny_models, tmp_path):
    # The design's Python API with its signature: ServeArgs.from_kwargs, then the <role>_gpus lists;
    # denoiser_sp reaches the denoisers only (the head would refuse it), the dispatch policy the head.
    script = tmp_path / "serve.py"
    script.write_text(
        "if __name__ == '__main__':\n"
        "    from triptych.config import ServeArgs\n"
        "    from triptych_dev.pool import launch_pool_disagg_server\n\n"
        f"    server_args = ServeArgs.from_kwargs(model_path={str(tiny_models['tiny-flux'])!r}, denoiser_sp=2,\n"
        "                                        device='cpu', disagg_dispatch_policy='max_free_slots')\n"
        "    launch_pool_disagg_server(server_args, encoder_gpus=[[0]], denoiser_gpus=[[1, 2]], decoder_gpus=[[0]])\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded by the pool's own ready timeout (300 s)
            lines.append(line)
            if line.startswith("triptych: serving on "):
                break
        url = lines[-1].split("serving on ", 1)[1].split()[0] if lines else ""
        assert url.startswith("http://"), "".join(lines[-30:])
        with httpx.Client(base_url=url, timeout=300) as c:
            health = c.get("/health").json()["workers"]
            assert [len(health[r]) for r in ("encoder", "denoiser", "decoder")] == [1, 1, 1]
            assert http_image(c, {**IMAGE, "n": 1}).shape[0] == 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
