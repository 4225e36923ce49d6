"""What a denoising preview costs the denoiser: latents -> RGB projection -> PNG, per preview.

    python bench/preview_bench.py [--repeats N] [--models DIR]

Times LatentPreviewer.png (worker/triptych_worker/preview.py) on CPU tensors for the tiny models'
projections at the tiny test sizes and at full-size latent grids (FLUX 1024x1024: a 128x128 grid;
Wan 832x480x81: 21 latent frames of 60x104, one shown), and a 16-channel projection (FLUX.1 and
Wan2.1 VAEs have 16 latent channels) on the same grids.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from triptych.params import GenerationParams
from triptych_worker.adapters import adapter_for
from triptych_worker.preview import LatentPreviewer, LatentProjection, find_projection

ROOT = Path(__file__).resolve().parents[1]


def per_preview_ms(
    previewer: LatentPreviewer, latents: torch.Tensor, params: GenerationParams, repeats: int
) -> tuple[float, int]:
    previewer.png(latents, params)  # warm-up (PIL import)
    started = time.perf_counter()
    for _ in range(repeats):
        out = previewer.png(latents, params)
    return (time.perf_counter() - started) / repeats * 1e3, len(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=50, help="previews timed per case")
    p.add_argument("--models", type=Path, default=ROOT / ".models", help="the tiny packages (make models)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    cases = [
        ("tiny-flux", args.models / "tiny-flux", GenerationParams("x", 64, 64)),
        ("tiny-flux", args.models / "tiny-flux", GenerationParams("x", 1024, 1024)),
        ("tiny-wan", args.models / "tiny-wan", GenerationParams("x", 64, 64, num_frames=5)),
        ("tiny-wan", args.models / "tiny-wan", GenerationParams("x", 832, 480, num_frames=81)),
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
            # The denoiser makes the latents itself now (prepare_latents); the family rules give
            # their shape as the denoiser holds them, from the latent channels the grid also reads.
            adapter.rules.latent_channels = channels
            latents = torch.randn(*adapter.rules.latent_spec(params).shape)
            ms, size = per_preview_ms(LatentPreviewer(projection, adapter.latent_grid), latents, params, args.repeats)
            request = f"{params.width}x{params.height}" + (f"x{params.num_frames}" if params.num_frames > 1 else "")
            print(f"| {name} | {request} | {list(latents.shape)} | {channels} | {ms:.2f} | {size} |")


if __name__ == "__main__":
    main()
