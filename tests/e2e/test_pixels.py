"""Correctness is pixels: disaggregated (four processes) == monolithic (one process) == stock diffusers.

Same request, same seed, on CPU, byte for byte, for FLUX (image) and Wan (video).
"""

from __future__ import annotations

import base64
import io
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.e2e.harness import deployment
from triptych.roles import Role
from triptych_dev.localdeploy import local_monolithic

pytestmark = pytest.mark.slow

IMAGE = {"prompt": "a lighthouse at dusk", "size": "64x48", "seed": 1234, "num_inference_steps": 3,
         "guidance_scale": 3.5, "n": 2}  # fmt: skip
VIDEO = {"prompt": "waves on a beach", "negative_prompt": "blurry", "size": "48x32", "num_frames": 5, "seed": 99,
         "num_inference_steps": 3, "guidance_scale": 5.0, "fps": 8}  # fmt: skip


def stock_image(model: Path, request: dict = IMAGE, device: str = "cpu", dtype: str = "float32") -> np.ndarray:
    """What stock diffusers' own __call__ makes of an images request (IMAGE's fields, all given)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model, dtype=getattr(torch, dtype)).to(device)
    w, h = map(int, request["size"].split("x"))
    out = pipe(
        request["prompt"], width=w, height=h, num_inference_steps=request["num_inference_steps"],
        guidance_scale=request["guidance_scale"], num_images_per_prompt=request["n"],
        generator=torch.Generator("cpu").manual_seed(request["seed"]), output_type="pil",
    )  # fmt: skip
    return np.stack([np.array(img) for img in out.images])


def stock_video(model: Path, device: str = "cpu", request: dict = VIDEO, dtype: str = "float32") -> np.ndarray:
    """What stock diffusers' own __call__ makes of a videos request (VIDEO's fields, all given)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model, dtype=getattr(torch, dtype)).to(device)
    pipe.set_progress_bar_config(disable=True)
    w, h = map(int, request["size"].split("x"))
    out = pipe(
        request["prompt"], negative_prompt=request["negative_prompt"], width=w, height=h,
        num_frames=request["num_frames"], num_inference_steps=request["num_inference_steps"],
        guidance_scale=request["guidance_scale"], generator=torch.Generator("cpu").manual_seed(request["seed"]),
        output_type="np",
    )  # fmt: skip
    return (out.frames[0] * 255).round().astype(np.uint8)


def http_image(client, request: dict = IMAGE) -> np.ndarray:
    r = client.post("/v1/images/generations", json=request)
    assert r.status_code == 200, r.text
    return np.stack([np.array(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in r.json()["data"]])


def http_video(client, request: dict = VIDEO) -> np.ndarray:
    job = client.post("/v1/videos", json=request).json()
    deadline = time.monotonic() + 300
    while job["status"] not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.1)
        job = client.get(f"/v1/videos/{job['id']}").json()
    assert job["status"] == "completed", job.get("error") or job
    z = zipfile.ZipFile(io.BytesIO(client.get(f"/v1/videos/{job['id']}/content", params={"variant": "frames"}).content))
    return np.stack([np.array(Image.open(io.BytesIO(z.read(n)))) for n in sorted(z.namelist())])


