"""Denoising previews: a low-resolution RGB picture of the current latents, cheap enough for every step.

Each latent pixel's channels map to RGB by a 3xC matrix and a bias (a linear projection), fitted
once offline from the model's VAE (`python -m triptych_worker.preview_fit`, which encodes
synthetic images and solves least squares between the latents and the images at latent
resolution). The projection stands in for the VAE decoder: one picture at the latent grid's size
(the image's size / the VAE's downsampling), no network run, encoded as a small PNG that travels
with the step's Progress message. For video the middle latent frame is shown.

Where a projection comes from, first match wins:
1. `<model path>/triptych_preview.json`, what `preview_fit --write` puts in a package;
2. one shipped in `previews/` whose `vae_config_sha256` is that of the package's `vae/config.json`
   (the tiny test models' fits).
Without one, requests still get their progress, without preview images.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from triptych.params import GenerationParams

log = logging.getLogger(__name__)

PACKAGE_FILE = "triptych_preview.json"
MAX_SIDE = 256  # larger latent grids are subsampled: bounds the cost and the PNG (well under PREVIEW_MAX_BYTES)
SHIPPED = Path(__file__).parent / "previews"

LatentGrid = Callable[[Any, GenerationParams], np.ndarray]
"""A family's view of its latents as one picture's channels: float32 [C, h, w]."""


@dataclass(frozen=True)
class LatentProjection:
    """rgb = weights @ latent_channels + bias, per latent pixel, in [0, 1]."""

    weights: np.ndarray  # float32 [3, C]
    bias: np.ndarray  # float32 [3]

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str) -> LatentProjection:
        try:
            weights = np.asarray(data["weights"], dtype=np.float32)
            bias = np.asarray(data["bias"], dtype=np.float32)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: not a latent preview projection ({exc})") from None
        if weights.ndim != 2 or weights.shape[0] != 3 or bias.shape != (3,):
            raise ValueError(f"{source}: weights must be [3, C] and bias [3], got {weights.shape} and {bias.shape}")
        return cls(weights, bias)

    def rgb(self, grid: np.ndarray) -> np.ndarray:
        """float [C, h, w] latents -> uint8 [h, w, 3]."""
        if grid.shape[0] != self.weights.shape[1]:
            raise ValueError(f"latents have {grid.shape[0]} channels, the projection {self.weights.shape[1]}")
        rgb = np.einsum("rc,chw->hwr", self.weights, grid.astype(np.float32)) + self.bias
        return (np.clip(rgb, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def png(image: np.ndarray) -> bytes:
    """uint8 [h, w, 3] as PNG (fastest zlib level: previews are small and short-lived)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def as_numpy(latents: Any) -> np.ndarray:
    """A torch tensor (on any device) or an array, as float32 numpy."""
    if hasattr(latents, "detach"):
        return np.asarray(latents.detach().float().cpu().numpy())
    return np.asarray(latents, dtype=np.float32)


@dataclass(frozen=True)
class LatentPreviewer:
    """Turns a denoiser's latents into a preview PNG."""

    projection: LatentProjection
    grid: LatentGrid

    def png(self, latents: Any, params: GenerationParams) -> bytes:
        grid = self.grid(latents, params)
        stride = -(-max(grid.shape[1:]) // MAX_SIDE)  # ceil
        return png(self.projection.rgb(grid[:, ::stride, ::stride]))


def vae_config_sha256(model_path: str | Path) -> str:
    return hashlib.sha256((Path(model_path) / "vae" / "config.json").read_bytes()).hexdigest()


def find_projection(model_path: str | Path) -> LatentProjection | None:
    """The package's own fitted projection, else a shipped one for its VAE, else None."""
    own = Path(model_path) / PACKAGE_FILE
    if own.is_file():
        return LatentProjection.from_json(json.loads(own.read_text()), str(own))
    try:
        digest = vae_config_sha256(model_path)
    except OSError:
        return None
    for path in sorted(SHIPPED.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("vae_config_sha256") == digest:
            return LatentProjection.from_json(data, str(path))
    log.info("no latent preview projection for %s (fit one: python -m triptych_worker.preview_fit)", model_path)
    return None


def should_preview(step: int, every: int, latents: Any) -> bool:
    return every > 0 and latents is not None and step % every == 0
