"""Multi-device roles beyond the denoiser's sequence and CFG parallelism, on CPU (gloo), through the head.

`--decoder-sp 2` (Wan): the VAE decode split by bands of rows with halo exchange gives the
single-rank decoder's pixels byte for byte, and both ranks decoded an equal, non-zero share.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.harness import deployment
from tests.e2e.test_pixels import VIDEO, http_video
from triptych.localdeploy import free_port_block
from triptych.roles import Role

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
