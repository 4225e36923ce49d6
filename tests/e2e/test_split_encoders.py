"""Split encoders (prompt_encoder + image_encoder), started through the public `triptych_dev.launch_pool`.

Real processes on CPU with the tiny packages: text-to-image through the four-role topology
returns the pixels the three-role topology and stock diffusers return, and bypasses the image
encoder altogether.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import triptych_dev
from tests.e2e.test_pixels import IMAGE, http_image, stock_image
from triptych.roles import Role
from triptych_dev.localdeploy import local_deployment

pytestmark = pytest.mark.slow

CPU = [["cpu"]]


def metric(text: str, name: str, role: str) -> float:
    m = re.search(rf'^{name}\{{[^}}]*role="{role}"[^}}]*\}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _loaded(pool: triptych_dev.pool.Pool, role: str) -> tuple[str, int]:
    """What a worker process says it loaded (its log's `loaded NAMES (N parameters)`)."""
    (proc,) = pool.deployment.workers(Role(role))
    m = re.search(r"loaded (\S+) \((\d+) parameters\)", proc.log.read_text())
    assert m, proc.tail()
    return m.group(1), int(m.group(2))


def test_text_to_image_through_four_roles_equals_stock_and_skips_the_image_encoder(tiny_models, tmp_path):
    model = tiny_models["tiny-flux"]
    with triptych_dev.launch_pool(
        model, prompt_encoder_devices=CPU, image_encoder_devices=CPU, workdir=tmp_path
    ) as pool:
        client = pool.deployment.client(300)
        pixels = http_image(client)
        health = client.get("/health").json()["workers"]
        metrics = client.get("/metrics").text
    assert set(health) == {"prompt_encoder", "image_encoder", "denoiser", "decoder"}
    assert [w["dispatched"] for w in health["image_encoder"]] == [0]
    assert [w["dispatched"] for w in health["prompt_encoder"]] == [1]
    assert metric(metrics, "triptych_stage_seconds_count", "image_encoder") == 0
    assert metric(metrics, "triptych_stage_seconds_count", "prompt_encoder") == 1
    loaded = {role: _loaded(pool, role) for role in ("prompt_encoder", "image_encoder", "denoiser", "decoder")}
    assert loaded["prompt_encoder"][0] == "text_encoder,text_encoder_2,tokenizer,tokenizer_2"
    assert loaded["image_encoder"] == ("none", 0)  # tiny-flux takes no reference: nothing to load
    assert loaded["denoiser"][0] == "scheduler,transformer" and loaded["decoder"][0] == "vae"
    assert all(count > 0 for name, count in loaded.values() if name != "none")
    reference = stock_image(model)
    assert np.array_equal(pixels.reshape(reference.shape), reference), "pixels differ from stock diffusers"


def test_split_encoder_workers_started_before_the_head_serve_several_instances(tiny_models, tmp_path):
    """Any start order; two prompt encoders share the work under the dispatch policy."""
    model = tiny_models["tiny-flux"]
    counts = {Role.PROMPT_ENCODER: 2, Role.IMAGE_ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1}
    flags = ("--disagg-dispatch-policy", "round_robin")
    with local_deployment(
        model, tmp_path, counts, head_flags=flags, worker_flags=("--device", "cpu"), head_first=False
    ) as dep, dep.client(300) as client:  # fmt: skip
        body = {**IMAGE, "n": 1, "size": "32x32", "num_inference_steps": 2}
        for seed in (1, 2):
            r = client.post("/v1/images/generations", json={**body, "seed": seed})
            assert r.status_code == 200, r.text
        workers = client.get("/health").json()["workers"]
    assert sorted(w["dispatched"] for w in workers["prompt_encoder"]) == [1, 1]
    assert [w["dispatched"] for w in workers["image_encoder"]] == [0]
