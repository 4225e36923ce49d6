"""GenerationParams: what one request asks for, as it travels from the API to every stage.

A msgspec Struct that the messages carry typed: the message decoder (protocol/codec.py) checks
every field of it, and rejects fields it does not know, wherever a request arrives.
"""

from __future__ import annotations

import msgspec


class GenerationParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
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

    @property
    def has_reference(self) -> bool:
        return self.image is not None or self.image_url is not None
