"""Request and response models of the HTTP API (the API contract)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_SIDE = 4096
SIZE_RE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
MAX_SEED = 2**63 - 1


def parse_size(size: str) -> tuple[int, int]:
    m = SIZE_RE.fullmatch(size)
    if not m:
        raise ValueError(f"size {size!r} must be WIDTHxHEIGHT, e.g. 1024x1024")
    w, h = int(m.group(1)), int(m.group(2))
    if not (16 <= w <= MAX_SIDE and 16 <= h <= MAX_SIDE):
        raise ValueError(f"size {size!r}: width and height must be between 16 and {MAX_SIDE}")
    return w, h


class _Generation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Served model id (optional; there is one per deployment)")
    prompt: str = Field(..., min_length=1, max_length=20_000)
    negative_prompt: str | None = Field(None, max_length=20_000)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Same seed, same pixels")
    num_inference_steps: int | None = Field(None, ge=1, le=500)
    guidance_scale: float | None = Field(None, ge=0, le=100)
    preview_every: int = Field(
        0, ge=0, le=500, description="Progress events carry a low-resolution preview every k denoising steps (0: none)"
    )

    @field_validator("*")
    @classmethod
    def _encodable(cls, v: object) -> object:
        # JSON allows lone surrogates ("\ud800"); they cannot be encoded to reach the workers.
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
        return v

    @field_validator("size", check_fields=False)
    @classmethod
    def _size(cls, v: str) -> str:
        parse_size(v)
        return v


class ImageGenerationRequest(_Generation):
    size: str = "1024x1024"
    n: int = Field(1, ge=1, le=8)
    response_format: Literal["b64_json", "url"] = "b64_json"
    stream: bool = Field(False, description="Answer with Server-Sent Events: progress, previews, then the result")
    # Accepted for OpenAI client compatibility; they do not change the output.
    quality: str | None = None
    style: str | None = None
    user: str | None = None


class ImageEditRequest(_Generation):
    """The text fields of a multipart POST /v1/images/edits; `image` is a file part (inlined into the
    request) or, as text, an http(s) URL the image encoder fetches."""

    size: str | None = Field(
        None, description="WIDTHxHEIGHT; omitted: the reference's own size, cropped to the model's multiple"
    )
    n: int = Field(1, ge=1, le=8)
    response_format: Literal["b64_json", "url"] = "b64_json"
    stream: bool = Field(False, description="Answer with Server-Sent Events: progress, previews, then the result")
    image_url: str | None = Field(None, max_length=4096)
    user: str | None = None
    quality: str | None = None


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None


class ImageGenerationResponse(BaseModel):
    created: int
    data: list[ImageData]


class VideoGenerationRequest(_Generation):
    size: str = "832x480"
    num_frames: int = Field(81, ge=1, le=1025)
    fps: int = Field(16, ge=1, le=120)
    user: str | None = None


VideoStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]


class VideoJob(BaseModel):
    id: str
    object: Literal["video"] = "video"
    model: str
    status: VideoStatus
    progress: int = Field(0, description="Percent of denoising steps done")
    step: int = 0
    total_steps: int = 0
    state: str = "PENDING"
    created_at: int
    completed_at: int | None = None
    size: str
    num_frames: int
    fps: int
    seed: int
    error: dict[str, str | None] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "triptych"
    pipeline: str
    kind: str
    edits: bool = Field(False, description="Takes a reference image: POST /v1/images/edits serves it")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
