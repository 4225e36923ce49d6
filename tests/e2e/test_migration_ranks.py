"""Migration and preemption of a multi-rank denoiser (`--num-gpus 2` on CPU: two rank processes,
gloo; docs/design.md "Migration", "Priority and preemption"): every rank stops at the same step
boundary, rank 0 stages the whole state, and the request continues on a one-rank peer (drain) or
on the same two ranks (suspended, resumed in place) with the pixels of stock diffusers.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.harness import deployment
from tests.e2e.test_migration import VIDEO, _denoising_on, _drain, _metric
from tests.e2e.test_migration import stock as stock  # the fixture: what stock diffusers makes of VIDEO
from tests.e2e.test_parallel_ranks import followers_of, wait_gone
from tests.e2e.test_pixels import http_video, stock_video
from tests.e2e.test_preemption import ONE_DENOISER_SLOT, _streamed_image, _video_steps
from triptych.roles import Role

pytestmark = pytest.mark.slow

TWO_RANKS_THEN_ONE = {Role.DENOISER: [["cpu", "cpu"], ["cpu"]]}  # Ulysses 2 (derived from the heads), then 1 rank
# The image arrives about a second after the video's second step, ~0.03-0.1 s each on two CPU ranks:
# well before the video's last.
LOW_VIDEO = {**VIDEO, "num_inference_steps": 250, "priority": "low"}


@pytest.fixture(scope="module")
def stock_low(tiny_models: dict[str, Path]) -> np.ndarray:
    return stock_video(tiny_models["tiny-wan"], request=LOW_VIDEO)


def test_sigterm_to_a_two_rank_denoiser_mid_video_moves_it_to_a_one_rank_peer_with_unmoved_pixels(
    tiny_models, tmp_path, stock
) -> None:
    with deployment(tiny_models["tiny-wan"], tmp_path, denoisers=2, devices=TWO_RANKS_THEN_ONE) as dep:
        two = dep.workers(Role.DENOISER)[0]
        _, followers = followers_of(dep)
        assert len(followers) == 1
        with dep.client(600) as c, concurrent.futures.ThreadPoolExecutor(2) as pool:
            video = pool.submit(http_video, c, VIDEO)
            first_seen = time.monotonic()
            assert _denoising_on(c, video) == two.url  # round robin: the first request to the first denoiser
            time.sleep(0.3)  # a few steps in
            drained = pool.submit(_drain, two)
            frames = video.result(timeout=600)
            code, seconds = drained.result(timeout=120)
            total = time.monotonic() - first_seen
            print(f"the 2-rank denoiser drained in {seconds:.2f}s; the video took {total:.2f}s from its first step")
            assert np.array_equal(frames.reshape(stock.shape), stock), "pixels differ from a video that never moved"
            assert code == 0
            # A step and a transfer (and the process's exit), not the rest of the video on two ranks.
            assert seconds < total / 2, (seconds, total)
            assert wait_gone(followers, 10), "the drained denoiser's follower outlived it"
            assert _metric(c, "triptych_migrations_total") == 1
            assert _metric(c, "triptych_requests_total", 'state="FAILED"') == 0
            assert _metric(c, "triptych_retries_total") == 0
        log = two.log.read_text(errors="replace")
    assert "out of step" not in log and "rank 1 exited" not in log


def test_a_high_image_suspends_a_low_video_on_a_two_rank_denoiser_which_resumes_in_place(
    tiny_models, tmp_path, stock_low
) -> None:
    """One two-rank denoiser with one slot: the image takes it within about a step of the video,
    which resumes there afterwards (its state never left rank 0's pool) with stock pixels."""
    devices = {Role.DENOISER: [["cpu", "cpu"]]}
    with deployment(tiny_models["tiny-wan"], tmp_path, role_flags=ONE_DENOISER_SLOT, devices=devices) as dep:
        with dep.client(600) as c, concurrent.futures.ThreadPoolExecutor(2) as pool:
            video = pool.submit(http_video, c, LOW_VIDEO)
            _, step_s = _video_steps(c)
            image = pool.submit(_streamed_image, dep.http).result(timeout=300)
            frames = video.result(timeout=600)
            ended = time.monotonic()
            assert "completed" in image, image
            waited = image["DENOISING_RUNNING"] - image["DENOISING_WAITING"]
            print(f"video step {step_s * 1e3:.1f} ms; the image waited {waited * 1e3:.1f} ms for the denoiser")
            assert waited < 3 * step_s + 1.0, f"the image waited {waited:.2f}s; a video step: {step_s:.3f}s"
            assert image["completed"] < ended, "the image finished after the video it arrived behind"
            assert np.array_equal(frames.reshape(stock_low.shape), stock_low), "the suspended video's pixels differ"
            assert _metric(c, "triptych_suspensions_total") == 1
            assert _metric(c, "triptych_resumptions_total") == 1
            assert _metric(c, "triptych_migrations_total") == 0  # resumed in place: nothing moved
            assert _metric(c, "triptych_requests_total", 'state="FAILED"') == 0
            assert _metric(c, "triptych_retries_total") == 0
        assert dep.workers(Role.DENOISER)[0].popen.poll() is None
