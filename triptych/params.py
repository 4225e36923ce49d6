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
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> GenerationParams:
        """Rebuild from a wire map; raises ValueError naming the field that is wrong."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"unknown generation parameter(s): {', '.join(unknown)}")
        try:
            params = cls(**raw)
        except TypeError as exc:
            raise ValueError(f"generation parameters: {exc}") from None
        for f in dataclasses.fields(cls):
            value = getattr(params, f.name)
            expected = {"str": str, "int": int, "float": (int, float), "str | None": (str, type(None))}[str(f.type)]
            if not isinstance(value, expected) or isinstance(value, bool):  # type: ignore[arg-type]
                raise ValueError(f"generation parameter {f.name!r} has invalid value {value!r}")
        return params
