"""Role pipelines: the stages of one model, built for one role from stock diffusers components.

    pipeline = load_role_pipeline("/models/tiny-flux", Role.DENOISER)
    pipeline.run(batch)  # runs this role's stages in order, in place

A role instantiates only the stages whose affinity it runs and loads only the components those
stages use: the encoder never loads the transformer or the VAE, the denoiser never loads text
encoders or the VAE, the decoder never loads the transformer or text encoders. What one role
hands the next travels in `batch.tensors` and `batch.meta` only (see each adapter's docstring for
the keys), so roles may run in different processes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_worker.adapters import FamilyAdapter, adapter_for
from triptych_worker.preview import LatentPreviewer, find_projection
from triptych_worker.stages import PipelineStage, StageBatch


class AdapterStage(PipelineStage):
    """A stage whose work the model family's adapter does."""

    def __init__(self, adapter: FamilyAdapter):
        self.adapter = adapter


class InputValidationStage(AdapterStage):
    def run(self, batch: StageBatch) -> None:
        self.adapter.validate(batch.params)


class TextEncodingStage(AdapterStage):
    def run(self, batch: StageBatch) -> None:
        self.adapter.encode_text(batch)


class LatentPreparationStage(AdapterStage):
    def run(self, batch: StageBatch) -> None:
        self.adapter.prepare_latents(batch)


class TimestepPreparationStage(AdapterStage):
    def run(self, batch: StageBatch) -> None:
        self.adapter.prepare_timesteps(batch)


class DenoisingStage(AdapterStage):
    role_affinity: ClassVar[Role] = Role.DENOISER

    def run(self, batch: StageBatch) -> None:
        self.adapter.denoise(batch)


class DecodingStage(AdapterStage):
    role_affinity: ClassVar[Role] = Role.DECODER

    def run(self, batch: StageBatch) -> None:
        self.adapter.decode(batch)


STAGES: tuple[type[AdapterStage], ...] = (
    InputValidationStage,
    TextEncodingStage,
    LatentPreparationStage,
    TimestepPreparationStage,
    DenoisingStage,
    DecodingStage,
)
"""Every family's stages, in pipeline order."""


@dataclass
class RolePipeline:
    """The stages one role runs, over one loaded model."""

    family: str
    role: Role
    stages: list[PipelineStage]
    adapter: FamilyAdapter

    @property
    def stage_names(self) -> list[str]:
        return [stage.name for stage in self.stages]

    @property
    def loaded_components(self) -> set[str]:
        """Names of the diffusers components this process holds in memory."""
        return self.adapter.loaded_components

    def validate(self, params: GenerationParams) -> None:
        """Raise ValueError naming the field when this model cannot serve `params`."""
        self.adapter.validate(params)

    def previewer(self) -> LatentPreviewer | None:
        """What turns this role's latents into preview PNGs: None when it does not denoise or no
        projection was fitted for the model (preview.py)."""
        if not any(isinstance(stage, DenoisingStage) for stage in self.stages):
            return None
        projection = find_projection(self.adapter.package.path)
        return None if projection is None else LatentPreviewer(projection, self.adapter.latent_grid)

    def run(self, batch: StageBatch) -> StageBatch:
        """Run this role's stages in order on `batch` (in place) and return it."""
        import torch

        with torch.no_grad():
            for stage in self.stages:
                stage.run(batch)
        return batch


def load_role_pipeline(model_path: str, role: Role, device: str = "cpu") -> RolePipeline:
    """Build `role`'s stages for the diffusers package at `model_path`, loading only their weights.

    Raises ValueError for an unsupported pipeline class or a role this family has no stages for.
    """
    role = Role(role)
    family, adapter = adapter_for(model_path, device)
    stage_classes = [stage for stage in STAGES if role.runs_affinity(stage.role_affinity)]
    if not stage_classes:
        raise ValueError(
            f"--disagg-role {role.value}: the {family} pipeline has no stages for this role; "
            f"use one of monolithic, encoder, denoiser, decoder"
        )
    components: set[str] = set()
    for stage in stage_classes:
        components |= adapter.stage_components.get(stage.__name__, frozenset())
    adapter.load(components)
    return RolePipeline(family=family, role=role, stages=[stage(adapter) for stage in stage_classes], adapter=adapter)


def validate_for_model(model_path: str, params: GenerationParams) -> None:
    """Check `params` against the package's configs without loading weights or importing torch.

    Raises ValueError naming the field (or the unsupported pipeline) when the model cannot serve it.
    """
    _config_only_adapter(model_path).validate(params)


@functools.cache
def _config_only_adapter(model_path: str) -> FamilyAdapter:
    """An adapter that has read the package's configs once and loads nothing (the head's hot path)."""
    return adapter_for(model_path)[1]
