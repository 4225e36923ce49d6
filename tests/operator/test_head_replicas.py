"""Replicated heads: how many, where their results live, how they roll, and how workers find them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.operator.helpers import NAMESPACE, OWNER, minimal_spec, pipeline
from tests.operator.test_manifests import children, container, parse_serve
from triptych.config import HEAD_SHUTDOWN_OVERHEAD_S, PIPELINE_ENV
from triptych.discovery import expand
from triptych.ports import result_endpoint
from triptych.roles import Role
from triptych_operator.constants import HEAD_SCHEDULER_PORT
from triptych_operator.manifests import ObjectRef, render
from triptych_operator.spec.head_fields import HEAD_UNROUTE_S
from triptych_operator.spec.model import SpecError

S3 = {"url": "s3://triptych-results/wan", "credentialsSecret": {"name": "results-s3"}}
CLAIM = {"persistentVolumeClaim": {"claimName": "shared-results"}}
PDB = ("PodDisruptionBudget", "wan-t2v-head")
PDB_REF = ObjectRef("policy/v1", "PodDisruptionBudget", "wan-t2v-head")


def head_spec(**head: Any) -> dict[str, Any]:
    return minimal_spec(head=head)


def head_deployment(spec: dict[str, Any]) -> dict[str, Any]:
    return children(spec)[("Deployment", "wan-t2v-head")]


# ---------------------------------------------------------------- how many heads


@pytest.mark.parametrize(
    ("head", "replicas"),
    [
        ({}, 1),  # each head would keep its own results: one
        ({"results": CLAIM}, 2),
        ({"results": {"s3": S3}}, 2),
        ({"results": {"s3": S3}, "replicas": 5}, 5),
        ({"results": CLAIM, "replicas": 1}, 1),
        ({"replicas": 0}, 0),
    ],
    ids=["empty-dir", "claim", "s3", "s3-five", "claim-one", "parked"],
)
def test_heads_default_to_two_with_shared_results_and_one_without(head: dict[str, Any], replicas: int) -> None:
    assert pipeline(head_spec(**head)).head.replicas == replicas
    assert head_deployment(head_spec(**head))["spec"]["replicas"] == replicas


def test_several_heads_without_shared_results_are_refused_naming_the_field_and_the_fixes() -> None:
    with pytest.raises(SpecError) as info:
        pipeline(head_spec(replicas=3))
    assert info.value.field == "spec.head.replicas"
    assert str(info.value).startswith("spec.head.replicas: 3 heads need results every head shares")
    assert "spec.head.results.s3" in str(info.value) and "ReadWriteMany" in str(info.value)


# ---------------------------------------------------------------- the bucket


@pytest.mark.parametrize(
    ("s3", "field", "says"),
    [
        ({"url": "s3://NoCaps/x"}, "spec.head.results.s3.url", "is not an S3 bucket name"),
        ({"url": "https://bucket/x"}, "spec.head.results.s3.url", "is not s3://BUCKET/PREFIX"),
        ({"url": "s3://bucket/x", "endpoint": "ftp://minio"}, "spec.head.results.s3.endpoint", "http(s)://HOST"),
        ({"url": "s3://bucket/x", "presignSeconds": 10**7}, "spec.head.results.s3.presignSeconds", "and 604800"),
        ({"endpoint": "http://minio:9000"}, "spec.head.results.s3.url", "is required"),
    ],
    ids=["bucket-name", "scheme", "endpoint", "presign", "no-url"],
)
def test_a_bad_bucket_is_refused_naming_its_field(s3: dict[str, Any], field: str, says: str) -> None:
    with pytest.raises(SpecError) as info:
        pipeline(head_spec(results={"s3": s3}))
    assert info.value.field == field
    assert says in str(info.value)


def test_a_bucket_and_a_claim_at_once_are_refused() -> None:
    with pytest.raises(SpecError, match=r"^spec\.head\.results\.s3: results: set s3 .* not both"):
        pipeline(head_spec(results={"s3": S3, **CLAIM}))


def test_the_bucket_reaches_the_heads_flags() -> None:
    s3 = {**S3, "endpoint": "http://seaweedfs.storage:8333", "presignSeconds": 600}
    args = parse_serve(container(head_deployment(head_spec(results={"s3": s3}))))
    assert args.results_store == "s3://triptych-results/wan"
    assert (args.results_s3_endpoint, args.results_presign) == ("http://seaweedfs.storage:8333", 600)


def test_without_a_bucket_the_head_gets_no_bucket_flags_or_credentials() -> None:
    c = container(head_deployment(head_spec(results=CLAIM)))
    assert not any(a.startswith("--results-s3") or a == "--results-store" for a in c["args"])
    assert not any(e["name"].startswith("AWS_") for e in c["env"])


def credential_files(spec: dict[str, Any]) -> dict[str, str]:
    """Each variable the head's env names a credentials file by -> the Secret key that file holds."""
    deployment = head_deployment(spec)
    c = container(deployment)
    [volume] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "s3-credentials"]
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "s3-credentials"]
    assert mount["readOnly"] is True and "subPath" not in mount  # whole: a Secret update reaches the files
    assert volume["secret"]["defaultMode"] == 0o440  # root and the pod's fsGroup; nobody else
    keys = {f"{mount['mountPath']}/{item['path']}": item["key"] for item in volume["secret"]["items"]}
    return {e["name"]: keys[e["value"]] for e in c["env"] if e["name"].endswith("_FILE")}


