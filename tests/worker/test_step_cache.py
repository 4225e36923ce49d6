"""The denoiser's step cache (worker/triptych_worker/step_cache.py): one request's hook, removed after it
whatever happens, and counted."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from triptych.parallelism import Parallelism
from triptych.params import GenerationParams, LoraWeight
from triptych.roles import Role
from triptych_worker.parallel.families import check_request
from triptych_worker.pipeline import load_role_pipeline
from triptych_worker.stages import PIXELS, StageBatch

REQUEST = GenerationParams("a lighthouse", width=32, height=32, num_inference_steps=4, seed=3)
FIRST_BLOCK = msgspec.structs.replace(REQUEST, step_cache="first_block", step_cache_threshold=1.0)


@pytest.fixture(scope="module")
def mono(tiny_models):  # type: ignore[no-untyped-def]
    return load_role_pipeline(str(tiny_models["tiny-flux"]), Role.MONOLITHIC, "cpu")


def pixels(pipeline, params: GenerationParams, on_progress=None) -> np.ndarray:  # type: ignore[no-untyped-def]
    batch = StageBatch(params, on_progress=on_progress) if on_progress else StageBatch(params)
    return pipeline.run(batch).tensors[PIXELS].numpy()


def test_a_request_s_hook_is_removed_even_when_its_denoising_fails(mono) -> None:  # type: ignore[no-untyped-def]
    plain = pixels(mono, REQUEST)

    def fail(step: int, total: int, latents: object = None) -> None:
        if step == 2:
            raise RuntimeError("cancelled mid-loop")

    with pytest.raises(RuntimeError, match="cancelled mid-loop"):
        pixels(mono, FIRST_BLOCK, fail)
    assert not mono.adapter.pipe.transformer.is_cache_enabled
    assert np.array_equal(pixels(mono, REQUEST), plain)


def test_skips_are_counted_per_mode_and_none_counts_nothing(mono) -> None:  # type: ignore[no-untyped-def]
    before = {s.mode: s for s in mono.step_cache.stats()}.get("first_block")
    pixels(mono, FIRST_BLOCK)
    pixels(mono, REQUEST)
    after = {s.mode: s for s in mono.step_cache.stats()}
    assert set(after) == {"first_block"}
    stats, old = after["first_block"], before or type(after["first_block"])("first_block")
    # 2 attentions (one double, one single block) x 4 steps; threshold 1: every step after the first skips the tail.
    assert (stats.requests - old.requests, stats.computed - old.computed, stats.skipped - old.skipped) == (1, 5, 3)


def test_every_multi_device_denoiser_takes_step_caches_and_adapters(mono) -> None:  # type: ignore[no-untyped-def]
    """Every degree takes a step cache and LoRA adapters (tests/worker/test_ranks_adapters.py runs them;
    TP ranks load their shards of an adapter)."""
    with_adapter = msgspec.structs.replace(FIRST_BLOCK, loras=(LoraWeight("flux-ink", 1.0),))
    for degrees in (Parallelism(sp=2, ulysses=2), Parallelism(cfg=2), Parallelism(tp=2)):
        check_request(mono.adapter, "flux", with_adapter, degrees)
