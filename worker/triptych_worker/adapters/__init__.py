"""Model-family adapters: the torch code of each family in the model-family table (triptych.families).

A package's family is chosen from model_index.json `_class_name` by that table; this maps the
family's name to the adapter that runs its stages.
"""

from __future__ import annotations

from triptych.families import FAMILIES, ModelPackage, family_of
from triptych_worker.adapters.base import FamilyAdapter
from triptych_worker.adapters.flux import FluxAdapter
from triptych_worker.adapters.wan import WanAdapter

ADAPTERS: dict[str, type[FamilyAdapter]] = {"flux": FluxAdapter, "flux-kontext": FluxAdapter, "wan": WanAdapter}
"""Family name (triptych.families.FAMILIES) -> its adapter class."""
assert {f.name for f in FAMILIES.values()} == set(ADAPTERS), "every family in the table needs an adapter"


def adapter_for(model_path: str, device: str = "cpu", dtype: str = "float32") -> tuple[str, FamilyAdapter]:
    """The family name and a (weightless) adapter for the package at `model_path`, loading in `dtype`.

    Raises ValueError naming the pipeline class and the supported ones when it is unknown.
    """
    package = ModelPackage.read(model_path)
    family = family_of(package)
    return family.name, ADAPTERS[family.name](family.rules(package), device, dtype)


__all__ = ["ADAPTERS", "FamilyAdapter", "adapter_for"]
