"""Role pipelines: the stages of one model, built for one role from stock diffusers components.

    pipeline = load_role_pipeline("/models/tiny-flux", Role.DENOISER)
    pipeline.run(batch)  # runs this role's stages in order, in place

A role instantiates only the stages whose affinity it runs and loads only the components those
stages use: the prompt encoder loads the text encoders only, the image encoder the VAE only (to
encode reference images), the denoiser the transformer and scheduler only, the decoder the VAE
only; the combined encoder runs both encoders' stages. What one role
hands the next travels in `batch.tensors` and `batch.meta` only (see each adapter's docstring for
the keys), so roles may run in different processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

from triptych.params import GenerationParams
from triptych.roles import WORKER_ROLES, Role
from triptych_worker.adapters import FamilyAdapter, adapter_for
from triptych_worker.encoder_cache import EncoderCache
from triptych_worker.preview import LatentPreviewer, find_projection, should_preview
from triptych_worker.stages import PIXELS, PipelineStage, StageBatch

if TYPE_CHECKING:
    import numpy as np
    import torch

PreviewProgress = Callable[[int, int, bytes], None]
"""Monolithic mode's progress: (step, total steps, preview PNG or b"")."""


class AdapterStage(PipelineStage):
    """A stage whose work the model family's adapter does."""

    def __init__(self, adapter: FamilyAdapter):
        self.adapter = adapter


class InputValidationStage(AdapterStage):
    role_affinity: ClassVar[Role] = Role.PROMPT_ENCODER

    def run(self, batch: StageBatch) -> None:
        self.adapter.validate(batch.params)


class TextEncodingStage(AdapterStage):
    """The text encoders, skipped for a prompt `cache` holds (encoder_cache.py); a hit adds the same
    tensors (copies) the encoders would."""

    role_affinity: ClassVar[Role] = Role.PROMPT_ENCODER

    def __init__(self, adapter: FamilyAdapter, cache: EncoderCache | None = None):
        super().__init__(adapter)
        self.cache = cache

    def run(self, batch: StageBatch) -> None:
        if self.cache is None:
            self.adapter.encode_text(batch)
            return
        key = (self.adapter.package.path, *self.adapter.text_encoding_key(batch.params))
        cached = self.cache.get(key)
        if cached is not None:
            batch.tensors.update(cached)
            return
        before = set(batch.tensors)
        self.adapter.encode_text(batch)
        added = {name: cast("torch.Tensor", t) for name, t in batch.tensors.items() if name not in before}
        self.cache.put(key, added)


class ImageEncodingStage(AdapterStage):
    """VAE encode of an edit's reference image; requests without one pass through untouched."""

    role_affinity: ClassVar[Role] = Role.IMAGE_ENCODER

    def run(self, batch: StageBatch) -> None:
        if batch.params.has_reference:
            self.adapter.encode_image(batch)


# The denoiser makes the noise from the request's seed and its own schedule, whichever encoders ran
# before it: the encoders hand on embeddings only, the same in the three- and four-role topologies.
class LatentPreparationStage(AdapterStage):
    role_affinity: ClassVar[Role] = Role.DENOISER

    def run(self, batch: StageBatch) -> None:
        self.adapter.prepare_latents(batch)


class TimestepPreparationStage(AdapterStage):
    role_affinity: ClassVar[Role] = Role.DENOISER

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
    ImageEncodingStage,
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
    def encoder_cache(self) -> EncoderCache | None:
        """The prompt-embedding cache of this role's text encoding, if it encodes prompts and keeps one."""
        return next((s.cache for s in self.stages if isinstance(s, TextEncodingStage) and s.cache is not None), None)

    @property
    def stage_names(self) -> list[str]:
        return [stage.name for stage in self.stages]

    @property
    def loaded_components(self) -> set[str]:
        """Names of the diffusers components this process holds in memory."""
        return self.adapter.loaded_components

    @property
    def parameter_count(self) -> int:
        """Parameters of the loaded torch modules (what this role holds in memory)."""
        if self.adapter.pipe is None:
            return 0
        modules = [c for c in self.adapter.pipe.components.values() if hasattr(c, "parameters")]
        return sum(p.numel() for module in modules for p in module.parameters())

    def describe(self) -> str:
        """One log line: the stages, the components loaded and their parameters."""
        components = ",".join(sorted(self.loaded_components)) or "none"
        return f"stages {','.join(self.stage_names)}; loaded {components} ({self.parameter_count} parameters)"

    def validate(self, params: GenerationParams) -> None:
        """Raise ValueError naming the field when this model cannot serve `params`."""
        self.adapter.validate(params)

    def generate(self, params: GenerationParams, on_progress: PreviewProgress, preview_every: int = 0) -> np.ndarray:
        """Monolithic mode's entry (triptych_head.backend.InProcessPipeline): every stage, pixels as numpy;
        `on_progress` after each denoising step, with a preview PNG every `preview_every` steps."""
        previewer = self.previewer() if preview_every else None

        def progress(step: int, total: int, latents: Any = None) -> None:
            preview = b""
            if previewer is not None and should_preview(step, preview_every, latents):
                preview = previewer.png(latents, params)
            on_progress(step, total, preview)

        batch = self.run(StageBatch(params=params, on_progress=progress))
        return cast("torch.Tensor", batch.tensors[PIXELS]).cpu().numpy()

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


def load_role_pipeline(model_path: str, role: Role, device: str = "cpu", encoder_cache_bytes: int = 0) -> RolePipeline:
    """Build `role`'s stages for the diffusers package at `model_path`, loading only their weights;
    its text encoding keeps up to `encoder_cache_bytes` of prompt embeddings (0: no cache).

    Raises ValueError for an unsupported pipeline class or a role this family has no stages for.
    """
    role = Role(role)
    family, adapter = adapter_for(model_path, device)
    stage_classes = [stage for stage in STAGES if role.runs_affinity(stage.role_affinity)]
    if not stage_classes:
        raise ValueError(
            f"--disagg-role {role.value}: the {family} pipeline has no stages for this role; "
            f"use one of monolithic, {', '.join(r.value for r in WORKER_ROLES)}"
        )
    components: set[str] = set()
    for stage in stage_classes:
        components |= adapter.components_for(stage.__name__)
    adapter.load(components)
    cache = EncoderCache(encoder_cache_bytes) if encoder_cache_bytes else None
    stages: list[PipelineStage] = [
        TextEncodingStage(adapter, cache) if s is TextEncodingStage else s(adapter) for s in stage_classes
    ]
    return RolePipeline(family=family, role=role, stages=stages, adapter=adapter)
