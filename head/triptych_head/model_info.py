"""What the head needs to know about the served model without loading any weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelInfo:
    id: str
    pipeline_class: str
    kind: str  # "image" or "video"
    default_steps: int
    default_guidance: float


# Defaults follow each family's stock pipeline __call__.
_FAMILIES: dict[str, tuple[str, int, float]] = {
    "FluxPipeline": ("image", 28, 3.5),
    "FluxKontextPipeline": ("image", 28, 3.5),
    "WanPipeline": ("video", 50, 5.0),
}


def read_model_info(model_path: str) -> ModelInfo:
    """Read model_index.json; raises ValueError naming the file and the supported pipelines."""
    index = Path(model_path) / "model_index.json"
    try:
        class_name = json.loads(index.read_text())["_class_name"]
    except FileNotFoundError:
        raise ValueError(f"--model-path {model_path}: no model_index.json (is it a diffusers package?)") from None
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{index}: not a diffusers model index ({exc})") from None
    if class_name not in _FAMILIES:
        raise ValueError(f"{index}: pipeline {class_name!r} is not supported; supported: {sorted(_FAMILIES)}")
    kind, steps, guidance = _FAMILIES[class_name]
    return ModelInfo(
        id=Path(model_path).resolve().name,
        pipeline_class=class_name,
        kind=kind,
        default_steps=steps,
        default_guidance=guidance,
    )
