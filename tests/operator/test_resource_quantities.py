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
from triptych_operator.fields import QUANTITY_PATTERN, key_path, quantity_value, schema
from triptych_operator.manifests import render
from triptych_operator.pipeline_state import PipelineState
from triptych_operator.spec.declaration import SPEC
from triptych_operator.spec.model import SpecError
from triptych_operator.spec.resources import check_resources
from triptych_operator.spec.rules import parse_pipeline
from triptych_operator.status import compute_status

GOOD = ["500m", "2", 2, 0, "1.5Gi", "1e3", "128Mi", "+1", ".5", "5.", "1E", "3E2", "1e-3", "250u", "0"]
BAD = ["lots", "-1", -1, "-500m", "1e1.5", "1.5.5", "", "1 Gi", "1gi", "1KB", "Gi", "e3", "0x10", 1.5, True, None]
LOG = logging.getLogger("test")


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
    err = error_for(spec_with(section, quantity))
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}: is {quantity!r}"), str(err)
    assert "negative" in str(err) if str(quantity).startswith("-") else "500m" in str(err), str(err)


def spec_with(section: dict[str, Any], quantity: object) -> dict[str, Any]:
    """A minimal spec with `section` in it, its "{q}" placeholder replaced by `quantity` (a full
    pipeline's section: the role pools left out)."""
    spec = minimal_spec(**_with(section, quantity))
    if "fullPipeline" in section:
        spec.update(encoder=None, denoiser=None, decoder=None)
    return spec


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


# Extended resources and huge pages, as the API server checks a container's (ValidateResourceRequirements):
# an extended resource (a domain outside kubernetes.io) is a whole number and never overcommitted, and so are
# huge pages, in whole pages, beside a cpu or memory request or limit.
FPGA = "example.com/fpga"
RDMA = "rdma/ib"  # the default transfer.rdmaResourceName: the operator's own only in rdma mode
FRACTIONS = ["500m", "0.5", "1.5", "1e-1", "1001m"]


@pytest.mark.parametrize("quantity", FRACTIONS, ids=repr)
@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"decoder": {"resources": {"limits": {FPGA: "{q}"}}}}, f'spec.decoder.resources.limits["{FPGA}"]'),
        ({"head": {"resources": {"limits": {RDMA: "{q}"}}}}, f'spec.head.resources.limits["{RDMA}"]'),
        # a CPU role: no GPU count of the operator's, so the spec's reaches the pod
        (
            {"encoder": {"gpusPerReplica": 0, "resources": {"limits": {"nvidia.com/gpu": "{q}"}}}},
            'spec.encoder.resources.limits["nvidia.com/gpu"]',
        ),
        ({"fullPipeline": {"resources": {"limits": {RDMA: "{q}"}}}}, f'spec.fullPipeline.resources.limits["{RDMA}"]'),
    ],
    ids=["role", "head", "cpu-role-gpu", "full-pipeline"],
)
def test_a_fractional_extended_resource_is_refused_naming_the_field(
    quantity: str, section: dict[str, Any], field: str
) -> None:
    err = error_for(spec_with(section, quantity))
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}: is {quantity!r}, not a whole number;"), str(err)
    assert "is an extended resource" in str(err) and "write a whole number" in str(err), str(err)


@pytest.mark.parametrize(
    ("name", "request_", "limit"),
    [
        (FPGA, "1", "2"),
        (FPGA, 2, 1),
        (FPGA, "1k", "1001"),
        ("hugepages-2Mi", "4Mi", "2Mi"),
        ("hugepages-2Mi", 0, "2Mi"),
    ],
)
def test_overcommitted_extended_resources_or_huge_pages_are_refused(name: str, request_: object, limit: object) -> None:
    resources = {"requests": {name: request_, "memory": "1Gi"}, "limits": {name: limit, "memory": "1Gi"}}
    err = error_for(minimal_spec(decoder={"resources": resources}))
    field = key_path("spec.decoder.resources.requests", name)
    limit_field = key_path("spec.decoder.resources.limits", name)
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}: is {request_!r}, not its limit {limit!r} ({limit_field}); {name} may not be")
    assert "request must equal its limit: write the same value, or only the limit" in str(err)


