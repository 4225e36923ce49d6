"""Shared builders for the operator tests: example CRs and a parsed pipeline."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from triptych_operator.spec.model import PipelineSpec
from triptych_operator.spec.rules import parse_pipeline

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
NAMESPACE = "ml"
OWNER: dict[str, Any] = {
    "apiVersion": "triptych.ai/v1alpha1",
    "kind": "DiffusionPipeline",
    "metadata": {"name": "wan-t2v", "namespace": NAMESPACE, "uid": "0b6f1e1c-0000-4000-8000-000000000001"},
}


def example(name: str) -> dict[str, Any]:
    """An example CR from examples/, as a dict (a fresh copy each call)."""
    return copy.deepcopy(yaml.safe_load((EXAMPLES / name).read_text()))


def pipeline(spec: dict[str, Any] | None = None, name: str = "wan-t2v") -> PipelineSpec:
    return parse_pipeline(name, NAMESPACE, spec if spec is not None else example("wan-t2v.yaml")["spec"])


def minimal_spec(**sections: Any) -> dict[str, Any]:
    """The smallest valid spec (one GPU per role, TCP, model on a PVC) plus `sections`."""
    spec: dict[str, Any] = {"model": {"path": "tiny", "volume": {"persistentVolumeClaim": {"claimName": "models"}}}}
    spec.update(sections)
    return spec
