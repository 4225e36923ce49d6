"""Step caching: the modes a request may ask for, what each takes, and their bounds (pure Python).

A step cache reuses work of earlier denoising steps instead of recomputing it: diffusers' cache
hooks on the transformer (`diffusers.hooks`), applied by the denoiser for one request (or one
batch of the same mode) and removed after it (triptych_worker/step_cache.py). The request contract
(triptych/contract.py) declares the three request fields from these tables; the head checks them
at its door, the workers build the diffusers config from `resolved`.

    step_cache            none (default) | first_block | pyramid_attention_broadcast | taylorseer (FLUX.1)
    step_cache_threshold  first_block only: how far the first block's residual may move and the
                          rest of the transformer still be skipped (diffusers' default 0.05)
    step_cache_interval   pyramid_attention_broadcast, taylorseer: compute in full once every N
                          (N-1 reuses in between)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NONE = "none"
THRESHOLD = "step_cache_threshold"
INTERVAL = "step_cache_interval"
MIN_THRESHOLD, MAX_THRESHOLD = 0.0, 1.0  # a relative change of the first block's residual; 1: nearly always reuse
MIN_INTERVAL, MAX_INTERVAL = 2, 16  # 1 would reuse nothing; beyond 16 every image is a blur of its first steps


@dataclass(frozen=True)
class StepCacheMode:
    """One mode: the diffusers hook it applies and the knob it takes (with its default)."""

    name: str
    hook: str  # the diffusers config class (diffusers.hooks)
    doc: str
    knob: str  # THRESHOLD or INTERVAL
    default: float


MODES: dict[str, StepCacheMode] = {
    m.name: m
    for m in (
        StepCacheMode(
            "first_block",
            "FirstBlockCacheConfig",
            "runs the first transformer block every step and skips the others (reusing their last residual) "
            "while its output moves less than step_cache_threshold",
            THRESHOLD,
            0.05,
        ),
        StepCacheMode(
            "pyramid_attention_broadcast",
            "PyramidAttentionBroadcastConfig",
            "reuses each self-attention's output for step_cache_interval - 1 calls out of step_cache_interval, "
            "for timesteps between 100 and 800",
            INTERVAL,
            2,
        ),
        StepCacheMode(
            "taylorseer",
            "TaylorSeerCacheConfig",
            "after 3 full steps, computes the attention layers once every step_cache_interval steps and "
            "predicts them in between from a first-order Taylor expansion",
            INTERVAL,
            5,
        ),
    )
}
"""The modes Triptych serves: diffusers' cache hooks that need no per-model calibration (MagCache
needs a model's magnitude ratios) and give the stock pipeline's pixels when the stock pipeline has
the same hook (tests/e2e/test_step_cache.py). A family serves those that apply to its transformer
(FamilyRules.step_cache_modes): taylorseer's default patterns find no attention in Wan2.1's."""

CHOICES = (NONE, *MODES)


@dataclass(frozen=True)
class StepCache:
    """A request's step cache with its knob resolved: what the denoiser applies and batches by."""

    mode: str = NONE
    threshold: float | None = None
    interval: int | None = None

    @property
    def on(self) -> bool:
        return self.mode != NONE


def resolved(mode: str, threshold: float | None, interval: int | None) -> StepCache:
    """The request's fields with the mode's default filled in (the knobs of other modes dropped)."""
    spec = MODES.get(mode)
    if spec is None:
        return StepCache()
    if spec.knob == THRESHOLD:
        return StepCache(mode, threshold=float(spec.default if threshold is None else threshold))
    return StepCache(mode, interval=int(spec.default if interval is None else interval))


def check_knobs(values: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field, why) when a knob is given that the request's mode does not take, else None."""
    mode = values.get("step_cache") or NONE
    spec = MODES.get(mode)
    for knob in (THRESHOLD, INTERVAL):
        if values.get(knob) is None or (spec is not None and spec.knob == knob):
            continue
        takers = ", ".join(m.name for m in MODES.values() if m.knob == knob)
        return knob, f"{knob} applies to step_cache {takers} only, not {mode}; leave it out or choose one of those"
    return None
