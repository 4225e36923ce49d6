"""Request and response models of the HTTP API.

The request models are built from the request contract (triptych.contract), one per endpoint;
FastAPI's OpenAPI schema follows from them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, computed_field, create_model, field_validator

from triptych import lora
from triptych.contract import CONTRACT, EDITS, IMAGES, MAX_SIDE, MIN_SIDE, VIDEOS, Contract, RequestParam
from triptych_head.state import RequestState

SIZE_RE = re.compile(r"^([0-9]{1,5})x([0-9]{1,5})$")  # ASCII: \d also takes fullwidth and Arabic-Indic digits


def parse_size(size: str) -> tuple[int, int]:
    m = SIZE_RE.fullmatch(size)
    if not m:
        raise ValueError(f"size {size[:80]!r} must be WIDTHxHEIGHT, e.g. 1024x1024")
    w, h = int(m.group(1)), int(m.group(2))
    if not (MIN_SIDE <= w <= MAX_SIDE and MIN_SIDE <= h <= MAX_SIDE):
        raise ValueError(f"size {size!r}: width and height must be between {MIN_SIDE} and {MAX_SIDE}")
    return w, h


@functools.cache
def _kinds(model: type[BaseModel], name: str) -> frozenset[Any]:
    """The types a field of `model` takes (int, float, bool, str, None, ...)."""
    annotation = model.model_fields[name].annotation
    return frozenset(get_args(annotation) or (annotation,))


class BooleansApart(BaseModel):
    """A model whose numbers take no JSON true or false, and whose booleans no number."""

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_and_numbers_apart(cls, v: object, info: ValidationInfo) -> object:
        # pydantic's lax mode reads a JSON true as 1 and a 0 or 1 as false or true; neither is what the
        # client wrote. A form's text ("1", "true") is still read as the field's type.
        kinds = _kinds(cls, str(info.field_name))
        if isinstance(v, bool) and kinds & {int, float}:
            raise ValueError(f"must be a number, not {str(v).lower()}")
        if isinstance(v, int | float) and not isinstance(v, bool) and bool in kinds:
            raise ValueError(f"must be true or false, not {v!r}")
        return v


class RequestBody(BooleansApart):
    """A request's JSON body (or an edit's form fields); each endpoint's model adds the contract's
    parameters it takes (request_model)."""

    model_config = ConfigDict(extra="forbid")

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

    @field_validator("loras", mode="before", check_fields=False)
    @classmethod
    def _loras_from_text(cls, v: object) -> object:
        # An edit's multipart form carries text fields only: there, `loras` is the JSON array as text.
        # pydantic's parser, not json.loads: it refuses deep nesting with a ValueError, where json.loads
        # recurses into a RecursionError (a 500, and it unsettles CPython 3.11; direct.py). TypeError:
        # text it cannot encode (a lone surrogate).
        if isinstance(v, str):
            try:
                return pydantic_core.from_json(v)
            except (ValueError, TypeError):
                raise ValueError('must be a JSON array such as [{"name": "ink", "weight": 0.8}]') from None
        return v

    @field_validator("size", check_fields=False)
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is None:
            return None
        width, height = parse_size(v)
        return f"{width}x{height}"  # as a video job stores and answers it: "0032x0032" is "32x32"


class LoraChoice(BooleansApart):
    """One LoRA adapter a request names (triptych.lora)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, description="An adapter of the deployment's catalogue")
    weight: float = Field(
        1.0, ge=lora.MIN_WEIGHT, le=lora.MAX_WEIGHT, allow_inf_nan=False, description="Its scale (1: as trained)"
    )