def monolithic(model: Path, tmp: Path, fetch, device: str = "cpu", flags: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    with local_monolithic(model, tmp / "mono", flags=("--device", device, *flags)) as dep, dep.client(300) as c:
        return fetch(c)


@pytest.mark.parametrize(
    ("package", "fetch", "stock"),
    [("tiny-flux", http_image, stock_image), ("tiny-wan", http_video, stock_video)],
    ids=["flux-image", "wan-video"],
)
def test_disaggregated_equals_monolithic_equals_stock_diffusers(tiny_models, tmp_path, package, fetch, stock):
    model = tiny_models[package]
    with deployment(model, tmp_path / "disagg") as dep, dep.client(timeout=300) as c:
        disagg = fetch(c)
        roles = {role: len(dep.workers(role)) for role in (Role.ENCODER, Role.DENOISER, Role.DECODER)}
    assert roles == {Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1}
    mono = monolithic(model, tmp_path, fetch)
    reference = stock(model)
    assert disagg.dtype == np.uint8 and disagg.shape == mono.shape
    assert np.array_equal(disagg, mono), "disaggregated pixels differ from monolithic"
    assert np.array_equal(disagg.reshape(reference.shape), reference), "pixels differ from stock diffusers"


def test_bfloat16_workers_equal_bfloat16_monolithic_and_stock_diffusers_with_a_float32_decoder_too(
    tiny_models, tmp_path
):
    """`--dtype` through `triptych serve`: every worker and monolithic mode in bfloat16 give the stock bfloat16
    pipeline's pixels; a float32 decoder under bfloat16 roles (Wan's recipe) gives other pixels, still an image."""
    model, bf16 = tiny_models["tiny-flux"], ("--dtype", "bfloat16")
    with deployment(model, tmp_path / "disagg", worker_flags=bf16) as dep, dep.client(timeout=300) as c:
        disagg = http_image(c)
        log = dep.workers(Role.DENOISER)[0].log.read_text(errors="replace")
    assert "in bfloat16" in log  # what the worker says it loaded
    assert np.array_equal(disagg, monolithic(model, tmp_path, http_image, flags=bf16)), "differ from monolithic"
    assert np.array_equal(disagg, stock_image(model, dtype="bfloat16")), "differ from stock diffusers in bfloat16"
    assert not np.array_equal(disagg, stock_image(model)), "bfloat16 made the float32 pixels: proves nothing"
    mixed = {Role.DECODER: ("--dtype", "float32")}
    with deployment(model, tmp_path / "mixed", worker_flags=bf16, role_flags=mixed) as dep, dep.client(300) as c:
        assert http_image(c).shape == disagg.shape
        workers = c.get("/health").json()["workers"]  # what each says it computes in
    dtypes = {role: [(i["devices"], i["dtype"]) for i in instances] for role, instances in workers.items()}
    assert dtypes == {"encoder": [(1, "bfloat16")], "denoiser": [(1, "bfloat16")], "decoder": [(1, "float32")]}


def encoder_cache_counts(client, at_least: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(hits, misses) of every encoder's prompt-embedding cache in the head's /metrics, once the
    heartbeats have reported `at_least` encodings (within 10 s)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 10
    while True:
        counts = dict.fromkeys(("triptych_encoder_cache_hits", "triptych_encoder_cache_misses"), 0.0)
        for family in text_string_to_metric_families(client.get("/metrics").text):
            for sample in family.samples:
                if sample.name in counts:
                    counts[sample.name] += sample.value
        hits, misses = counts.values()
        if hits + misses >= at_least or time.monotonic() > deadline:
            return hits, misses
        time.sleep(0.2)


def test_concurrent_requests_on_several_instances_each_get_their_own_pixels(tiny_models, tmp_path):
    """2 encoders, 2 denoisers, 1 decoder, real model: no request ever receives another's tensors."""
    import concurrent.futures

    from triptych.params import GenerationParams
    from triptych_worker.pipeline import load_role_pipeline
    from triptych_worker.stages import PIXELS, StageBatch

    model = tiny_models["tiny-flux"]
    seeds = list(range(6))
    body = {"prompt": "a lighthouse at dusk", "size": "32x32", "num_inference_steps": 2}
    flags = ("--disagg-dispatch-policy", "max_free_slots")
    with deployment(model, tmp_path, encoders=2, denoisers=2, head_flags=flags) as dep, dep.client(300) as c:
        with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
            responses = list(pool.map(lambda s: c.post("/v1/images/generations", json={**body, "seed": s}), seeds))
        workers = c.get("/health").json()["workers"]
        hits, misses = encoder_cache_counts(c, at_least=len(seeds))
    assert all(min(w["dispatched"] for w in workers[role]) > 0 for role in ("encoder", "denoiser")), workers
    # One prompt: each encoder ran its text encoders once, then served its cache, through the same transfers.
    assert misses == 2 and hits == len(seeds) - 2, (hits, misses)
    mono = load_role_pipeline(str(model), Role.MONOLITHIC, "cpu")
    for seed, r in zip(seeds, responses, strict=True):
        assert r.status_code == 200, r.text
        got = np.array(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
        params = GenerationParams(prompt=body["prompt"], width=32, height=32, num_inference_steps=2, seed=seed,
                                  guidance_scale=3.5)  # fmt: skip
        expected = mono.run(StageBatch(params)).tensors[PIXELS][0, 0].numpy()
        assert np.array_equal(got, expected), f"seed {seed}: pixels are not its own"
