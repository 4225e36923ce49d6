"""GenerationParams: what one request asks for, as it travels from the API to every stage."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GenerationParams:
    prompt: str
    width: int
    height: int
    num_frames: int = 1
    num_inference_steps: int = 4
    guidance_scale: float = 3.5
    negative_prompt: str | None = None
    seed: int = 0
    num_outputs: int = 1
    max_sequence_length: int = 512  # the stock FLUX.1 and Wan2.1 default; changes the text embeddings

    def to_wire(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> GenerationParams:
        """Rebuild from a wire map; raises ValueError naming the field that is wrong."""
        unknown = sorted(set(raw) - _FIELDS.keys())
        if unknown:
            raise ValueError(f"unknown generation parameter(s): {', '.join(unknown)}")
        try:
            params = cls(**raw)
        except TypeError as exc:
            raise ValueError(f"generation parameters: {exc}") from None
        for name, expected in _FIELDS.items():
            value = getattr(params, name)
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(f"generation parameter {name!r} has invalid value {value!r}")
        return params


_WIRE_TYPES: dict[str, type | tuple[type, ...]] = {
    "str": str, "int": int, "float": (int, float), "str | None": (str, type(None)),
}  # fmt: skip
# Field name -> the Python types its wire value may have (bool never counts as a number).
_FIELDS = {f.name: _WIRE_TYPES[str(f.type)] for f in dataclasses.fields(GenerationParams)}