def _field(param: RequestParam, endpoint: str) -> tuple[Any, Any]:
    """The pydantic annotation and Field of `param` on `endpoint`, with the contract's own limits
    (the served family's narrower ones are checked at the door: context.HeadContext.params_for)."""
    lim = param.limits
    annotation: Any = Literal[lim.choices] if lim.choices else param.type
    if param.type is list:
        annotation = list[LoraChoice]
    default: Any = ... if param.required else param.default_for(endpoint)
    if param.name == "image":
        default = None  # an edit's URL; the file part arrives beside the form's text fields (reference.py)
    if default is None:
        annotation = annotation | None
    numeric = param.type in (int, float)  # size's limits are its sides': parse_size checks them
    bounds: dict[str, Any] = {
        "ge": lim.minimum if numeric else None,
        "le": lim.maximum if numeric else None,
        "min_length": lim.min_length,
        "max_length": lim.max_length,
        # nan is no more "over the maximum" than under it: pydantic says it is not a finite number
        "allow_inf_nan": False if param.type is float else None,
    }
    return annotation, Field(default, description=param.doc, **{k: v for k, v in bounds.items() if v is not None})


def request_model(name: str, endpoint: str, contract: Contract = CONTRACT) -> type[RequestBody]:
    """The pydantic model of `endpoint`'s request: the parameters of `contract` it takes."""
    fields: dict[str, Any] = {p.name: _field(p, endpoint) for p in contract.taken_by(endpoint)}
    model: type[RequestBody] = create_model(name, __base__=RequestBody, **fields)
    model.__doc__ = f"The body of POST {endpoint}."
    return model


@dataclass(frozen=True)
class RequestModels:
    """The request models of the three generating endpoints, built from one contract."""

    images: type[RequestBody]
    edits: type[RequestBody]
    videos: type[RequestBody]

    @classmethod
    def build(cls, contract: Contract = CONTRACT) -> RequestModels:
        return cls(
            images=request_model("ImageGenerationRequest", IMAGES, contract),
            edits=request_model("ImageEditRequest", EDITS, contract),
            videos=request_model("VideoGenerationRequest", VIDEOS, contract),
        )


MODELS = RequestModels.build()
ImageGenerationRequest = MODELS.images
ImageEditRequest = MODELS.edits
VideoGenerationRequest = MODELS.videos


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None


class ImageGenerationResponse(BaseModel):
    created: int
    data: list[ImageData]
    seed: int = Field(
        description="The seed the images were made with: the request's, or the one the head drew when it gave "
        "none; the same request with this seed makes the same pixels"
    )


VideoStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]


class VideoJob(BaseModel):
    id: str
    object: Literal["video"] = "video"
    model: str
    status: VideoStatus
    progress: int = Field(0, description="Percent of denoising steps done")
    step: int = 0
    total_steps: int = 0
    state: str = RequestState.PENDING.value
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = Field(
        None,
        description="When the ended job and its content are removed (--results-max-age after its end, within a "
        "minute; sooner when --results-max-bytes needs the room)",
    )
    size: str
    num_frames: int
    fps: int
    seed: int
    error: dict[str, str | None] | None = None
    restarts: int = Field(
        0, description="Times another head took the job over after its head died, and ran it again from the start"
    )
    estimated_completion_seconds: float | None = Field(
        None,
        description="Seconds from its creation the head estimated, when it accepted the job, that it would take "
        "to complete: the work ahead of it and its own (none in monolithic mode)",
    )

    @computed_field(description="How long the video lasts, num_frames / fps, as text (as OpenAI's video object has it)")  # type: ignore[prop-decorator]
    @property
    def seconds(self) -> str:
        return f"{self.num_frames / self.fps:g}"


class DeletedVideo(VideoJob):
    """The answer to DELETE /v1/videos/{id}: the job as it ended, and whether it is gone."""

    deleted: bool = Field(
        description="true: the job and its content are deleted (as OpenAI's answer says); false: it was running, "
        "and is now cancelled (delete it again to remove it)"
    )


class VideoList(BaseModel):
    """A page of video jobs, as OpenAI's list of videos: pass `last_id` as `after` for the next one."""

    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None = Field(description="The first job's id on this page (none when it is empty)")
    last_id: str | None = Field(description="The last job's id on this page: `after` for the next page")
    has_more: bool = Field(description="Whether more jobs follow this page")


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
