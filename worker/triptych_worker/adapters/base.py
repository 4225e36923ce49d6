"""The adapter contract: the torch side of a model family (its request rules and shapes are
triptych.families', which the head reads without this package)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast

from triptych import startup
from triptych.config import ConfigError
from triptych.families import FamilyRules, ModelPackage
from triptych.families.package import PackageError
from triptych.params import GenerationParams
from triptych.protocol.tensors import TensorSpec
from triptych.roles import Role

if TYPE_CHECKING:
    import numpy as np
    import torch

    from triptych_worker.stages import StageBatch


def pixels_uint8(images: np.ndarray) -> torch.Tensor:
    """Float pixels in [0, 1] -> uint8, rounded exactly as diffusers' numpy_to_pil does."""
    import torch

    return torch.from_numpy((images * 255).round().astype("uint8"))


RulesT = TypeVar("RulesT", bound=FamilyRules)


class FamilyAdapter(abc.ABC, Generic[RulesT]):
    """One model family's stage work (stock diffusers), over the family's rules (triptych.families).

    Constructing an adapter loads nothing; `load` brings in the weights the role's stages need.
    """

    stage_components: ClassVar[dict[str, frozenset[str]]]
    """Stage class name -> the diffusers components it runs; a role loads the union over its stages."""
    shared_tensors: ClassVar[frozenset[str]] = frozenset()
    """Tensors without a row per output (positional ids of the shape): a batch holds one for all its
    requests (triptych_worker.batching); every other tensor a stage hands on is [num_outputs, ...]."""

    def __init__(self, rules: RulesT, device: str = "cpu", dtype: str = "float32"):
        self.rules = rules
        self.device = device
        self.dtype = dtype  # what the components load in (--dtype); inputs are cast to what it would make them in
        self.pipe: Any = None
        # How one denoising step runs its guidance branches (cond, uncond): here in turn; a
        # CFG-parallel denoiser runs each on its own rank (triptych_worker.parallel).
        self.run_branches: Callable[[Sequence[Callable[[], torch.Tensor]]], list[torch.Tensor]] = run_in_order

    def components_for(self, stage: str) -> frozenset[str]:
        """The components stage class `stage` runs for this package (none when it does nothing here)."""
        if stage == "ImageEncodingStage" and not self.rules.takes_reference:
            return frozenset()  # a text-only package's image encoder has nothing to encode
        return self.stage_components.get(stage, frozenset())

    @property
    def package(self) -> ModelPackage:
        return self.rules.package

    def validate(self, params: GenerationParams) -> None:
        """Raise ValueError naming the field when the model cannot serve `params`."""
        self.rules.validate(params)

    def output_specs(self, role: Role, params: GenerationParams) -> list[TensorSpec]:
        """The tensors `role`'s stages hand on, in this adapter's dtype (FamilyRules.output_specs)."""
        return self.rules.output_specs(role, params, self.dtype)

    @abc.abstractmethod
    def load(self, components: set[str], given: Mapping[str, Any] | None = None) -> None:
        """Load the stock pipeline with only `components`; the rest are passed as None, those in `given`
        as given (loaded already: a TP rank's transformer, cut)."""

    @abc.abstractmethod
    def latent_grid(self, latents: Any, params: GenerationParams) -> np.ndarray:
        """The denoiser's latents (as `denoise` holds them) of the first output, as float32 [C, h, w]:
        what a denoising preview projects to RGB (preview.py). One frame for video."""

    @property
    def loaded_components(self) -> set[str]:
        if self.pipe is None:
            return set()
        return {name for name, value in self.pipe.components.items() if value is not None}

    def on_device(self, batch: StageBatch) -> dict[str, torch.Tensor]:
        """The batch's tensors on this role's device, each floating one in the dtype this role's model makes
        it in (`FamilyRules.handed_on`): a sender loaded in another --dtype hands it in its own."""
        import torch

        # A model worker's transfer layer loads torch tensors (numpy arrays are for simulated workers).
        made_here = self.rules.handed_on(batch.params, self.dtype)
        out = {}
        for name, tensor in batch.tensors.items():
            t = cast("torch.Tensor", tensor)
            spec = made_here.get(name)
            dtype = getattr(torch, spec.dtype) if spec is not None and t.is_floating_point() else t.dtype
            out[name] = t.to(self.device, dtype)
        return out

    def _load_stock(self, pipeline_class: Any, components: set[str], given: Mapping[str, Any] | None) -> Any:
        import torch

        startup.mark("imported")  # torch, diffusers and the family's pipeline module came with `pipeline_class`
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device cuda: torch finds no CUDA device on this host ({torch.__version__}); "
                              "use --device cpu, or run where a GPU and its driver are")  # fmt: skip
        skipped = {name: None for name in self.package.components if name not in components}
        try:
            pipe = pipeline_class.from_pretrained(
                self.package.path, dtype=getattr(torch, self.dtype), **skipped, **(given or {})
            )
        except (OSError, ValueError, RuntimeError) as exc:  # truncated weights, a bad config
            raise PackageError(f"loading {', '.join(sorted(components))} failed: {type(exc).__name__}: {exc}") from exc
        pipe.set_progress_bar_config(disable=True)
        return pipe.to(self.device)

    @abc.abstractmethod
    def encode_texts(self, params: Sequence[GenerationParams]) -> dict[str, torch.Tensor]:
        """The text embeddings of compatible requests' prompts as one batch: rows in request order
        (num_outputs each), shared tensors once."""

    @abc.abstractmethod
    def text_encoding_key(self, params: GenerationParams) -> tuple[Hashable, ...]:
        """Every request parameter `encode_texts` reads: two requests with the same key get the same
        embeddings, so the prompt-embedding cache (encoder_cache.py) keys on it."""

    def encode_image(self, batch: StageBatch) -> None:
        """Encode the request's reference image (families that take one override this)."""
        raise ValueError(f"image: {self.package.class_name} takes no reference image")

    @abc.abstractmethod
    def prepare_latents(self, batch: StageBatch) -> None: ...

    @abc.abstractmethod
    def prepare_timesteps(self, batch: StageBatch) -> None: ...

    @abc.abstractmethod
    def denoise(self, batch: StageBatch) -> None: ...

    @abc.abstractmethod
    def decode(self, batch: StageBatch) -> None: ...


def run_in_order(branches: Sequence[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    return [branch() for branch in branches]
