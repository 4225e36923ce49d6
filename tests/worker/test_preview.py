"""Denoising previews: the families' latent grids, the projection, where a projection is found,
and the shipped tiny-model constants being what the fit script makes."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_worker.adapters import adapter_for
from triptych_worker.pipeline import load_role_pipeline
from triptych_worker.preview import (
    MAX_SIDE,
    PACKAGE_FILE,
    SHIPPED,
    LatentPreviewer,
    LatentProjection,
    find_projection,
)


def test_the_flux_grid_is_diffusers_unpacking_of_the_first_output(tiny_models):
    from diffusers import FluxPipeline

    _, adapter = adapter_for(str(tiny_models["tiny-flux"]))
    params = GenerationParams("x", width=64, height=48)
    packed = torch.randn(2, (48 // 8) * (64 // 8), 4 * 4)
    expected = FluxPipeline._unpack_latents(packed, 48, 64, 4)[0].numpy()
    np.testing.assert_array_equal(adapter.latent_grid(packed, params), expected)


def test_the_wan_grid_is_the_middle_latent_frame_of_the_first_video(tiny_models):
    _, adapter = adapter_for(str(tiny_models["tiny-wan"]))
    latents = torch.randn(2, 4, 3, 8, 10)
    grid = adapter.latent_grid(latents, GenerationParams("x", width=40, height=32, num_frames=9))
    np.testing.assert_array_equal(grid, latents[0, :, 1].numpy())


def test_the_projection_maps_channels_to_rgb_and_clips():
    projection = LatentProjection(np.array([[1, 0], [0, 1], [0.5, 0.5]], np.float32), np.array([0, 0.5, 0], np.float32))
    grid = np.array([[[0.2, 2.0]], [[0.4, -1.0]]], np.float32)  # C=2, h=1, w=2
    assert projection.rgb(grid).tolist() == [[[51, 230, 77], [255, 0, 128]]]
    with pytest.raises(ValueError, match="3 channels, the projection 2"):
        projection.rgb(np.zeros((3, 1, 1), np.float32))


def test_a_package_s_own_projection_wins_and_a_shipped_one_matches_only_its_vae(tiny_models, tmp_path):
    shipped = find_projection(tiny_models["tiny-flux"])
    assert shipped is not None and shipped.weights.shape == (3, 4)
    package = tmp_path / "pkg"
    (package / "vae").mkdir(parents=True)
    shutil.copy(tiny_models["tiny-flux"] / "vae" / "config.json", package / "vae" / "config.json")
    np.testing.assert_array_equal(find_projection(package).weights, shipped.weights)  # same VAE config
    own = {"weights": [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]], "bias": [0, 0, 0]}
    (package / PACKAGE_FILE).write_text(json.dumps(own))
    np.testing.assert_array_equal(find_projection(package).weights, np.array(own["weights"], np.float32))
    (package / PACKAGE_FILE).unlink()
    (package / "vae" / "config.json").write_text('{"latent_channels": 16}')  # another VAE
    assert find_projection(package) is None


def test_a_preview_is_a_png_of_the_latent_grid_and_large_grids_are_subsampled(tiny_models):
    pipeline = load_role_pipeline(str(tiny_models["tiny-wan"]), Role.DENOISER)
    previewer = pipeline.previewer()
    assert isinstance(previewer, LatentPreviewer)
    small = Image.open(io.BytesIO(previewer.png(torch.randn(1, 4, 2, 12, 20), GenerationParams("x", 80, 48))))
    assert small.size == (20, 12) and small.mode == "RGB"
    big = Image.open(io.BytesIO(previewer.png(torch.randn(1, 4, 1, 300, 600), GenerationParams("x", 2400, 1200))))
    assert max(big.size) <= MAX_SIDE and big.size == (200, 100)  # every third latent pixel
    assert load_role_pipeline(str(tiny_models["tiny-wan"]), Role.DECODER).previewer() is None


def test_the_shipped_tiny_flux_projection_is_what_the_fit_script_makes(tiny_models):
    from triptych_worker.preview_fit import fit

    shipped = json.loads((SHIPPED / "tiny-flux.json").read_text())
    assert fit(str(tiny_models["tiny-flux"]), n=64, size=64) == shipped