@pytest.mark.parametrize("name", [FPGA, "hugepages-1Gi"])
def test_an_extended_resource_or_huge_pages_requested_without_a_limit_are_refused(name: str) -> None:
    err = error_for(minimal_spec(head={"resources": {"requests": {name: "2Gi", "cpu": 1}}}))
    field = key_path("spec.head.resources.requests", name)
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}: is '2Gi' without a limit; {name} may not be overcommitted"), str(err)
    assert f"set {key_path('spec.head.resources.limits', name)} to '2Gi', or write only the limit" in str(err)


def test_whole_extended_resources_and_pages_at_their_limits_reach_the_pod_as_written() -> None:
    resources = {
        "requests": {FPGA: "1000m", "hugepages-2Mi": "4Mi", "memory": "1Gi"},
        "limits": {FPGA: 1, "hugepages-2Mi": 4 * 2**20, "hugepages-1Gi": "2Gi", RDMA: "2e0"},
    }
    on_pod = deployment_resources(minimal_spec(decoder={"resources": resources}), "p-decoder")
    assert on_pod == {"requests": resources["requests"], "limits": {**resources["limits"], "nvidia.com/gpu": 1}}
    huge = {"limits": {FPGA: "1e999999999", "hugepages-2Mi": "1e999999999", "memory": 1}}  # read at once, no hang
    check_resources(huge, "spec.head")


def test_the_counts_the_operator_sets_itself_are_not_the_specs_to_check() -> None:
    """A GPU role's nvidia.com/gpu, and the RDMA resource in rdma mode: the operator's counts win."""
    resources = {"requests": {"nvidia.com/gpu": "500m", RDMA: 3}, "limits": {"nvidia.com/gpu": "1.5"}}
    rdma = {"mode": "rdma", "ibDevice": "mlx5_0"}
    spec = minimal_spec(transfer=rdma, denoiser={"gpusPerReplica": 2, "resources": resources})
    assert deployment_resources(spec, "p-denoiser") == {"limits": {"nvidia.com/gpu": 2, RDMA: 1}}
    err = error_for(minimal_spec(denoiser={"resources": resources}))  # tcp: rdma/ib is the spec's
    assert err.field == f'spec.denoiser.resources.requests["{RDMA}"]', str(err)


def test_an_rdma_resource_name_no_container_may_ask_for_is_refused_in_rdma_mode_only() -> None:
    """In rdma mode every worker pod asks for transfer.rdmaResourceName: a bad name is the spec's error, not
    the API server's refusal of the Deployments; in tcp mode nothing asks for it."""
    bad = {"rdmaResourceName": "ib"}
    err = error_for(minimal_spec(transfer={"mode": "rdma", "ibDevice": "mlx5_0", **bad}))
    assert err.field == "spec.transfer.rdmaResourceName", str(err)
    assert str(err).startswith("spec.transfer.rdmaResourceName: is 'ib', not a resource a container may ask"), str(err)
    parse_pipeline("p", NAMESPACE, minimal_spec(transfer={"mode": "tcp", **bad}))


@pytest.mark.parametrize(
    ("name", "quantity", "message"),
    [
        ("hugepages-2Mi", "3Mi", "is '3Mi', not a whole number of 2Mi pages: write a multiple of 2Mi"),
        ("hugepages-1Gi", "1.5Gi", "is '1.5Gi', not a whole number of 1Gi pages: write a multiple of 1Gi"),
        ("hugepages-2Mi", 1, "is 1, not a whole number of 2Mi pages"),
        ("hugepages-big", "2Mi", "'hugepages-big' names no page size: write hugepages-<size>"),
        ("hugepages-500m", "1", "'hugepages-500m' names no page size"),
    ],
)
def test_huge_pages_are_whole_pages_of_the_size_their_name_gives(name: str, quantity: object, message: str) -> None:
    err = error_for(minimal_spec(denoiser={"resources": {"limits": {name: quantity, "memory": "2Gi"}}}))
    assert str(err).startswith(f"spec.denoiser.resources.limits.{name}: {message}"), str(err)


def test_huge_pages_need_a_cpu_or_memory_request_or_limit() -> None:
    err = error_for(minimal_spec(head={"resources": {"limits": {"hugepages-2Mi": "4Mi", FPGA: 1}}}))
    assert err.field == "spec.head.resources"
    assert "asks for hugepages-2Mi but for neither cpu nor memory" in str(err)
    assert "must also request or limit cpu or memory: add e.g. limits.memory" in str(err)
    taken = {"requests": {"cpu": "1"}, "limits": {"hugepages-2Mi": "4Mi"}}
    assert deployment_resources(minimal_spec(head={"resources": taken}), "p-head") == taken


