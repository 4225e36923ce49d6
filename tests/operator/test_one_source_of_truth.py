"""The CRD, the chart's copy, the CLI and the examples agree: each is generated from or checked against one source."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.operator.helpers import EXAMPLES, REPO
from triptych.config import DISPATCH_POLICIES, ServeArgs
from triptych_operator import crd
from triptych_operator.constants import HEAD_HTTP_PORT, PIPELINE_ROLES, crd_field
from triptych_operator.fields import Field, docs_table
from triptych_operator.spec.declaration import (
    DEFAULT_DRAIN_SECONDS,
    DEFAULT_SCALE_DOWN_STABILIZATION_S,
    DEFAULT_TARGET_WORK_SECONDS,
    DEPRECATED_AUTOSCALING_FIELDS,
    MIN_DRAIN_SECONDS,
    SPEC,
)
from triptych_operator.spec.head_fields import DEFAULT_HEAD_DRAIN_SECONDS, MIN_HEAD_DRAIN_SECONDS
from triptych_operator.spec.rules import parse_pipeline

CRD_FILE = REPO / "crds" / "diffusionpipelines.yaml"
CHART_CRD_FILE = REPO / "charts" / "triptych" / "crds" / "diffusionpipelines.yaml"
REGENERATE = "stale: run `make crd` (python -m triptych_operator.crd --write)"
DOCS_FILE = REPO / "docs" / "operator.md"


def schema() -> dict[str, Any]:
    doc = yaml.safe_load(CRD_FILE.read_text())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_file_is_what_the_generator_writes() -> None:
    assert CRD_FILE.read_text() == crd.render_yaml(), REGENERATE


def test_chart_crd_is_byte_identical_to_the_top_level_crd() -> None:
    assert CHART_CRD_FILE.read_bytes() == CRD_FILE.read_bytes(), REGENERATE


def test_docs_field_tables_are_what_the_generator_writes() -> None:
    text = DOCS_FILE.read_text()
    assert text.count("<!-- generated: ") == len(crd.DOCS_TABLES)
    assert text == crd.render_docs(text), REGENERATE


def test_every_declared_field_is_in_the_schema_and_the_docs() -> None:
    """Walks the declaration: each field reaches the CRD, and each role/section field a docs row."""
    spec = schema()["properties"]["spec"]
    docs = DOCS_FILE.read_text()

    def walk(field: Field, node: dict[str, Any], path: str) -> None:
        for child in field.fields:
            assert child.name in node["properties"], f"{path}.{child.name} is not in the CRD"
            walk(child, node["properties"][child.name], f"{path}.{child.name}")

    walk(SPEC, spec, "spec")
    for section, field in crd.DOCS_TABLES.items():
        for row in docs_table(field).splitlines()[2:]:
            assert row in docs, f"{section}: {row[:60]}"


def test_dispatch_policy_enum_is_the_cli_choices() -> None:
    head = schema()["properties"]["spec"]["properties"]["head"]["properties"]
    assert head["dispatchPolicy"]["enum"] == list(DISPATCH_POLICIES)
    assert head["dispatchPolicy"]["default"] == DISPATCH_POLICIES[0]
    assert head["port"]["default"] == HEAD_HTTP_PORT


def test_crd_names_group_version_and_printer_columns() -> None:
    doc = yaml.safe_load(CRD_FILE.read_text())
    assert doc["metadata"]["name"] == "diffusionpipelines.triptych.ai"
    assert {"dp", "dpipe"} <= set(doc["spec"]["names"]["shortNames"])
    version = doc["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Encoder", "PromptEncoder", "ImageEncoder", "Denoiser", "Decoder", "Head", "Age"]


def test_every_role_has_the_parallelism_cel_rule() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    for role in ("encoder", "denoiser", "decoder"):
        rules = [r["rule"] for r in spec[role]["x-kubernetes-validations"]]
        assert any("self.gpusPerReplica" in r for r in rules), role


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid_pipelines(path: Any) -> None:
    cr = yaml.safe_load(path.read_text())
    assert (cr["apiVersion"], cr["kind"]) == ("triptych.ai/v1alpha1", "DiffusionPipeline")
    parse_pipeline(cr["metadata"]["name"], "default", cr["spec"])


def test_autoscaling_and_drain_defaults_are_the_operators() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    for role in PIPELINE_ROLES:
        props = spec[crd_field(role)]["properties"]
        assert props["drainSeconds"]["default"] == DEFAULT_DRAIN_SECONDS[role]
        assert props["drainSeconds"]["minimum"] == MIN_DRAIN_SECONDS
        auto = props["autoscaling"]["properties"]
        assert auto["targetWorkSecondsPerReplica"]["default"] == DEFAULT_TARGET_WORK_SECONDS
        assert auto["scaleDownStabilizationSeconds"]["default"] == DEFAULT_SCALE_DOWN_STABILIZATION_S
        for name in DEPRECATED_AUTOSCALING_FIELDS:  # kept so existing CRs still apply, documented as ignored
            assert "ignored" in auto[name]["description"]


def test_head_drain_and_retention_defaults_are_the_operators_and_the_clis() -> None:
    defaults = ServeArgs(model_path="")
    head = schema()["properties"]["spec"]["properties"]["head"]["properties"]
    assert head["drainSeconds"]["default"] == DEFAULT_HEAD_DRAIN_SECONDS
    assert head["drainSeconds"]["minimum"] == MIN_HEAD_DRAIN_SECONDS
    results = head["results"]["properties"]
    assert results["maxAgeSeconds"]["default"] == defaults.results_max_age
    assert str(defaults.results_max_bytes) in results["maxBytes"]["description"]
