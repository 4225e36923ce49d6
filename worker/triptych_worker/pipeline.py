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

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

from triptych.lora import BadAdapter, LoraCatalog
from triptych.params import GenerationParams, LoraWeight
from triptych.protocol.tensors import Array
from triptych.roles import WORKER_ROLES, Role
from triptych_worker.adapters import FamilyAdapter, adapter_for
from triptych_worker.batching import run_in_turn, run_merged, split
from triptych_worker.encoder_cache import EncoderCache
from triptych_worker.lora import LoraAdapters
from triptych_worker.preview import LatentPreviewer, find_projection, should_preview
from triptych_worker.resume import ADAPTERS, RESUME, CannotResume, check_adapter_sources
from triptych_worker.stages import PIXELS, PipelineStage, StageBatch
from triptych_worker.step_cache import StepCaching

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger(__name__)

PreviewProgress = Callable[[int, int, bytes], None]
"""Monolithic mode's progress: (step, total steps, preview PNG or b"")."""


class AdapterStage(PipelineStage):
    """A stage whose work the model family's adapter does."""

    def __init__(self, adapter: FamilyAdapter):
        self.adapter = adapter


class BatchedAdapterStage(AdapterStage):
    """A stage that runs several compatible requests as one forward (`run_batched`).

    Should the batched forward fail (an out-of-memory, say), each request runs again alone, so
    that one bad request fails only itself; its progress then restarts from step 1. Not on a rank of
    a multi-device role (`retry_alone` off): a failure there may be one rank's alone, and a rank
    running requests alone while the others wait in the batch's collectives would never meet them
    again, so the failure goes up and takes the instance down (parallel/ranks.py). Adapters that do
    not load (BadAdapter: on a rank, every rank agrees on it first) fail every request of the group,
    which shares them, and are not retried; so does, on a rank, a continuation that cannot be resumed
    or a state that cannot be captured (CannotResume: every rank raises it at the same point).
    """

    retry_alone = True

    def run_many(self, batches: list[StageBatch]) -> list[Exception | None]:
        if len(batches) == 1:
            return super().run_many(batches)
        try:
            return self.run_batched(batches)
        except BadAdapter as exc:  # the group shares its adapters: alone, each would fail the same way
            return [exc] * len(batches)
        except Exception as exc:
            if self.retry_alone:
                log.exception("batched %s over %d requests failed; running them one by one", self.name, len(batches))
                return super().run_many(batches)
            if isinstance(exc, CannotResume):  # raised by every rank at the same point: still in step, and
                return [exc] * len(batches)  # the group, which cannot be split over them, fails together
            raise

    def run_batched(self, batches: list[StageBatch]) -> list[Exception | None]:
        return run_merged(batches, self.adapter.shared_tensors, self.run)


class InputValidationStage(AdapterStage):
    role_affinity: ClassVar[Role] = Role.PROMPT_ENCODER

    def run(self, batch: StageBatch) -> None:
        self.adapter.validate(batch.params)


