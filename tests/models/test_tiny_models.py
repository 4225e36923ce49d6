"""The tiny packages are real diffusers packages: stock loading, requested sizes, determinism."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from triptych_dev.tiny_models import PACKAGES, STAMP_FILE, write_tiny_models

WIDTH, HEIGHT, FRAMES = 64, 48, 5


@pytest.fixture(scope="module")
def stock(tiny_models: dict[str, Path]) -> dict[str, DiffusionPipeline]:
    pipes = {}
    for name, path in tiny_models.items():
        pipe = DiffusionPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        pipes[name] = pipe
    return pipes


def generate(pipe: DiffusionPipeline, seed: int) -> np.ndarray:
    """uint8 [frames, H, W, 3]: PIL pixels for images, (x*255).round() of np frames for video."""
    common = dict(
        prompt="a cat sitting on a red chair",
        width=WIDTH,
        height=HEIGHT,
        num_inference_steps=2,
        max_sequence_length=16,
        generator=torch.Generator("cpu").manual_seed(seed),
    )
    if type(pipe).__name__ == "WanPipeline":
        frames = pipe(**common, num_frames=FRAMES, output_type="np").frames[0]
        return (frames * 255).round().astype(np.uint8)
    if type(pipe).__name__ == "FluxKontextPipeline":
        common["max_area"] = WIDTH * HEIGHT  # else Kontext rescales the request to ~1 megapixel
    return np.array(pipe(**common).images[0])[None]


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_package_loads_with_stock_diffusers_and_makes_the_requested_size(
    stock: dict[str, DiffusionPipeline], name: str
) -> None:
    pixels = generate(stock[name], seed=0)
    frames = FRAMES if name == "tiny-wan" else 1
    assert pixels.shape == (frames, HEIGHT, WIDTH, 3)
    assert pixels.std() > 0  # not a blank image


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_same_seed_gives_identical_bytes_and_another_seed_does_not(
    stock: dict[str, DiffusionPipeline], name: str
) -> None:
    first, again, other = generate(stock[name], 3), generate(stock[name], 3), generate(stock[name], 4)
    assert first.tobytes() == again.tobytes()
    assert first.tobytes() != other.tobytes()


def test_vae_scale_factors_differ_from_the_pipelines_fallback_of_8(tiny_models: dict[str, Path]) -> None:
    flux_vae = json.loads((tiny_models["tiny-flux"] / "vae" / "config.json").read_text())
    wan_vae = json.loads((tiny_models["tiny-wan"] / "vae" / "config.json").read_text())
    assert 2 ** (len(flux_vae["block_out_channels"]) - 1) == 4
    assert (wan_vae["scale_factor_spatial"], wan_vae["scale_factor_temporal"]) == (4, 4)


def file_digests(package: Path) -> dict[str, str]:
    return {
        str(p.relative_to(package)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(package.rglob("*"))
        if p.is_file()
    }


def test_writing_is_byte_identical_and_skips_a_current_package(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    (package,) = write_tiny_models(tmp_path, families=["tiny-wan"])
    assert file_digests(package) == file_digests(tiny_models["tiny-wan"])
    mtimes = {p: p.stat().st_mtime_ns for p in package.rglob("*")}
    assert write_tiny_models(tmp_path, families=["tiny-wan"]) == [package]
    assert {p: p.stat().st_mtime_ns for p in package.rglob("*")} == mtimes


def test_a_package_with_a_stale_stamp_is_rewritten(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    (package,) = write_tiny_models(tmp_path, families=["tiny-wan"])
    (package / STAMP_FILE).write_text("stale\n")
    (package / "model_index.json").write_text("{}")
    write_tiny_models(tmp_path, families=["tiny-wan"])
    assert file_digests(package) == file_digests(tiny_models["tiny-wan"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_unknown_package_names_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-sdxl"):
        write_tiny_models(tmp_path, families=["tiny-sdxl"])
