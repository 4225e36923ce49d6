"""On a CUDA GPU: the pixel tests of test_pixels.py with every process on the GPU, and the ranks on NCCL.

Skipped without CUDA; `scripts/gpu-check.sh` (`make gpu-check`) runs them on a GPU machine.
The reference is stock diffusers on the same GPU (its noise from a CPU generator, as ours), in
bfloat16 as `--dtype auto` loads the workers there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.e2e.harness import deployment
from tests.e2e.test_parallel_ranks import RING_PIXEL_TOLERANCE, TP_PIXEL_TOLERANCE, denoiser_flags
from tests.e2e.test_parallel_roles import BIG_VIDEO
from tests.e2e.test_pixels import http_image, http_video, monolithic, stock_image, stock_video
from triptych.roles import Role
from triptych_dev.localdeploy import free_port_block

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = ("--device", "cuda")
PACKAGES = [("tiny-flux", http_image, stock_image), ("tiny-wan", http_video, stock_video)]


@pytest.mark.parametrize(("package", "fetch", "stock"), PACKAGES, ids=["flux-image", "wan-video"])
def test_disaggregated_equals_monolithic_equals_stock_diffusers_on_cuda(tiny_models, tmp_path, package, fetch, stock):
    model = tiny_models[package]
    with deployment(model, tmp_path / "disagg", worker_flags=CUDA) as dep, dep.client(timeout=300) as c:
        disagg = fetch(c)
    mono = monolithic(model, tmp_path, fetch, device="cuda")
    reference = stock(model, device="cuda", dtype="bfloat16")  # --dtype auto on a GPU
    assert np.array_equal(disagg, mono), "disaggregated pixels differ from monolithic on CUDA"
    assert np.array_equal(disagg.reshape(reference.shape), reference), "pixels differ from stock diffusers on CUDA"


# cuBLAS may pick other kernels for a rank's share of the rows or heads, so on a GPU the bound is the
# ring's (Ulysses) or the all-reduce's (TP), not bitwise.
NCCL_DENOISERS = [("--denoiser-ulysses", RING_PIXEL_TOLERANCE), ("--denoiser-tp", TP_PIXEL_TOLERANCE)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank each)")
@pytest.mark.parametrize(("package", "fetch", "stock"), PACKAGES, ids=["flux-image", "wan-video"])
@pytest.mark.parametrize(("degree", "tolerance"), NCCL_DENOISERS, ids=["ulysses2", "tp2"])
def test_two_rank_denoiser_on_nccl_matches_one_gpu(tiny_models, tmp_path, package, fetch, stock, degree, tolerance):
    model = tiny_models[package]
    with deployment(model, tmp_path / "one", worker_flags=CUDA) as dep, dep.client(timeout=300) as c:
        single = fetch(c)
    flags = denoiser_flags("--num-gpus", "2", degree, "2")
    with deployment(model, tmp_path / "two", worker_flags=CUDA, role_flags=flags) as dep, dep.client(300) as c:
        pixels = fetch(c)
    diff = np.abs(pixels.astype(np.int16) - single.astype(np.int16))
    assert diff.max() <= tolerance, f"2 NCCL ranks ({degree} 2) differ from one GPU by {diff.max()} levels"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank each)")
def test_two_rank_wan_decoder_on_nccl_matches_one_gpu(tiny_models, tmp_path):
    model = tiny_models["tiny-wan"]

    def fetch(c):  # type: ignore[no-untyped-def]
        return http_video(c, BIG_VIDEO)

    with deployment(model, tmp_path / "one", worker_flags=CUDA) as dep, dep.client(timeout=300) as c:
        single = fetch(c)
    flags = {Role.DECODER: ("--master-port", str(free_port_block(1)), "--num-gpus", "2")}
    with deployment(model, tmp_path / "two", worker_flags=CUDA, role_flags=flags) as dep, dep.client(300) as c:
        pixels = fetch(c)
    # cuDNN picks its convolution algorithm by shape, so a band may sum in another order than the whole frame.
    diff = np.abs(pixels.astype(np.int16) - single.astype(np.int16))
    assert diff.max() <= 1, f"2 NCCL decoder ranks differ from one GPU by {diff.max()} levels"
