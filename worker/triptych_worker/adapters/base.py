"""What every model-family adapter shares: reading a package's JSON, request limits, the adapter contract.

Nothing here imports torch or diffusers: the GPU-less head validates requests through this module
(`triptych_worker.pipeline.validate_for_model`) without loading weights.
"""

from __future__ import annotations

import abc
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from triptych.params import GenerationParams
from triptych.protocol.tensors import PIXELS, TensorSpec
from triptych.roles import Role

if TYPE_CHECKING:
    import numpy as np
    import torch

    from triptych_worker.stages import StageBatch

# Guards against requests no deployment should attempt; model-specific rules come from the configs.
MAX_SIDE = 4096
MAX_OUTPUTS = 16
MAX_SEQUENCE_LENGTH = 512  # FluxPipeline rejects more; T5/UMT5 encoders were trained up to 512


@dataclass(frozen=True)
class ModelPackage:
    """A diffusers package on disk, read through its JSON files only."""

    path: Path
    index: dict[str, Any]

    @classmethod
    def read(cls, model_path: str | Path) -> ModelPackage:
        """Read model_index.json; raises ValueError naming the path when it is not a diffusers package."""
        path = Path(model_path)
        index_file = path / "model_index.json"
        try:
            index = json.loads(index_file.read_text())
        except FileNotFoundError:
            raise ValueError(f"model path {path}: no model_index.json (is it a diffusers package?)") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{index_file}: not valid JSON ({exc})") from None
        if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
            raise ValueError(f"{index_file}: no '_class_name'; not a diffusers model index")
        return cls(path=path, index=index)

    @property
    def class_name(self) -> str:
        return str(self.index["_class_name"])

    @property
    def components(self) -> tuple[str, ...]:
        """Component names the index declares, present ones and null ones alike."""
        return tuple(k for k, v in self.index.items() if not k.startswith("_") and isinstance(v, list))

    def config(self, component: str) -> dict[str, Any]:
        """A component's config.json (scheduler_config.json for schedulers), without loading weights."""
        folder = self.path / component
        for name in ("config.json", "scheduler_config.json"):
            if (folder / name).is_file():
                return dict(json.loads((folder / name).read_text()))
        raise ValueError(f"model path {self.path}: component {component!r} has no config.json")


def check_common(params: GenerationParams, *, size_multiple: int, max_steps: int) -> None:
    """Checks every family shares; raises ValueError naming the field and the allowed values."""
    for field, value in (("width", params.width), ("height", params.height)):
        if not size_multiple <= value <= MAX_SIDE:
            raise ValueError(f"{field} {value} is out of range: this model needs {size_multiple}..{MAX_SIDE} pixels")
        if value % size_multiple:
            raise ValueError(
                f"{field} {value} is not a multiple of {size_multiple}, which this model needs "
                f"(VAE downsampling x transformer patch); try {value // size_multiple * size_multiple or size_multiple}"
            )
    if not 1 <= params.num_inference_steps <= max_steps:
        raise ValueError(f"num_inference_steps {params.num_inference_steps} must be between 1 and {max_steps}")
    if not 1 <= params.num_outputs <= MAX_OUTPUTS:
        raise ValueError(f"num_outputs {params.num_outputs} must be between 1 and {MAX_OUTPUTS}")
    if not (math.isfinite(params.guidance_scale) and params.guidance_scale >= 0):
        raise ValueError(f"guidance_scale {params.guidance_scale} must be a finite number >= 0")
    if not 1 <= params.max_sequence_length <= MAX_SEQUENCE_LENGTH:
        raise ValueError(
            f"max_sequence_length {params.max_sequence_length} must be between 1 and {MAX_SEQUENCE_LENGTH}"
        )
    if not 0 <= params.seed < 2**64:
        raise ValueError(f"seed {params.seed} must be between 0 and 2**64-1")


def pixels_uint8(images: np.ndarray) -> torch.Tensor:
    """Float pixels in [0, 1] -> uint8, rounded exactly as diffusers' numpy_to_pil does."""
    import torch

    return torch.from_numpy((images * 255).round().astype("uint8"))


class FamilyAdapter(abc.ABC):
    """One model family: its request rules (pure) and the work of each stage (stock diffusers).

    Constructing an adapter reads only JSON; `load` brings in the weights the role's stages need.
    """

    stage_components: ClassVar[dict[str, frozenset[str]]]
    """Stage class name -> the diffusers components it runs; a role loads the union over its stages."""

    def __init__(self, package: ModelPackage, device: str = "cpu"):
        self.package = package
        self.device = device
        self.pipe: Any = None
        # How one denoising step runs its guidance branches (cond, uncond): here in turn; a
        # CFG-parallel denoiser runs each on its own rank (triptych_worker.parallel).
        self.run_branches: Callable[[Sequence[Callable[[], torch.Tensor]]], list[torch.Tensor]] = run_in_order

    @abc.abstractmethod
    def validate(self, params: GenerationParams) -> None:
        """Raise ValueError naming the field when the model cannot serve `params`."""

    @abc.abstractmethod
    def load(self, components: set[str]) -> None:
        """Load the stock pipeline with only `components`; the rest are passed as None."""

    def output_specs(self, role: Role, params: GenerationParams) -> list[TensorSpec]:
        """The tensors `role`'s stages hand on for `params`, by name, dtype and shape, read from the configs.

        What simulated workers emit (`triptych serve --simulate`); tests hold it to what the loaded
        stages produce. Every tensor is float32 (this code loads packages without a torch_dtype),
        the decoder's pixels uint8.
        """
        p = params
        if role is Role.DECODER:
            return [TensorSpec(PIXELS, "uint8", (p.num_outputs, p.num_frames, p.height, p.width, 3))]
        if role is Role.DENOISER:
            return [spec for spec in self._encoder_outputs(p) if spec.name == "latents"]
        if role is Role.ENCODER:
            return self._encoder_outputs(p)
        raise ValueError(f"role {role.value} hands on no tensors")

    @abc.abstractmethod
    def _encoder_outputs(self, params: GenerationParams) -> list[TensorSpec]:
        """What the encoder hands the denoiser (the denoiser hands on `latents` of the same shape)."""

    @property
    def loaded_components(self) -> set[str]:
        if self.pipe is None:
            return set()
        return {name for name, value in self.pipe.components.items() if value is not None}

    def on_device(self, batch: StageBatch) -> dict[str, torch.Tensor]:
        """The batch's tensors on this role's device (the transfer layer may land them elsewhere)."""
        # A model worker's transfer layer loads torch tensors (numpy arrays are for simulated workers).
        return {name: cast("torch.Tensor", tensor).to(self.device) for name, tensor in batch.tensors.items()}

    def _load_stock(self, pipeline_class: Any, components: set[str]) -> Any:
        skipped = {name: None for name in self.package.components if name not in components}
        pipe = pipeline_class.from_pretrained(self.package.path, **skipped)
        pipe.set_progress_bar_config(disable=True)
        return pipe.to(self.device)

    @abc.abstractmethod
    def encode_text(self, batch: StageBatch) -> None: ...

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


def lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)