class TextEncodingStage(BatchedAdapterStage):
    """The text encoders, over a batch's prompts as one forward, with the text-encoder part of the
    request's LoRA adapters active (lora.py: a merged batch shares its adapters, triptych.batching); a
    prompt `cache` holds (encoder_cache.py) skips them and gets the same tensors (copies) the encoders
    would. Its key names the adapters applied, so an embedding is never reused across adapter sets."""

    role_affinity: ClassVar[Role] = Role.PROMPT_ENCODER

    def __init__(self, adapter: FamilyAdapter, cache: EncoderCache | None = None, loras: LoraAdapters | None = None):
        super().__init__(adapter)
        self.cache = cache
        self.loras = loras or LoraAdapters(adapter, LoraCatalog(), 0)

    def run(self, batch: StageBatch) -> None:
        self.run_batched([batch])

    def run_batched(self, batches: list[StageBatch]) -> list[Exception | None]:
        # The cache's key names the files `applied` loaded (one reading of the catalogue): embeddings made
        # with an adapter's old file are never kept under its new file's key.
        with self.loras.applied(batches[0].params) as applied:
            self._encode(batches, applied)
        return [None] * len(batches)

    def _encode(self, batches: list[StageBatch], applied: tuple[LoraWeight, ...]) -> None:
        misses = [b for b in batches if not self._from_cache(b, applied)]
        if misses:
            # The prompts differ (a merged batch has one): the adapter encodes the list of them.
            tensors: dict[str, Array] = {**self.adapter.encode_texts([b.params for b in misses])}
            encoded = [StageBatch(params=b.params) for b in misses]
            split(StageBatch(params=misses[0].params, tensors=tensors), encoded, self.adapter.shared_tensors)
            for batch, own in zip(misses, encoded, strict=True):
                batch.tensors.update(own.tensors)
                if self.cache is not None:
                    self.cache.put(
                        self._key(batch.params, applied), {n: cast("torch.Tensor", t) for n, t in own.tensors.items()}
                    )

    def _key(self, params: GenerationParams, applied: tuple[LoraWeight, ...]) -> tuple[Any, ...]:
        adapters = tuple((lora.name, self.loras.catalog.source(lora.name), lora.weight) for lora in applied)
        return (self.adapter.package.path, adapters, *self.adapter.text_encoding_key(params))

    def _from_cache(self, batch: StageBatch, applied: tuple[LoraWeight, ...]) -> bool:
        cached = None if self.cache is None else self.cache.get(self._key(batch.params, applied))
        if cached is not None:
            batch.tensors.update(cached)
        return cached is not None


class ImageEncodingStage(AdapterStage):
    """VAE encode of an edit's reference image; requests without one pass through untouched."""

    role_affinity: ClassVar[Role] = Role.IMAGE_ENCODER

    def run(self, batch: StageBatch) -> None:
        if batch.params.has_reference:
            self.adapter.encode_image(batch)


# The denoiser makes the noise from the request's seed and its own schedule, whichever encoders ran
# before it: the encoders hand on embeddings only, the same in the three- and four-role topologies.
# A continuation (another denoiser's state at a step boundary, resume.py) brings its latents and
# its schedule's meta with it: both stages leave it as it came.
class LatentPreparationStage(AdapterStage):
    role_affinity: ClassVar[Role] = Role.DENOISER

    def run(self, batch: StageBatch) -> None:
        if RESUME not in batch.meta:
            self.adapter.prepare_latents(batch)


class TimestepPreparationStage(AdapterStage):
    role_affinity: ClassVar[Role] = Role.DENOISER

    def run(self, batch: StageBatch) -> None:
        if RESUME not in batch.meta:
            self.adapter.prepare_timesteps(batch)


class DenoisingStage(BatchedAdapterStage):
    """The denoising loop, with the request's LoRA adapters active (lora.py) and its step cache hook
    on the transformer (step_cache.py): a merged batch runs here once, with the one adapter set and
    the one mode its requests share (triptych.batching)."""

    role_affinity: ClassVar[Role] = Role.DENOISER

    def __init__(self, adapter: FamilyAdapter, loras: LoraAdapters | None = None):
        super().__init__(adapter)
        self.step_cache = StepCaching(adapter)
        self.loras = loras or LoraAdapters(adapter, LoraCatalog(), 0)

    def run(self, batch: StageBatch) -> None:
        # Every step of a request uses the adapter files its first step did: one reading of the catalogue
        # for the loop, checked against the files a continuation's earlier steps used, and recorded in
        # the continuation when the loop stops at a step boundary (resume.py).
        sources = self.loras.sources(batch.params)
        if RESUME in batch.meta:
            check_adapter_sources(batch.meta, sources)
        with self.loras.pinned(sources):
            with self.loras.applied(batch.params), self.step_cache.applied(batch.params):
                self.adapter.denoise(batch)
        if RESUME in batch.meta and sources:
            batch.meta[RESUME][ADAPTERS] = sources

    def run_many(self, batches: list[StageBatch]) -> list[Exception | None]:
        # One reading of the catalogue for the whole group: run_merged enters `run` again after a member
        # leaves (and a failed batched forward runs each alone), and the members that stay must keep the
        # files their first steps used. The group shares its adapters (triptych.batching).
        with self.loras.pinned(self.loras.sources(batches[0].params)):
            return super().run_many(batches)


