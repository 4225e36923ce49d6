"""What a denoising preview costs the denoiser: latents -> RGB projection -> PNG, per preview.

    python bench/preview_bench.py

Times LatentPreviewer.png (worker/triptych_worker/preview.py) on CPU tensors for the tiny models'
projections at the tiny test sizes and at full-size latent grids (FLUX 1024x1024: a 128x128 grid;
Wan 832x480x81: 21 latent frames of 60x104, one shown), and a 16-channel projection (FLUX.1 and
Wan2.1 VAEs have 16 latent channels) on the same grids.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_worker.adapters import adapter_for
from triptych_worker.preview import LatentPreviewer, LatentProjection, find_projection

REPEATS = 50


def per_preview_ms(previewer: LatentPreviewer, latents: torch.Tensor, params: GenerationParams) -> tuple[float, int]:
    previewer.png(latents, params)  # warm-up (PIL import)
    started = time.perf_counter()
    for _ in range(REPEATS):
        out = previewer.png(latents, params)
    return (time.perf_counter() - started) / REPEATS * 1e3, len(out)


def main() -> None:
    rng = np.random.default_rng(0)
    cases = [
        ("tiny-flux", ".models/tiny-flux", GenerationParams("x", 64, 64)),
        ("tiny-flux", ".models/tiny-flux", GenerationParams("x", 1024, 1024)),
        ("tiny-wan", ".models/tiny-wan", GenerationParams("x", 64, 64, num_frames=5)),
        ("tiny-wan", ".models/tiny-wan", GenerationParams("x", 832, 480, num_frames=81)),
    ]
    print("| model | request | latents | channels | ms per preview | PNG bytes |")
    print("|---|---|---|---|---|---|")
    for name, path, params in cases:
        _, adapter = adapter_for(path)
        projection = find_projection(path)
        assert projection is not None, f"no projection for {path}"
        for channels in (projection.weights.shape[1], 16):
            if channels != projection.weights.shape[1]:
                projection = LatentProjection(
                    rng.normal(size=(3, channels)).astype(np.float32), np.zeros(3, np.float32)
                )
            adapter.latent_channels = channels  # the FLUX grid reads it
            # The encoder's outputs hold the initial latents, shaped as the denoiser holds them.
            spec = next(s for s in adapter.output_specs(Role.ENCODER, params) if s.name == "latents")
            shape = list(spec.shape)
            if name.endswith("flux"):
                shape[-1] = channels * 4
            else:
                shape[1] = channels
            latents = torch.randn(*shape)
            ms, size = per_preview_ms(LatentPreviewer(projection, adapter.latent_grid), latents, params)
            request = f"{params.width}x{params.height}" + (f"x{params.num_frames}" if params.num_frames > 1 else "")
            print(f"| {name} | {request} | {list(latents.shape)} | {channels} | {ms:.2f} | {size} |")


if __name__ == "__main__":
    main()
