"""What a model family's requests may ask for and what its roles hand on, from the package's JSON alone."""

from __future__ import annotations

import abc

import msgspec

from triptych.contract import CONTRACT, MAX_FRAMES, MAX_SIDE
from triptych.families.package import ModelPackage
from triptych.params import GenerationParams
from triptych.protocol.tensors import PIXELS, TensorSpec
from triptych.roles import Role
from triptych.step_cache import MODES


class FamilyRules(abc.ABC):
    """A family's request rules and tensor shapes, read from one package's configs (no torch).

    Its numbers are the family's traits (triptych.contract.ModelTraits): the request contract
    narrows its limits with them. The head copies them into its ModelInfo and checks requests at
    its door; simulated workers emit `output_specs`; the worker's adapter (triptych_worker.adapters)
    runs the stages with the same numbers.
    """

    kind: str
    """"image" or "video"."""
    takes_reference: bool = False
    """Whether requests may carry a reference image (image edits)."""
    size_multiple: int
    """Width and height must be multiples of it (VAE downsampling x transformer patch)."""
    max_steps: int
    """The most denoising steps the scheduler has timesteps for."""
    frame_step: int = 0
    """Videos have 1 + k * frame_step frames (the VAE's temporal compression); 0: images."""
    max_side: int = MAX_SIDE
    """The widest and tallest output in pixels (a transformer's positional table bounds it)."""
    max_frames: int = MAX_FRAMES
    """The most frames of a video."""
    negative_prompt: bool = True
    """Whether requests may carry a negative prompt (classifier-free guidance)."""
    step_cache_modes: tuple[str, ...] = tuple(MODES)
    """The step cache modes (triptych.step_cache) whose diffusers hooks apply to its transformer."""

    def __init__(self, package: ModelPackage):
        self.package = package

    @property
    def pipeline_class(self) -> str:
        return self.package.class_name

    @property
    def edits(self) -> bool:
        return self.takes_reference

    def validate(self, params: GenerationParams) -> None:
        """Raise ParamError (a ValueError) naming the field when the model cannot serve `params`:
        the request contract's checks (triptych.contract), with this family's limits."""
        CONTRACT.check(msgspec.structs.asdict(params), self)

    @abc.abstractmethod
    def text_outputs(self, params: GenerationParams, dtype: str = "float32") -> list[TensorSpec]:
        """What the prompt encoder hands on."""

    def image_outputs(self, params: GenerationParams, dtype: str = "float32") -> list[TensorSpec]:
        """What the image encoder hands on for a request with a reference image (none by default)."""
        return []

    @abc.abstractmethod
    def latent_spec(self, params: GenerationParams, dtype: str = "float32") -> TensorSpec:
        """The latents the denoiser makes from the seed and hands the decoder."""

    def handed_on(self, params: GenerationParams, dtype: str = "float32") -> dict[str, TensorSpec]:
        """Every tensor a model role hands another for `params`, by name, when it computes in `dtype`."""
        image = self.image_outputs(params, dtype) if params.has_reference else []
        specs = (*self.text_outputs(params, dtype), *image, self.latent_spec(params, dtype))
        return {spec.name: spec for spec in specs}

    def output_specs(self, role: Role, params: GenerationParams, dtype: str = "float32") -> list[TensorSpec]:
        """The tensors `role`'s stages hand on for `params`, by name, dtype and shape, when the role's model
        computes in `dtype` (--dtype): floating tensors in the dtype the stock pipeline makes them in.

        What simulated workers emit (`triptych serve --simulate`, float32: numpy has no bfloat16); tests
        hold it to what the loaded stages produce. Pixels are uint8. An encoder's outputs accumulate: the
        image encoder passes the prompt encoder's on.
        """
        p = params
        if role is Role.DECODER:
            return [TensorSpec(PIXELS, "uint8", (p.num_outputs, p.num_frames, p.height, p.width, 3))]
        if role is Role.DENOISER:
            return [self.latent_spec(p, dtype)]
        if not role.is_worker:
            raise ValueError(f"role {role.value} hands on no tensors")
        image = self.image_outputs(p, dtype) if p.has_reference and role.runs_affinity(Role.IMAGE_ENCODER) else []
        return [*self.text_outputs(p, dtype), *image]