class DecodingStage(BatchedAdapterStage):
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
    def step_cache(self) -> StepCaching | None:
        """The step caches of this role's denoising, if it denoises."""
        return next((s.step_cache for s in self.stages if isinstance(s, DenoisingStage)), None)

    @property
    def loras(self) -> LoraAdapters | None:
        """The LoRA adapters of this role's denoising or text encoding (one cache where it runs both)."""
        return next((s.loras for s in self.stages if isinstance(s, (DenoisingStage, TextEncodingStage))), None)

    # Its stages read their inputs and never write them (new tensors out of every step, a stage that
    # passes an input on hands the same tensor, staged before the slot goes back), so on the CPU the
    # worker hands them views on the receive slot instead of copies (inputs.py).
    reads_inputs_in_place: ClassVar[bool] = True

    @property
    def hands_off(self) -> bool:
        """Whether its denoising can stop at a step boundary and continue on another denoiser
        (resume.py): it denoises and hands on latents (a full pipeline decodes them itself)."""
        kinds = {type(stage) for stage in self.stages}
        return DenoisingStage in kinds and DecodingStage not in kinds

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
        """One log line: the stages, the components loaded, their parameters and the dtype they compute in."""
        components = ",".join(sorted(self.loaded_components)) or "none"
        loaded = f"loaded {components} ({self.parameter_count} parameters)"
        return f"stages {','.join(self.stage_names)}; {loaded} in {self.adapter.dtype}"

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

    def run_many(self, batches: list[StageBatch]) -> list[Exception | None]:
        """Run compatible requests (triptych.batching) through this role's stages together, in place:
        the batched stages as one forward, the others (validation, a request's noise from its own
        seed, its schedule, an edit's reference) per request. Per request, the exception it failed
        with or None; a request that fails leaves the batch, the others carry on."""
        import torch

        with torch.no_grad():
            return run_in_turn([stage.run_many for stage in self.stages], batches)


def role_stages(role: Role, family: str) -> list[type[AdapterStage]]:
    """The stage classes `role` runs, in pipeline order; ValueError when it runs none of them."""
    stage_classes = [stage for stage in STAGES if role.runs_affinity(stage.role_affinity)]
    if not stage_classes:
        raise ValueError(
            f"--disagg-role {role.value}: the {family} pipeline has no stages for this role; "
            f"use one of monolithic, {', '.join(r.value for r in WORKER_ROLES)}"
        )
    return stage_classes


def role_components(adapter: FamilyAdapter, stage_classes: list[type[AdapterStage]]) -> set[str]:
    """The diffusers components those stages run for the adapter's package: what the role loads."""
    components: set[str] = set()
    for stage in stage_classes:
        components |= adapter.components_for(stage.__name__)
    return components


def load_role_pipeline(
    model_path: str,
    role: Role,
    device: str = "cpu",
    encoder_cache_bytes: int = 0,
    lora_catalog: LoraCatalog | None = None,
    lora_cache_bytes: int = 0,
    given: Mapping[str, Any] | None = None,
    dtype: str = "float32",
) -> RolePipeline:
    """Build `role`'s stages for the diffusers package at `model_path`, loading only their weights;
    its text encoding keeps up to `encoder_cache_bytes` of prompt embeddings (0: no cache), its
    text encoding and denoising load the adapters of `lora_catalog` requests name, up to
    `lora_cache_bytes` of them (one cache for both where the role runs both). Components in `given` are
    used as they are (a TP rank's transformer, loaded cut); the rest load in `dtype` (--dtype).

    Raises ValueError for an unsupported pipeline class or a role this family has no stages for.
    """
    role = Role(role)
    family, adapter = adapter_for(model_path, device, dtype)
    stage_classes = role_stages(role, family)
    adapter.load(role_components(adapter, stage_classes), given)
    cache = EncoderCache(encoder_cache_bytes) if encoder_cache_bytes else None
    loras = LoraAdapters(adapter, lora_catalog or LoraCatalog(), lora_cache_bytes)
    stages: list[PipelineStage] = []
    for s in stage_classes:
        if s is TextEncodingStage:
            stages.append(TextEncodingStage(adapter, cache, loras))
        elif s is DenoisingStage:
            stages.append(DenoisingStage(adapter, loras))
        else:
            stages.append(s(adapter))
    return RolePipeline(family=family, role=role, stages=stages, adapter=adapter)
