"""A request's step cache is the stock pipeline with the same diffusers hook, and only that request's.

For each mode the family serves, on the tiny models on CPU: the pixels of a disaggregated
deployment and of monolithic mode equal the stock diffusers pipeline called with the same seed
after `pipe.transformer.enable_cache(the same config)`, byte for byte; a request without a cache
right after cached ones equals stock without one (the hooks were removed); /metrics counts what
each mode skipped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.e2e.harness import deployment
from tests.e2e.test_pixels import IMAGE, VIDEO, http_image, http_video
from triptych.families.wan import WanRules
from triptych.params import GenerationParams
from triptych_dev.localdeploy import local_monolithic

pytestmark = pytest.mark.slow

# A generous first_block threshold, so the tiny models' few steps skip something.
MODES: dict[str, dict[str, Any]] = {
    "first_block": {"step_cache": "first_block", "step_cache_threshold": 0.5},
    "pyramid_attention_broadcast": {"step_cache": "pyramid_attention_broadcast"},
    "taylorseer": {"step_cache": "taylorseer", "step_cache_interval": 2},
}
FAMILIES = {
    "flux-image": ("tiny-flux", {**IMAGE, "num_inference_steps": 6, "n": 1}, http_image, tuple(MODES)),
    "wan-video": ("tiny-wan", {**VIDEO, "num_inference_steps": 6}, http_video, WanRules.step_cache_modes),
}


def stock(model: Path, request: dict[str, Any]) -> np.ndarray:
    """What stock diffusers makes of `request`, its transformer carrying the request's cache hook."""
    from diffusers import DiffusionPipeline

    from triptych_worker.step_cache import hook_config

    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    w, h = map(int, request["size"].split("x"))
    knobs = {k: v for k, v in request.items() if k.startswith("step_cache")}
    cache = GenerationParams(prompt="", width=w, height=h, **knobs).resolved_step_cache
    if cache.on:
        pipe.transformer.enable_cache(hook_config(cache, lambda: pipe.current_timestep))
    generator = torch.Generator("cpu").manual_seed(request["seed"])
    common = {"width": w, "height": h, "num_inference_steps": request["num_inference_steps"],
              "guidance_scale": request["guidance_scale"], "generator": generator}  # fmt: skip
    if "num_frames" in request:
        out = pipe(request["prompt"], negative_prompt=request["negative_prompt"], num_frames=request["num_frames"],
                   output_type="np", **common)  # fmt: skip
        return np.asarray((out.frames[0] * 255).round().astype(np.uint8))
    out = pipe(request["prompt"], num_images_per_prompt=request["n"], output_type="pil", **common)
    return np.stack([np.array(img) for img in out.images])


def skipped_per_mode(client: Any, modes: tuple[str, ...]) -> dict[str, float]:
    """triptych_step_cache_skipped by mode in the head's /metrics, once every mode shows (within 10 s)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 10
    while True:
        skipped: dict[str, float] = {}
        for family in text_string_to_metric_families(client.get("/metrics").text):
            for sample in family.samples:
                if sample.name == "triptych_step_cache_skipped":
                    mode = sample.labels["mode"]
                    skipped[mode] = skipped.get(mode, 0.0) + sample.value
        if set(modes) <= set(skipped) or time.monotonic() > deadline:
            return skipped
        time.sleep(0.2)


def run_modes(client: Any, request: dict[str, Any], fetch: Any, modes: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Each mode's pixels, then a request without a cache after them ("none")."""
    out = {mode: fetch(client, {**request, **MODES[mode]}) for mode in modes}
    out["none"] = fetch(client, request)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_step_cache_mode_equals_stock_with_its_hook_disaggregated_and_monolithic(tiny_models, tmp_path, family):
    package, request, fetch, modes = FAMILIES[family]
    model = tiny_models[package]
    with deployment(model, tmp_path / "disagg") as dep, dep.client(timeout=300) as c:
        disagg = run_modes(c, request, fetch, modes)
        disagg_skipped = skipped_per_mode(c, modes)
    with local_monolithic(model, tmp_path / "mono", flags=("--device", "cpu")) as dep, dep.client(300) as c:
        mono = run_modes(c, request, fetch, modes)
        mono_skipped = skipped_per_mode(c, modes)
    for mode in (*modes, "none"):
        reference = stock(model, {**request, **MODES.get(mode, {})})
        assert np.array_equal(disagg[mode], mono[mode]), f"{mode}: disaggregated pixels differ from monolithic"
        assert np.array_equal(disagg[mode].reshape(reference.shape), reference), f"{mode}: pixels differ from stock"
    for mode in modes:
        assert not np.array_equal(disagg[mode], disagg["none"]), f"{mode} skipped nothing: the test proves nothing"
        assert disagg_skipped.get(mode, 0) > 0 and mono_skipped.get(mode, 0) > 0, (mode, disagg_skipped, mono_skipped)
