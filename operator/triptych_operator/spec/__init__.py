"""A DiffusionPipeline's spec, in three modules with one reason to change each.

declaration.py  every field once: type, default, bounds, enum, its one prose text, CEL rules
                (the CRD and the docs' tables are generated from it: crd.py, `make crd`)
model.py        the typed model the manifests use, checked against the declaration at import,
                and the generic parser that fills it from the declaration
rules.py        what the declaration cannot state (pools, parallel degrees, names, paths, ports)
                and `parse_pipeline`, the entry point
"""

from triptych_operator.spec.model import PipelineSpec, PoolSpec, SpecError
from triptych_operator.spec.rules import parse_pipeline

__all__ = ["PipelineSpec", "PoolSpec", "SpecError", "parse_pipeline"]