def test_the_credentials_are_files_of_the_secret_that_file_variables_name_never_env_values() -> None:
    """Env values reach every child process and /proc/<pid>/environ: the head gets files instead."""
    deployment = head_deployment(head_spec(results={"s3": S3}))
    env = container(deployment)["env"]
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & {e["name"] for e in env}
    assert not any("valueFrom" in e for e in env)
    assert credential_files(head_spec(results={"s3": S3})) == {
        "AWS_ACCESS_KEY_ID_FILE": "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY_FILE": "AWS_SECRET_ACCESS_KEY",
    }
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["s3-credentials"]["secret"]["secretName"] == "results-s3"


def test_the_credentials_secret_key_names_can_be_chosen() -> None:
    secret = {"name": "minio", "accessKeyIdKey": "rootUser", "secretAccessKeyKey": "rootPassword"}
    assert credential_files(head_spec(results={"s3": {**S3, "credentialsSecret": secret}})) == {
        "AWS_ACCESS_KEY_ID_FILE": "rootUser",
        "AWS_SECRET_ACCESS_KEY_FILE": "rootPassword",
    }


def test_the_head_reads_the_secret_s_values_from_the_files_the_operator_mounts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from triptych_head.objects import s3_credentials

    c = container(head_deployment(head_spec(results={"s3": S3})))
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "s3-credentials"]
    secret = {"AWS_ACCESS_KEY_ID": "minio\n", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}  # a trailing newline is dropped
    env: dict[str, str] = {}
    for name, key in credential_files(head_spec(results={"s3": S3})).items():
        path = next(e["value"] for e in c["env"] if e["name"] == name)
        local = tmp_path / path.removeprefix(mount["mountPath"] + "/")
        local.write_text(secret[key])
        env[name] = str(local)
    creds = s3_credentials("--results-store", env)
    assert {name: found.value for name, found in creds.items()} == {
        "AWS_ACCESS_KEY_ID": "minio",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
    }


def test_a_users_own_credential_value_replaces_the_operators_file_of_it() -> None:
    """The head refuses a variable beside its _FILE; the user's head.env value wins, as for any name."""
    mine = [{"name": "AWS_ACCESS_KEY_ID", "value": "minio"}]
    env = {e["name"] for e in container(head_deployment(head_spec(results={"s3": S3}, env=mine)))["env"]}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY_FILE"} <= env
    assert "AWS_ACCESS_KEY_ID_FILE" not in env


def test_a_bucket_without_a_credentials_secret_sets_no_credentials() -> None:
    env = container(head_deployment(head_spec(results={"s3": {"url": "s3://bucket/x"}})))["env"]
    assert not any(e["name"].startswith("AWS_") for e in env)


# ---------------------------------------------------------------- rollouts


