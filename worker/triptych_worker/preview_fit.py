"""Fit a model's latent -> RGB preview projection from its VAE, once, offline.

    python -m triptych_worker.preview_fit --model-path /models/FLUX.1-dev --write

encodes synthetic images (smooth colour fields, gradients and blocks: every hue, dark to light)
with the package's VAE, brings the latents into the denoiser's space (the inverse of what the
decoder stage undoes: FLUX `(z - shift) * scale`, Wan `(z - mean) / std`), and solves least
squares between each latent pixel's channels and the image's mean colour over that pixel's
footprint. `--write` saves it as `<model path>/triptych_preview.json`, where workers find it
(preview.py); without it the JSON goes to stdout. Takes seconds on CPU for the tiny models,
about a minute for a real VAE at the default 256x256 (`--size`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from triptych_worker.adapters import adapter_for
from triptych_worker.preview import PACKAGE_FILE, vae_config_sha256


def synthetic_images(n: int, size: int, seed: int = 0) -> np.ndarray:
    """float32 [n, 3, size, size] in [0, 1]: smooth random colour fields, half of them with a flat block."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((n, 3, 4, 4), dtype=np.float32)
    reps = size // 4
    images = np.repeat(np.repeat(coarse, reps, axis=2), reps, axis=3)
    # Smooth the blocks into gradients with a box blur along each axis.
    kernel = np.ones(reps, dtype=np.float32) / reps
    for axis in (2, 3):
        images = np.apply_along_axis(lambda v: np.convolve(v, kernel, mode="same"), axis, images)
    half = size // 2
    for i in range(0, n, 2):
        images[i, :, :half, :half] = rng.random(3, dtype=np.float32)[:, None, None]
    return np.clip(images, 0.0, 1.0).astype(np.float32)


def _latents(family: str, model_path: str, images: np.ndarray) -> np.ndarray:
    """The denoiser-space latents of `images`, float32 [n, C, h, w]."""
    import diffusers
    import torch

    config = json.loads((Path(model_path) / "vae" / "config.json").read_text())
    vae = getattr(diffusers, config["_class_name"]).from_pretrained(Path(model_path) / "vae").eval()
    x = torch.from_numpy(images) * 2 - 1
    with torch.no_grad():
        if family == "wan":
            z = vae.encode(x[:, :, None]).latent_dist.mean[:, :, 0]  # one frame: [n, C, 1, h, w] -> [n, C, h, w]
            shape = (1, -1, 1, 1)
            mean = torch.tensor(vae.config.latents_mean).view(shape)
            std = torch.tensor(vae.config.latents_std).view(shape)
            z = (z - mean) / std
        else:
            z = vae.encode(x).latent_dist.mean
            z = (z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
    return np.asarray(z.float().numpy())


def fit(model_path: str, n: int = 64, size: int = 256) -> dict[str, Any]:
    """The projection (weights [3, C], bias [3]) and how well it fits (R^2 per colour channel)."""
    family, _ = adapter_for(model_path)
    images = synthetic_images(n, size)
    z = _latents("wan" if family == "wan" else "flux", model_path, images)
    _, c, h, w = z.shape
    f = size // h
    target = images.reshape(n, 3, h, f, w, f).mean(axis=(3, 5))  # each latent pixel's footprint
    x = np.concatenate([z.transpose(0, 2, 3, 1).reshape(-1, c), np.ones((n * h * w, 1), np.float32)], axis=1)
    y = target.transpose(0, 2, 3, 1).reshape(-1, 3)
    solution, *_ = np.linalg.lstsq(x.astype(np.float64), y.astype(np.float64), rcond=None)
    residual = y - x @ solution
    r2 = 1 - residual.var(axis=0) / y.var(axis=0)
    return {
        "family": family,
        "latent_channels": c,
        "weights": solution[:c].T.round(6).tolist(),
        "bias": solution[c].round(6).tolist(),
        "r2": r2.round(4).tolist(),
        "vae_config_sha256": vae_config_sha256(model_path),
        "fitted_from": f"{n} synthetic {size}x{size} images (python -m triptych_worker.preview_fit)",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triptych_worker.preview_fit", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="the diffusers package whose VAE to fit")
    parser.add_argument("--images", type=int, default=64, help="synthetic images to encode (default 64)")
    parser.add_argument("--size", type=int, default=256, help="their side in pixels (default 256)")
    parser.add_argument("--write", action="store_true", help=f"save as <model path>/{PACKAGE_FILE}")
    ns = parser.parse_args(argv)
    try:
        result = fit(ns.model_path, ns.images, ns.size)
    except (ValueError, OSError) as exc:
        print(f"preview_fit: error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=1) + "\n"
    if ns.write:
        out = Path(ns.model_path) / PACKAGE_FILE
        out.write_text(text)
        print(f"{out}: R^2 {result['r2']}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
