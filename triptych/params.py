"""GenerationParams: what one request asks for, as it travels from the API to every stage.

A msgspec Struct that the messages carry typed: the message decoder (protocol/codec.py) checks
every field of it, and rejects fields it does not know, wherever a request arrives.

A field at its default is not sent (omit_defaults): a process of the release before one that added a
field (a rolling upgrade: a new head, old workers) takes every request that does not use it, and
refuses, naming the field, one that does, rather than serving it without (other pixels). So a field
added here needs a default that means "as before".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from triptych.step_cache import NONE, StepCache, resolved


class LoraWeight(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One LoRA adapter a request names (triptych/lora.py), and the scale it applies it with."""

    name: str
    weight: float = 1.0


class GenerationParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
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
    # Image edits: the reference image, inlined by the head (the encoded file's bytes, never decoded
    # there), or an http(s) URL the image encoder fetches. Requests without one are text-to-image/video.
    image: bytes | None = None
    image_url: str | None = None
    # Step caching (triptych/step_cache.py): the denoiser applies the mode's diffusers hook for this request only.
    step_cache: str = NONE
    step_cache_threshold: float | None = None
    step_cache_interval: int | None = None
    # LoRA adapters (triptych/lora.py), in the order the request names them: the denoiser activates
    # them with these weights for this request only.
    loras: tuple[LoraWeight, ...] = ()

    @property
    def has_reference(self) -> bool:
        return self.image is not None or self.image_url is not None

    @property
    def resolved_step_cache(self) -> StepCache:
        """The request's step cache, its knob's default filled in (what the denoiser applies)."""
        return resolved(self.step_cache, self.step_cache_threshold, self.step_cache_interval)


_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(GenerationParams) if f.default is not msgspec.NODEFAULT}


def params_from(fields: Mapping[str, Any]) -> GenerationParams:
    """GenerationParams of `fields` (msgspec.convert: a request's LoRA adapters become LoraWeight), a value
    equal to its field's default left out: omit_defaults leaves out only the default object itself, so
    a default that arrived as a value (a client's "guidance_scale": 3.5, a model's default) would be
    sent, and refused by a process of the release before that field."""
    kept = {k: v for k, v in fields.items() if not _at_default(k, v)}
    return msgspec.convert(kept, GenerationParams)


def _at_default(name: str, value: Any) -> bool:
    default = _DEFAULTS.get(name, msgspec.NODEFAULT)
    return type(value) is type(default) and value == default
