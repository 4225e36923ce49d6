"""The model-family table: which diffusers pipelines Triptych serves and what it knows of each.

Pure Python (JSON configs only, no torch): the head reads it to describe the model and, with the
request contract (triptych.contract), to validate every request once at its door; workers pick
their adapter (the torch code) by the family's name; simulated workers take their tensor shapes
from it.

    read_model_info(path)             # the model card; ValueError naming the file / supported pipelines
    read_rules(path).validate(params) # ParamError (a ValueError) naming the field
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from triptych.contract import MAX_FRAMES, MAX_SIDE
from triptych.families.flux import FluxRules
from triptych.families.package import ModelPackage, PackageError
from triptych.families.rules import FamilyRules
from triptych.families.wan import WanRules
from triptych.step_cache import MODES


@dataclass(frozen=True)
class ModelFamily:
    name: str
    kind: Literal["image", "video"]
    default_steps: int  # defaults follow each family's stock pipeline __call__
    default_guidance: float
    rules: type[FamilyRules]


FAMILIES: dict[str, ModelFamily] = {
    "FluxPipeline": ModelFamily("flux", "image", 28, 3.5, FluxRules),
    "FluxKontextPipeline": ModelFamily("flux-kontext", "image", 28, 3.5, FluxRules),
    "WanPipeline": ModelFamily("wan", "video", 50, 5.0, WanRules),
}
"""model_index.json `_class_name` -> the family."""


@dataclass(frozen=True)
class ModelInfo:
    """What the head tells clients about the served model, the defaults it fills in, and the
    family's traits the request contract narrows its limits with (triptych.contract.ModelTraits)."""

    id: str
    pipeline_class: str
    kind: str  # "image" or "video"
    default_steps: int
    default_guidance: float
    edits: bool = False  # takes reference images (/v1/images/edits)
    size_multiple: int = 16  # width and height must be multiples of it
    max_steps: int = 1000  # the scheduler's timesteps
    frame_step: int = 1  # videos have 1 + k * frame_step frames
    max_side: int = MAX_SIDE  # the widest and tallest output in pixels
    max_frames: int = MAX_FRAMES  # the most frames of a video
    negative_prompt: bool = True  # takes a negative prompt (classifier-free guidance)
    step_cache_modes: tuple[str, ...] = tuple(MODES)  # the step cache modes it serves (triptych.step_cache)
    aliases: tuple[str, ...] = ()  # other ids a request may name it by (--model-path as given, hub id, ...)

    @property
    def names(self) -> tuple[str, ...]:
        """Every id a request's `model` may be, `id` first."""
        return (self.id, *(a for a in self.aliases if a != self.id))


def family_of(package: ModelPackage) -> ModelFamily:
    """The package's family; ValueError naming the pipeline and the supported ones."""
    family = FAMILIES.get(package.class_name)
    if family is None:
        raise PackageError(
            f"model path {package.path}: pipeline {package.class_name!r} is not supported; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return family


def read_model_info(model_path: str | Path, names: Sequence[str] = ()) -> ModelInfo:
    """The model card of the package at `model_path`, known by `names` (the first is its id; default:
    the folder's name); ValueError naming what is wrong with it."""
    package = ModelPackage.read(model_path)
    family = family_of(package)
    rules = family.rules(package)
    names = list(names) or [Path(model_path).resolve().name]
    return ModelInfo(
        id=names[0],
        aliases=tuple(names[1:]),
        pipeline_class=package.class_name,
        kind=family.kind,
        default_steps=family.default_steps,
        default_guidance=family.default_guidance,
        edits=rules.edits,
        size_multiple=rules.size_multiple,
        max_steps=rules.max_steps,
        frame_step=rules.frame_step,
        max_side=rules.max_side,
        max_frames=rules.max_frames,
        negative_prompt=rules.negative_prompt,
        step_cache_modes=rules.step_cache_modes,
    )


def read_rules(model_path: str | Path) -> FamilyRules:
    """The request rules and tensor shapes of the package at `model_path`, read from its configs."""
    package = ModelPackage.read(model_path)
    return family_of(package).rules(package)


__all__ = [
    "FAMILIES",
    "FamilyRules",
    "ModelFamily",
    "ModelInfo",
    "ModelPackage",
    "family_of",
    "read_model_info",
    "read_rules",
]
