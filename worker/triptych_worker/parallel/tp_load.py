"""A TP rank's transformer, read cut from the package's safetensors files straight onto its device.

    transformer = load_transformer_cut(package, family, tp=2, index=1, device="cuda:1", dtype="bfloat16")

The transformer is built from its config without storage (accelerate's empty weights: parameters on
torch's `meta` device, buffers real), then every tensor of its weight files is read through a
safetensors slice: a planned module's (tensor.py's `plan_cuts`) only this rank's rows or columns of
it, anything else whole, each cast as `from_pretrained(dtype=...)` casts it (to `dtype`, or
float32 in the modules the model class keeps in float32) and placed on the device. No rank ever
holds the whole transformer, in host or device memory; host memory holds one tensor's cut at a
time. `shard_transformer` then finds the modules cut (`_tp_cut`) and only makes them compute their
parts.

Only safetensors files are read (a `.bin` checkpoint would need pickle); a tensor whose shape in the
file is not the model's, one the model lacks, or a parameter no file holds raises ValueError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triptych_worker.parallel.tensor import plan_cuts, set_cut_tensor

if TYPE_CHECKING:
    from triptych.families.package import ModelPackage

COMPONENT = "transformer"
WEIGHTS = "diffusion_pytorch_model.safetensors"


def load_transformer_cut(
    package: ModelPackage, family: str, tp: int, index: int, device: str, dtype: str = "float32"
) -> Any:
    """The package's transformer with this rank's cut of every planned module, in `dtype` on `device`."""
    import diffusers
    import torch
    from accelerate import init_empty_weights
    from safetensors import safe_open

    folder = package.path / COMPONENT
    model_class = getattr(diffusers, package.index[COMPONENT][1])
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # as from_pretrained builds it: its buffers in `dtype`
    try:
        with init_empty_weights(include_buffers=False):
            transformer = model_class.from_config(model_class.load_config(folder))
    finally:
        torch.set_default_dtype(default)
    in_float32 = tuple(model_class._keep_in_fp32_modules or ())
    cuts = plan_cuts(transformer, family, tp, index)
    expected = {name: p for name, p in transformer.named_parameters()}
    expected.update(transformer.named_buffers())
    placed = set()
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                kept = any(module in key.split(".") for module in in_float32)
                cast = torch.float32 if kept else getattr(torch, dtype)
                _place(transformer, cuts, expected, key, f.get_slice(key), path, device, cast)
                placed.add(key)
    missing = sorted(name for name, _ in transformer.named_parameters() if name not in placed)
    if missing:
        raise ValueError(f"{folder}: no weights for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return transformer.eval()


def weight_files(folder: Path) -> list[Path]:
    """The transformer's safetensors files: one, or those its index maps tensors to."""
    index = folder / f"{WEIGHTS}.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    if (folder / WEIGHTS).exists():
        return [folder / WEIGHTS]
    raise ValueError(
        f"{folder}: no {WEIGHTS} (or its .index.json): a TP rank reads its cut of the transformer from "
        "safetensors files only; convert the checkpoint to safetensors"
    )


def _place(
    transformer: Any,
    cuts: dict[str, Any],
    expected: dict[str, Any],
    key: str,
    piece: Any,
    path: Path,
    device: str,
    dtype: Any,
) -> None:
    """Read tensor `key` (this rank's cut of it where its module is planned) onto `device`, floating in `dtype`."""
    import torch

    declared = expected.get(key)
    if declared is None:
        raise ValueError(f"{path}: tensor {key} is not a parameter of the model's transformer")
    if tuple(piece.get_shape()) != tuple(declared.shape):
        raise ValueError(f"{path}: {key} has shape {tuple(piece.get_shape())}, the model's is {tuple(declared.shape)}")
    module_path, _, name = key.rpartition(".")
    module = transformer.get_submodule(module_path)
    cut = cuts.get(module_path)
    tensor = piece[:] if cut is None else cut.tensor(name, piece)
    tensor = tensor.to(device, dtype) if torch.is_floating_point(tensor) else tensor.to(device)
    if cut is not None:
        set_cut_tensor(module, cut, name, tensor)
    elif name in module._parameters:
        module._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[name] = tensor
