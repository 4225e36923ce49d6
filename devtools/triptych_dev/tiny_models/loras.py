"""Tiny LoRA adapters for the tiny models, in diffusers' LoRA format: `triptych models tiny --out DIR`
writes them under DIR/tiny-loras/<name>/pytorch_lora_weights.safetensors.

Each adapter targets some of the tiny transformer's linear layers with random low-rank factors from
a fixed seed, large enough that an image made with it differs from one made without. They are
written by the pipeline class's own `save_lora_weights`, so stock `load_lora_weights` reads them.

    flux-ink    tiny-flux (and tiny-flux-kontext: the same transformer): the attentions' projections, rank 4
    flux-paper  tiny-flux: the feed-forward and single blocks' MLP layers, rank 2
    wan-ink     tiny-wan: the attentions' projections, rank 4
    flux-ink-te flux-ink's transformer factors and factors for tiny-flux's CLIP text encoder
    flux-misfit tiny-flux's attention layers with factors one input wider than the layers: diffusers would
                widen the base layers to fit it (as for FLUX Control LoRAs), which a per-request adapter may not
    flux-out    tiny-flux's own output projection (the transformer's top-level proj_out), rank 2
    wan-out     tiny-wan's own output projection, rank 2
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

FOLDER = "tiny-loras"
STAMP_FILE = "triptych-tiny-loras.stamp"
WEIGHTS = "pytorch_lora_weights.safetensors"
SCALE = 2.0  # of the factors' random entries: enough to move the tiny models' pixels visibly


@dataclass(frozen=True)
class LoraRecipe:
    package: str  # the tiny package whose transformer it adapts
    targets: tuple[str, ...]  # suffixes of the linear layers' names it targets
    rank: int
    seed: int
    misfit: bool = False  # factors one input wider than the layers they adapt
    text_encoder: bool = False  # also factors for the CLIP text encoder's query and value projections
    top_level: bool = False  # the targets are the transformer's own layers (whole names), not its blocks'


ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
RECIPES: dict[str, LoraRecipe] = {
    "flux-ink": LoraRecipe("tiny-flux", ATTENTION, rank=4, seed=101),
    "flux-paper": LoraRecipe("tiny-flux", ("ff.net.0.proj", "ff.net.2", "proj_mlp", "proj_out"), rank=2, seed=102),
    "wan-ink": LoraRecipe("tiny-wan", ATTENTION, rank=4, seed=103),
    "flux-misfit": LoraRecipe("tiny-flux", ATTENTION, rank=4, seed=104, misfit=True),
    # flux-ink's transformer factors (the same seed) plus text-encoder ones: the denoiser applies the former only.
    "flux-ink-te": LoraRecipe("tiny-flux", ATTENTION, rank=4, seed=101, text_encoder=True),
    # Where a sequence-parallel denoiser joins its ranks' shards (worker/triptych_worker/parallel/families.py).
    "flux-out": LoraRecipe("tiny-flux", ("proj_out",), rank=2, seed=105, top_level=True),
    "wan-out": LoraRecipe("tiny-wan", ("proj_out",), rank=2, seed=106, top_level=True),
}


def write_tiny_loras(out_dir: str | Path, packages: dict[str, Path]) -> Path:
    """Write every adapter of RECIPES under `out_dir`/tiny-loras/ (skipped when its stamp matches) and
    return that folder; `packages`: the tiny packages by name, whose transformers give the shapes."""
    root = Path(out_dir)
    target = root / FOLDER
    stamp = _stamp()
    if _stamp_of(target) == stamp:
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{FOLDER}.", dir=root))
    try:
        for name, recipe in RECIPES.items():
            _write_adapter(staging / name, recipe, packages[recipe.package])
        (staging / STAMP_FILE).write_text(stamp + "\n")
        for path in [staging, *staging.rglob("*")]:
            path.chmod(path.stat().st_mode | (0o055 if path.is_dir() else 0o044))
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if _stamp_of(target) != stamp:  # another writer moved the same adapters into place first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_adapter(folder: Path, recipe: LoraRecipe, package: Path) -> None:
    import diffusers
    import torch
    import transformers

    from triptych.families.package import ModelPackage

    index = ModelPackage.read(package).index
    pipeline_class = getattr(diffusers, index["_class_name"])
    transformer = getattr(diffusers, index["transformer"][1]).from_pretrained(package / "transformer")
    generator = torch.Generator("cpu").manual_seed(recipe.seed)
    layers: dict[str, torch.Tensor] = {}
    for name, module in transformer.named_modules():
        targeted = name in recipe.targets if recipe.top_level else any(name.endswith("." + t) for t in recipe.targets)
        if not isinstance(module, torch.nn.Linear) or not targeted:
            continue
        fan_in = module.in_features + (1 if recipe.misfit else 0)
        down = torch.randn(recipe.rank, fan_in, generator=generator) * SCALE / fan_in**0.5
        up = torch.randn(module.out_features, recipe.rank, generator=generator) * SCALE / recipe.rank**0.5
        layers[f"{name}.lora_A.weight"] = down
        layers[f"{name}.lora_B.weight"] = up
    assert layers, f"no layer of {package.name}'s transformer matches {recipe.targets}"
    text: dict[str, torch.Tensor] = {}
    if recipe.text_encoder:
        encoder = getattr(transformers, index["text_encoder"][1]).from_pretrained(package / "text_encoder")
        for name, module in encoder.named_modules():
            if isinstance(module, torch.nn.Linear) and name.endswith(("q_proj", "v_proj")):
                text[f"{name}.lora_A.weight"] = torch.randn(recipe.rank, module.in_features, generator=generator)
                text[f"{name}.lora_B.weight"] = torch.randn(module.out_features, recipe.rank, generator=generator)
    folder.mkdir(parents=True)
    extra = {"text_encoder_lora_layers": text} if text else {}
    pipeline_class.save_lora_weights(folder, transformer_lora_layers=layers, weight_name=WEIGHTS, **extra)


def _stamp() -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    here = Path(__file__).parent
    for module in ("flux.py", "wan.py"):
        digest.update((here / module).read_bytes())
    for library in ("torch", "diffusers", "safetensors"):
        digest.update(f"{library}=={importlib.metadata.version(library)}".encode())
    return digest.hexdigest()


def _stamp_of(folder: Path) -> str | None:
    try:
        return (folder / STAMP_FILE).read_text().strip()
    except OSError:
        return None
