"""Model-family adapters: which stock diffusers pipeline a package is, and how its stages run.

A family is chosen from model_index.json `_class_name`.
"""

from __future__ import annotations

from triptych_worker.adapters.base import FamilyAdapter, ModelPackage
from triptych_worker.adapters.flux import FluxAdapter
from triptych_worker.adapters.wan import WanAdapter

ADAPTERS: dict[str, tuple[str, type[FamilyAdapter]]] = {
    "FluxPipeline": ("flux", FluxAdapter),
    "FluxKontextPipeline": ("flux-kontext", FluxAdapter),
    "WanPipeline": ("wan", WanAdapter),
}
"""model_index.json `_class_name` -> (family name, adapter class)."""


def adapter_for(model_path: str, device: str = "cpu") -> tuple[str, FamilyAdapter]:
    """The family name and a (weightless) adapter for the package at `model_path`.

    Raises ValueError naming the pipeline class and the supported ones when it is unknown.
    """
    package = ModelPackage.read(model_path)
    if package.class_name not in ADAPTERS:
        raise ValueError(
            f"model path {model_path}: pipeline {package.class_name!r} is not supported; "
            f"supported: {', '.join(sorted(ADAPTERS))}"
        )
    family, adapter_class = ADAPTERS[package.class_name]
    return family, adapter_class(package, device)


__all__ = ["ADAPTERS", "FamilyAdapter", "ModelPackage", "adapter_for"]
