"""A diffusers package read through its JSON files only, and the request checks every family shares."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triptych.params import GenerationParams

# Guards against requests no deployment should attempt; model-specific rules come from the configs.
MAX_SIDE = 4096
MAX_OUTPUTS = 16
MAX_SEQUENCE_LENGTH = 512  # FluxPipeline rejects more; T5/UMT5 encoders were trained up to 512


@dataclass(frozen=True)
class ModelPackage:
    """A diffusers package on disk, read through its JSON files only."""

    path: Path
    index: dict[str, Any]

    @classmethod
    def read(cls, model_path: str | Path) -> ModelPackage:
        """Read model_index.json; raises ValueError naming the path when it is not a diffusers package."""
        path = Path(model_path)
        index_file = path / "model_index.json"
        try:
            index = json.loads(index_file.read_text())
        except FileNotFoundError:
            raise ValueError(f"model path {path}: no model_index.json (is it a diffusers package?)") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{index_file}: not valid JSON ({exc})") from None
        if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
            raise ValueError(f"{index_file}: no '_class_name'; not a diffusers model index")
        return cls(path=path, index=index)

    @property
    def class_name(self) -> str:
        return str(self.index["_class_name"])

    @property
    def components(self) -> tuple[str, ...]:
        """Component names the index declares, present ones and null ones alike."""
        return tuple(k for k, v in self.index.items() if not k.startswith("_") and isinstance(v, list))

    def present(self, component: str) -> bool:
        entry = self.index.get(component)
        return isinstance(entry, list) and entry[0] is not None

    def config(self, component: str) -> dict[str, Any]:
        """A component's config.json (scheduler_config.json for schedulers), without loading weights."""
        folder = self.path / component
        for name in ("config.json", "scheduler_config.json"):
            if (folder / name).is_file():
                return dict(json.loads((folder / name).read_text()))
        raise ValueError(f"model path {self.path}: component {component!r} has no config.json")


def check_common(params: GenerationParams, *, size_multiple: int, max_steps: int) -> None:
    """Checks every family shares; raises ValueError naming the field and the allowed values."""
    for field, value in (("width", params.width), ("height", params.height)):
        if not size_multiple <= value <= MAX_SIDE:
            raise ValueError(f"{field} {value} is out of range: this model needs {size_multiple}..{MAX_SIDE} pixels")
        if value % size_multiple:
            raise ValueError(
                f"{field} {value} is not a multiple of {size_multiple}, which this model needs "
                f"(VAE downsampling x transformer patch); try {value // size_multiple * size_multiple or size_multiple}"
            )
    if not 1 <= params.num_inference_steps <= max_steps:
        raise ValueError(f"num_inference_steps {params.num_inference_steps} must be between 1 and {max_steps}")
    if not 1 <= params.num_outputs <= MAX_OUTPUTS:
        raise ValueError(f"num_outputs {params.num_outputs} must be between 1 and {MAX_OUTPUTS}")
    if not (math.isfinite(params.guidance_scale) and params.guidance_scale >= 0):
        raise ValueError(f"guidance_scale {params.guidance_scale} must be a finite number >= 0")
    if not 1 <= params.max_sequence_length <= MAX_SEQUENCE_LENGTH:
        raise ValueError(
            f"max_sequence_length {params.max_sequence_length} must be between 1 and {MAX_SEQUENCE_LENGTH}"
        )
    if not 0 <= params.seed < 2**64:
        raise ValueError(f"seed {params.seed} must be between 0 and 2**64-1")


def lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)