def test_a_resource_name_with_a_domain_is_named_in_brackets_in_any_quantity_error() -> None:
    err = error_for(minimal_spec(denoiser={"resources": {"limits": {"nvidia.com/gpu": "lots"}}}))
    assert str(err).startswith("spec.denoiser.resources.limits[\"nvidia.com/gpu\"]: is 'lots'; it is not a"), str(err)


def test_an_overcommitted_extended_resource_makes_the_pipeline_invalid_with_a_status_naming_the_field() -> None:
    meta = {"name": "p", "namespace": NAMESPACE, "uid": "u1", "generation": 1}
    resources = {"requests": {FPGA: 1}, "limits": {FPGA: 2}}
    state = PipelineState()
    handlers._validate({"metadata": meta, "spec": minimal_spec(decoder={"resources": resources})}, state, logger=LOG)
    assert state.spec is None and state.spec_error is not None
    status = compute_status(1, {}, spec_error=state.spec_error, now="2026-01-01T00:00:00Z")
    assert status["phase"] == "Invalid"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert degraded["message"].startswith(f'spec.decoder.resources.requests["{FPGA}"]: is 1, not its limit 2'), degraded


# Resource names, as the API server checks a container's (validateContainerResourceName): a standard one, or a
# qualified domain/name; an extended one (outside kubernetes.io) not beginning with the quota prefix requests.
NAMES = {
    "cpu": 1,
    "memory": "1Gi",
    "ephemeral-storage": "10Gi",
    "hugepages-2Mi": "2Mi",
    "nvidia.com/gpu": 1,
    RDMA: 1,
    FPGA: 1,
    "example.com/Big_FPGA.v2": 1,  # the name part (not the domain) may have capitals, '_' and '.'
    "a" * 240 + ".com/x": 1,  # the longest domain an extended name may have: 253 less "requests."
    "kubernetes.io/batch-cpu": "1k",  # Kubernetes' own domain: the API server checks only its form
}


@pytest.mark.parametrize(("name", "quantity"), NAMES.items(), ids=lambda v: str(v)[:30])
def test_a_standard_or_a_qualified_resource_name_is_taken_and_reaches_the_pod(name: str, quantity: object) -> None:
    resources = {"limits": {"memory": "1Gi", name: quantity}}
    limits = deployment_resources(minimal_spec(decoder={"resources": resources}), "p-decoder")["limits"]
    assert limits[name] == quantity


NOT_A_CONTAINERS = "not a resource a container may ask for: write a standard name (cpu, memory, ephemeral-storage"
NOT_A_NAME = "not a resource name: a domain/name has a lowercase DNS domain"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("gpu", NOT_A_CONTAINERS),
        ("pods", NOT_A_CONTAINERS),  # a ResourceQuota's, not a container's
        ("requests.cpu", NOT_A_CONTAINERS),
        ("hugepages-", NOT_A_CONTAINERS),
        ("CPU", NOT_A_CONTAINERS),
        ("nvidia.com/", NOT_A_NAME),
        ("/gpu", NOT_A_NAME),
        ("Nvidia.com/gpu", NOT_A_NAME),
        ("nvidia_com/gpu", NOT_A_NAME),
        ("nvidia.com/gpu/0", NOT_A_NAME),
        ("nvidia.com/-gpu", NOT_A_NAME),
        ("nvidia.com/" + "g" * 64, NOT_A_NAME),
        ("a" * 241 + ".com/x", NOT_A_NAME),
        ("requests.nvidia.com/gpu", "the requests. prefix makes it a ResourceQuota's name, not a container's: write "),
    ],
    ids=lambda v: v[:24],
)
@pytest.mark.parametrize("kind", ["limits", "requests"])
def test_a_resource_name_the_api_server_would_refuse_is_refused_naming_the_field(
    name: str, message: str, kind: str
) -> None:
    err = error_for(minimal_spec(head={"resources": {kind: {name: 1, "memory": "1Gi"}}}))
    field = key_path(f"spec.head.resources.{kind}", name)
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}: is {name!r}"), str(err)
    assert message in str(err), str(err)
    what_to_write = ("or a device plugin's domain/name such as nvidia.com/gpu", "write nvidia.com/gpu")
    assert str(err).endswith(what_to_write), str(err)
