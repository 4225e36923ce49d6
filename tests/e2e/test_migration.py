"""Drain by migration (docs/design.md "Migration"): SIGTERM to a denoiser in the middle of a video
hands the request to another denoiser at its next step boundary; the video completes with the
pixels of a run that never moved, and the drained denoiser exits long before the video would
have finished there.
"""

from __future__ import annotations

import concurrent.futures
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.harness import deployment
from tests.e2e.test_pixels import http_video, stock_video
from triptych.roles import Role
from triptych_dev.localdeploy import Proc

pytestmark = pytest.mark.slow

# Long enough that three moves happen well before the video ends: each takes about a second of wall
# clock (the draining heartbeat, the head's ask, a step, the transfer), and a step of this video is
# ~0.02-0.1 s by load (a 48x32 one's was 0.01 s on an idle host: 400 of them ended after two moves).
STEPS = 500  # the contract's most
VIDEO = {"prompt": "waves on a beach", "negative_prompt": "blurry", "size": "96x64", "num_frames": 9, "seed": 99,
         "num_inference_steps": STEPS, "guidance_scale": 5.0, "fps": 8}  # fmt: skip


@pytest.fixture(scope="module")
def stock(tiny_models: dict[str, Path]) -> np.ndarray:
    """What stock diffusers makes of VIDEO, which a disaggregated run matches byte for byte (test_pixels)."""
    return stock_video(tiny_models["tiny-wan"], request=VIDEO)


def _denoising_on(c, video: concurrent.futures.Future, other_than: str | None = None, timeout: float = 120) -> str:
    """The denoiser the (only) request is denoising on, once it is (on another than `other_than`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert not video.done(), "the video ended before this move"
        for rec in c.get("/v1/pipeline").json()["requests"]:
            if rec["state"] == "DENOISING_RUNNING" and rec["instance"] and rec["instance"] != other_than:
                return str(rec["instance"])
        time.sleep(0.05)
    raise AssertionError(f"the video never denoised on a denoiser other than {other_than}")


def _metric(c, name: str, label: str = "") -> float:
    """The sum of a metric's samples (those with `label` among their labels)."""
    total = 0.0
    for line in c.get("/metrics").text.splitlines():
        sample, _, value = line.rpartition(" ")
        if re.fullmatch(rf"{name}(\{{.*\}})?", sample) and label in sample:
            total += float(value)
    return total


def _drain(victim: Proc) -> tuple[int, float]:
    """SIGTERM, then its exit status and how long after the signal it exited."""
    started = time.monotonic()
    victim.popen.send_signal(signal.SIGTERM)
    code = victim.popen.wait(120)
    return code, time.monotonic() - started


@pytest.mark.parametrize("moves", [1, 3])
def test_sigterm_to_a_denoiser_mid_video_moves_the_video_which_completes_with_unmoved_pixels(
    tiny_models, tmp_path, stock, moves: int
) -> None:
    """One more denoiser than moves: each SIGTERM goes to the denoiser the video is on now."""
    with deployment(tiny_models["tiny-wan"], tmp_path, denoisers=moves + 1) as dep, dep.client(600) as c:
        with concurrent.futures.ThreadPoolExecutor(1 + moves) as pool:
            video = pool.submit(http_video, c, VIDEO)
            exits: list[concurrent.futures.Future[tuple[int, float]]] = []
            first_seen = time.monotonic()
            url = None
            for _ in range(moves):  # the next move as soon as the video runs elsewhere, not after the exit
                url = _denoising_on(c, video, other_than=url)
                time.sleep(0.3)  # a few steps in
                victim = next(p for p in dep.workers(Role.DENOISER) if p.url == url)
                exits.append(pool.submit(_drain, victim))
            frames = video.result(timeout=600)
            drained = [done.result(timeout=120) for done in exits]
        total = time.monotonic() - first_seen
        assert np.array_equal(frames.reshape(stock.shape), stock), "pixels differ from a video that never moved"
        assert [code for code, _ in drained] == [0] * moves
        # Each drain took a step and a transfer (and the process's exit), not the rest of the video.
        assert all(seconds < total / 2 for _, seconds in drained), (drained, total)
        assert _metric(c, "triptych_migrations_total") == moves
        assert _metric(c, "triptych_requests_total", 'state="FAILED"') == 0
        assert _metric(c, "triptych_retries_total") == 0
