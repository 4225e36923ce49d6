"""Resource quantities (spec.<role>.resources, spec.head.resources, spec.fullPipeline.resources): checked as
a pod's are, so a bad one makes the pipeline Invalid naming the field and the value, rather than the API
server refusing the child Deployment; the CRD's pattern refuses a malformed one at apply."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import yaml

from tests.operator.helpers import NAMESPACE, REPO, minimal_spec, pipeline
from triptych.roles import Role
from triptych_operator import handlers
from triptych_operator.fields import QUANTITY_PATTERN, quantity_value, schema
from triptych_operator.manifests import render
from triptych_operator.pipeline_state import PipelineState
from triptych_operator.spec.declaration import SPEC
from triptych_operator.spec.model import SpecError
from triptych_operator.spec.rules import parse_pipeline
from triptych_operator.status import compute_status

GOOD = ["500m", "2", 2, 0, "1.5Gi", "1e3", "128Mi", "+1", ".5", "5.", "1E", "3E2", "1e-3", "250u", "0"]
BAD = ["lots", "-1", -1, "-500m", "1e1.5", "1.5.5", "", "1 Gi", "1gi", "1KB", "Gi", "e3", "0x10", 1.5, True, None]


def error_for(spec: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_pipeline("p", NAMESPACE, spec)
    return info.value


def deployment_resources(spec: dict[str, Any], name: str) -> dict[str, Any]:
    children = {(m["kind"], m["metadata"]["name"]): m for m in render(pipeline(spec, "p")).apply}
    return children[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]["resources"]


@pytest.mark.parametrize("quantity", GOOD, ids=repr)
def test_a_kubernetes_quantity_is_taken_and_reaches_the_pod_as_written(quantity: object) -> None:
    resources = {"requests": {"cpu": quantity, "memory": quantity}, "limits": {"memory": "1Ei"}}
    spec = minimal_spec(encoder={"gpusPerReplica": 0, "resources": resources}, head={"resources": resources})
    assert deployment_resources(spec, "p-encoder")["requests"] == {"cpu": quantity, "memory": quantity}
    assert deployment_resources(spec, "p-head")["requests"] == {"cpu": quantity, "memory": quantity}


@pytest.mark.parametrize("quantity", BAD, ids=repr)
@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"denoiser": {"resources": {"limits": {"memory": "{q}"}}}}, "spec.denoiser.resources.limits.memory"),
        ({"head": {"resources": {"requests": {"cpu": "{q}"}}}}, "spec.head.resources.requests.cpu"),
        ({"fullPipeline": {"resources": {"requests": {"cpu": "{q}"}}}}, "spec.fullPipeline.resources.requests.cpu"),
    ],
    ids=["role-limit", "head-request", "full-pipeline"],
)
def test_a_bad_quantity_is_refused_naming_the_field_the_value_and_what_to_write(
    quantity: object, section: dict[str, Any], field: str
) -> None:
    spec = minimal_spec(**_with(section, quantity))
    if "fullPipeline" in section:
        spec.update(encoder=None, denoiser=None, decoder=None)
    err = error_for(spec)
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}: is {quantity!r}"), str(err)
    assert "negative" in str(err) if str(quantity).startswith("-") else "500m" in str(err), str(err)


def _with(section: dict[str, Any], quantity: object) -> dict[str, Any]:
    """`section` with its "{q}" placeholder replaced by `quantity` (of any type)."""
    if section == "{q}":
        return quantity  # type: ignore[return-value]
    if isinstance(section, dict):
        return {k: _with(v, quantity) for k, v in section.items()}
    return section


@pytest.mark.parametrize(
    ("request_", "limit"), [("2", "1"), ("1025Mi", "1Gi"), ("1001m", 1), (2, "1500m"), ("1e4", "9.9e3")]
)
def test_a_request_above_its_limit_is_refused_naming_both(request_: object, limit: object) -> None:
    resources = {"requests": {"cpu": request_}, "limits": {"cpu": limit}}
    err = error_for(minimal_spec(decoder={"resources": resources}))
    assert err.field == "spec.decoder.resources.requests.cpu"
    assert f"is {request_!r}, above its limit {limit!r} (spec.decoder.resources.limits.cpu)" in str(err)
    assert "lower the request or raise the limit" in str(err)


def test_a_request_at_its_limit_or_for_a_resource_the_operator_counts_is_taken() -> None:
    equal = {"requests": {"memory": "1Gi", "cpu": "1500m"}, "limits": {"memory": "1024Mi", "cpu": "1.5"}}
    gpus = {"requests": {"nvidia.com/gpu": 8}, "limits": {"nvidia.com/gpu": 1}}  # the operator sets the GPU count
    p = pipeline(minimal_spec(decoder={"resources": equal}, denoiser={"resources": gpus}), "p")
    assert p.roles[Role.DECODER].resources["requests"] == equal["requests"]
    assert deployment_resources(minimal_spec(denoiser={"resources": gpus}), "p-denoiser") == {
        "limits": {"nvidia.com/gpu": 1}
    }


def test_quantities_are_read_as_kubernetes_reads_them() -> None:
    assert quantity_value("1.5Gi") == 1.5 * 2**30 and quantity_value("500m") * 2 == 1
    assert quantity_value("1e3") == quantity_value("1k") == 1000 and quantity_value("1E") == 10**18
    assert quantity_value("1Ki") == 1024 and quantity_value(7) == 7 and quantity_value("1e999999999") > 10**18


def test_a_bad_quantity_makes_the_pipeline_invalid_with_a_status_naming_the_field() -> None:
    meta = {"name": "p", "namespace": NAMESPACE, "uid": "u1", "generation": 1}
    body = {"metadata": meta, "spec": minimal_spec(denoiser={"resources": {"requests": {"cpu": "lots"}}})}
    state = PipelineState()
    handlers._validate(body, state, logger=logging.getLogger("test"))
    assert state.spec is None and state.spec_error is not None
    assert state.spec_error.startswith("spec.denoiser.resources.requests.cpu: is 'lots'; it is not a Kubernetes")
    status = compute_status(1, {}, spec_error=state.spec_error, now="2026-01-01T00:00:00Z")
    assert status["phase"] == "Invalid"
    assert any("spec.denoiser.resources.requests.cpu" in c["message"] for c in status["conditions"])


def test_the_crd_refuses_what_the_parser_refuses() -> None:
    """Each quantity map's values: the pattern (RE2 on the API server; the same simple syntax in Python) for a
    string, minimum 0 for an integer; the CRD file is the one `make crd` writes from SPEC."""
    crd = yaml.safe_load((REPO / "crds" / "diffusionpipelines.yaml").read_text())
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec_schema == schema(SPEC)
    for where in ("denoiser", "head", "fullPipeline"):
        for kind in ("requests", "limits"):
            values = spec_schema["properties"][where]["properties"]["resources"]["properties"][kind]
            assert values["additionalProperties"] == {
                "x-kubernetes-int-or-string": True,
                "pattern": QUANTITY_PATTERN,
                "minimum": 0,
            }
    for quantity in GOOD:
        assert isinstance(quantity, int) or re.fullmatch(QUANTITY_PATTERN, quantity), quantity
    for quantity in BAD:
        assert not isinstance(quantity, str) or not re.fullmatch(QUANTITY_PATTERN, quantity), quantity