@pytest.mark.parametrize(
    "head",
    [{}, {"results": {"s3": S3}}, {"results": {"s3": S3}, "replicas": 1}, {"results": CLAIM}],
    ids=["one-head-empty-dir", "two-heads-s3", "one-head-s3", "two-heads-claim"],
)
def test_a_rollout_starts_a_head_before_it_stops_one(head: dict[str, Any]) -> None:
    strategy = head_deployment(head_spec(**head))["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def test_a_single_head_on_a_claim_is_recreated_since_the_claim_may_be_read_write_once() -> None:
    strategy = head_deployment(head_spec(results=CLAIM, replicas=1))["spec"]["strategy"]
    assert strategy == {"type": "Recreate"}


def test_heads_spread_over_nodes_but_never_wait_for_one() -> None:
    deployment = head_deployment(head_spec(results={"s3": S3}))
    [spread] = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread == {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": deployment["spec"]["selector"],
    }


def test_readiness_stays_on_the_ready_route() -> None:
    probe = container(head_deployment(head_spec(results={"s3": S3})))["readinessProbe"]
    assert probe["httpGet"] == {"path": "/ready", "port": "http"}


# ---------------------------------------------------------------- the disruption budget


def test_several_heads_get_a_budget_that_evicts_one_at_a_time() -> None:
    spec = head_spec(results={"s3": S3})
    objs = children(spec)
    pdb = objs[PDB]
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == objs[("Deployment", "wan-t2v-head")]["spec"]["selector"]
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == OWNER["metadata"]["uid"]
    assert PDB_REF not in render(pipeline(spec)).delete


@pytest.mark.parametrize("head", [{}, {"results": {"s3": S3}, "replicas": 1}, {"replicas": 0}], ids=str)
def test_one_head_or_none_has_no_budget_and_an_earlier_one_is_removed(head: dict[str, Any]) -> None:
    assert PDB not in children(head_spec(**head))
    assert PDB_REF in render(pipeline(head_spec(**head))).delete


# ---------------------------------------------------------------- how workers find every head


def test_a_headless_service_lists_every_head_including_draining_and_starting_ones() -> None:
    objs = children(head_spec(results={"s3": S3}))
    heads = objs[("Service", "wan-t2v-heads")]["spec"]
    assert heads["clusterIP"] == "None"
    assert heads["publishNotReadyAddresses"] is True
    assert heads["selector"] == objs[("Deployment", "wan-t2v-head")]["spec"]["selector"]["matchLabels"]
    # Only what workers use: the result ports (the HTTP API is on <name>-api, the metrics' on <name>-head).
    assert {p["name"] for p in heads["ports"]} == {"result-encoder", "result-denoiser", "result-decoder"}
    # The ClusterIP one stays (clusterIP cannot become None in place; the metrics API reads it).
    assert objs[("Service", "wan-t2v-head")]["spec"]["type"] == "ClusterIP"


@pytest.mark.parametrize("role", [Role.ENCODER, Role.DENOISER, Role.DECODER], ids=lambda r: r.value)
def test_each_worker_reports_to_every_head_at_a_port_the_headless_service_has(role: Role) -> None:
    objs = children(head_spec(results={"s3": S3}))
    addr = parse_serve(container(objs[("Deployment", f"wan-t2v-{role.value}")])).disagg_server_addr
    assert addr == f"dns://wan-t2v-heads.{NAMESPACE}.svc.cluster.local:{HEAD_SCHEDULER_PORT}"
    # As the worker reads it (triptych.discovery): one endpoint per head pod the name resolves to.
    endpoints = expand(addr, resolver=lambda host: ["198.18.0.7", "198.18.1.9"])
    ports = {p["port"] for p in objs[("Service", "wan-t2v-heads")]["spec"]["ports"]}
    for endpoint in endpoints:
        assert int(result_endpoint(endpoint, role).rsplit(":", 1)[1]) in ports


def test_scaling_the_heads_rolls_no_worker() -> None:
    one, three = (
        children(head_spec(results={"s3": S3}, replicas=1)),
        children(head_spec(results={"s3": S3}, replicas=3)),
    )
    for key, obj in one.items():
        if key[0] == "Deployment" and key[1] != "wan-t2v-head":
            assert json.dumps(obj, sort_keys=True) == json.dumps(three[key], sort_keys=True), key


def test_a_deleted_head_keeps_serving_until_it_is_unrouted_then_drains_before_the_kill() -> None:
    deployment = head_deployment(head_spec(drainSeconds=300))
    c = container(deployment)
    [sleep, seconds] = c["lifecycle"]["preStop"]["exec"]["command"][-2:]
    assert sleep == "sleep" and int(seconds) == HEAD_UNROUTE_S
    # SIGTERM comes after the sleep; the head's deadline, its shutdown work and a margin still fit the grace period.
    drain = parse_serve(c).disagg_drain_timeout
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert HEAD_UNROUTE_S + drain + HEAD_SHUTDOWN_OVERHEAD_S + 10 <= grace == 300


def test_the_head_is_told_its_pipeline_so_it_marks_its_store_and_head_env_may_name_another() -> None:
    """Two pipelines given one store took over each other's records: the head marks its store as its
    pipeline's (head/triptych_head/store_owner.py) with the name the operator gives it."""
    env = container(head_deployment(head_spec(results={"s3": S3})))["env"]
    assert [e["value"] for e in env if e["name"] == PIPELINE_ENV] == [f"{NAMESPACE}/wan-t2v"]
    kept = head_spec(results={"s3": S3}, env=[{"name": PIPELINE_ENV, "value": "ml/old-name"}])
    assert [e["value"] for e in container(head_deployment(kept))["env"] if e["name"] == PIPELINE_ENV] == ["ml/old-name"]
