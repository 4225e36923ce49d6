"""The Helm chart: lints clean, renders least-privilege RBAC, and agrees with the operator's defaults."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.fixtures import cluster_settings
from tests.operator.helpers import REPO, minimal_spec, pipeline
from triptych_operator import manifests
from triptych_operator.constants import (
    ALLOWED_HOST_PATHS_ENV,
    DEFAULT_HEAD_IMAGE,
    DEFAULT_WORKER_IMAGE,
    HEAD_IMAGE_ENV,
    WORKER_IMAGE_ENV,
)
from triptych_operator.handlers import CHILD_KINDS
from triptych_operator.main import (
    LIVENESS_ENV,
    PEERING_ENV,
    PEERING_LIFETIME_ENV,
    POD_ID_ENV,
    WATCH_NAMESPACES_ENV,
    host_path_allow_list,
)
from triptych_operator.main import build_parser as operator_parser
from triptych_operator.metrics_api.main import build_parser as metrics_api_parser
from triptych_operator.metrics_api.prometheus import HEAD_GAUGES
from triptych_operator.spec.declaration import HOST_PATH_RULE

CHART = REPO / "charts" / "triptych"
PROMETHEUS_OPERATOR = "monitoring.coreos.com/v1"  # the API its PodMonitor and ServiceMonitor CRDs serve


@pytest.fixture(scope="module")
def helm_bin() -> Path:
    """The helm that tests/cluster/build.sh builds (only helm: no cluster is needed to lint or render)."""
    path = Path(cluster_settings()["BIN_DIR"]) / "helm"
    if not path.exists():
        pytest.fail(f"{path} is not built: run `make setup` (or `bash tests/cluster/build.sh`)", pytrace=False)
    return path


def helm(helm_path: Path, *args: str) -> str:
    proc = subprocess.run([str(helm_path), *args], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc.stdout


def render(helm_bin: Path, *sets: str, api_versions: Sequence[str] = ()) -> list[dict[str, Any]]:
    """`helm template` of the chart; `api_versions` are API groups/versions the cluster is said to serve."""
    flags = [f for s in sets for f in ("--set", s)] + [f for v in api_versions for f in ("--api-versions", v)]
    out = helm(helm_bin, "template", "rel", str(CHART), "--namespace", "ops", "--kube-version", "1.34.0", *flags)
    return [doc for doc in yaml.safe_load_all(out) if doc]


def operator_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-triptych")


def _undeclared(values: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """The keys of `values` the schema does not declare (a free map, with no `properties`, declares any)."""
    if not isinstance(values, dict) or "properties" not in schema:
        return []
    missing = [f"{path}.{k}".lstrip(".") for k in values if k not in schema["properties"]]
    return missing + [
        m
        for k, v in values.items()
        if k in schema["properties"]
        for m in _undeclared(v, schema["properties"][k], f"{path}.{k}")
    ]


def test_the_values_schema_declares_every_value_and_refuses_typos_and_wrong_types(helm_bin: Path) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert _undeclared(yaml.safe_load((CHART / "values.yaml").read_text()), schema) == []
    assert _undeclared({"monitoring": {"podMonitr": {}}}, schema) == ["monitoring.podMonitr"]  # the walk can fail
    for value, words in (
        ("monitoring.podMonitr.enabled=true", "at '/monitoring': additional properties 'podMonitr' not allowed"),
        ("replicas=two", "at '/replicas': got string, want integer"),
        (
            "image.pullPolicy=Sometimes",
            "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'",
        ),
        ("metricsApi.port=70000", "at '/metricsApi/port'"),
        ("monitoring.podMonitor.interval=soon", "at '/monitoring/podMonitor/interval'"),
        ("examplePipeline.name=demo.v2", "at '/examplePipeline/name'"),  # the operator refuses it: Invalid
    ):
        with pytest.raises(AssertionError, match=re.escape(words)):
            render(helm_bin, value)


def test_values_default_images_are_the_operators_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert (values["workerImage"], values["headImage"]) == (DEFAULT_WORKER_IMAGE, DEFAULT_HEAD_IMAGE)


def test_helm_lint_is_clean(helm_bin: Path) -> None:
    out = helm(helm_bin, "lint", "--strict", str(CHART), "--set", "examplePipeline.enabled=true")
    assert "[WARNING]" not in out and "[ERROR]" not in out


def test_cluster_wide_install_uses_a_cluster_role_without_wildcards(helm_bin: Path) -> None:
    docs = render(helm_bin, "metricsApi.enabled=false")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRole",
        "ClusterRoleBinding",
        "ClusterRoleBinding",
        "Deployment",
        "ServiceAccount",
    ]
    for role in (d for d in render(helm_bin) if d["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            assert "kopf.dev" not in rule["apiGroups"]  # standalone: no peering resources


def test_the_operator_may_delete_exactly_the_kinds_it_deletes(helm_bin: Path) -> None:
    """Least privilege: `delete` on every kind a reconcile may remove (a role's pool after a switch of
    encoder shape, an optional child turned off), and on nothing else."""
    shapes = (minimal_spec(), minimal_spec(promptEncoder={}, imageEncoder={}))
    deleted = {ref for spec in shapes for ref in manifests.render(pipeline(spec)).delete}
    kinds = {CHILD_KINDS[(ref.api_version, ref.kind)] for ref in deleted}
    assert {(group, plural) for group, _, plural, _ in kinds} == {
        (g, r)
        for doc in render(helm_bin, "metricsApi.enabled=false")
        if doc["kind"] == "ClusterRole" and doc["metadata"]["name"] == "rel-triptych"
        for rule in doc["rules"]
        if "delete" in rule["verbs"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }


def test_namespaced_install_uses_a_role_per_namespace(helm_bin: Path) -> None:
    docs = render(helm_bin, "watchNamespaces={a,b}")
    roles = sorted((d["metadata"]["name"], d["metadata"]["namespace"]) for d in docs if d["kind"] == "Role")
    assert roles == [
        ("rel-triptych", "a"),
        ("rel-triptych", "b"),
        ("rel-triptych-metrics-api", "a"),
        ("rel-triptych-metrics-api", "b"),
    ]
    deployment = operator_deployment(docs)
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TRIPTYCH_WATCH_NAMESPACES"] == "a,b"


def test_example_pipeline_is_optional_and_valid(helm_bin: Path) -> None:
    from triptych_operator.spec.rules import parse_pipeline

    assert not [d for d in render(helm_bin) if d["kind"] == "DiffusionPipeline"]
    [example] = [d for d in render(helm_bin, "examplePipeline.enabled=true") if d["kind"] == "DiffusionPipeline"]
    parse_pipeline(example["metadata"]["name"], "ops", example["spec"])


def test_the_operator_env_the_chart_sets_is_the_env_the_operator_reads(helm_bin: Path) -> None:
    deployment = operator_deployment(render(helm_bin))
    env = {e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    standalone = {WATCH_NAMESPACES_ENV, ALLOWED_HOST_PATHS_ENV, LIVENESS_ENV, WORKER_IMAGE_ENV, HEAD_IMAGE_ENV}
    assert env == standalone
    peered = operator_deployment(render(helm_bin, "replicas=2"))
    env = {e["name"] for e in peered["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env == standalone | {PEERING_ENV, PEERING_LIFETIME_ENV, POD_ID_ENV}


def operator_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {
        e["name"]: e.get("value") for e in operator_deployment(docs)["spec"]["template"]["spec"]["containers"][0]["env"]
    }


def test_allowed_host_paths_reach_the_operator_as_the_list_it_reads_and_none_by_default(helm_bin: Path) -> None:
    assert host_path_allow_list(None, operator_env(render(helm_bin))[ALLOWED_HOST_PATHS_ENV]) == ()
    listed = operator_env(render(helm_bin, "allowedHostPaths={/var/lib/triptych/models,/mnt/models}"))
    assert host_path_allow_list(None, listed[ALLOWED_HOST_PATHS_ENV]) == ("/var/lib/triptych/models", "/mnt/models")
    # Refused at install, as the operator would refuse them at its start: a relative folder, a '..' segment,
    # a comma (the operator reads the list comma-separated).
    for entry in ("models", "/srv/../etc", "/srv/models\\,old"):
        with pytest.raises(AssertionError, match=re.escape("at '/allowedHostPaths/0'")):
            render(helm_bin, f"allowedHostPaths={{{entry}}}")
    item = json.loads((CHART / "values.schema.json").read_text())["properties"]["allowedHostPaths"]["items"]
    assert f"matches('{item['pattern'].replace('[^/,]', '[^/]')}')" in HOST_PATH_RULE.cel
    assert f"!self.path.matches('{item['not']['pattern']}')" in HOST_PATH_RULE.cel


# ---------------------------------------------------------------- the custom metrics API

METRICS = "rel-triptych-metrics-api"


def by_kind_name(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_the_metrics_api_is_an_aggregated_api_whose_ca_verifies_its_certificate(helm_bin: Path, tmp_path: Path) -> None:
    objs = by_kind_name(render(helm_bin))
    service = objs[("Service", METRICS)]
    for version in ("v1beta2", "v1beta1"):
        api = objs[("APIService", f"{version}.custom.metrics.k8s.io")]["spec"]
        assert (api["group"], api["version"]) == ("custom.metrics.k8s.io", version)
        assert api["service"] == {"name": METRICS, "namespace": "ops", "port": service["spec"]["ports"][0]["port"]}
        assert "insecureSkipTLSVerify" not in api
    ca = base64.b64decode(objs[("APIService", "v1beta2.custom.metrics.k8s.io")]["spec"]["caBundle"])
    secret = objs[("Secret", f"{METRICS}-tls")]
    (tmp_path / "ca.crt").write_bytes(ca)
    (tmp_path / "tls.crt").write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
    # The kube-apiserver dials <service>.<namespace>.svc and checks the certificate against caBundle.
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), "-purpose", "sslserver",
         "-verify_hostname", f"{METRICS}.ops.svc", str(tmp_path / "tls.crt")],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    deployment = objs[("Deployment", METRICS)]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["volumes"][0]["secret"]["secretName"] == f"{METRICS}-tls"
    assert pod["serviceAccountName"] == METRICS
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]


def test_the_chart_starts_the_metrics_api_with_flags_it_accepts(helm_bin: Path) -> None:
    deployment = by_kind_name(render(helm_bin))[("Deployment", METRICS)]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["triptych-metrics-api"]
    assert "triptych-metrics-api" in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    args = metrics_api_parser().parse_args(container["args"])
    assert args.secure_port == container["ports"][0]["containerPort"]
    assert args.tls_cert_file.startswith(container["volumeMounts"][0]["mountPath"])


def test_log_format_reaches_the_operator_and_the_metrics_api_as_flags_they_accept(helm_bin: Path) -> None:
    for given, expected in (((), "text"), (("logFormat=json",), "json")):
        objs = by_kind_name(render(helm_bin, *given))
        operator = objs[("Deployment", "rel-triptych")]["spec"]["template"]["spec"]["containers"][0]
        metrics = objs[("Deployment", METRICS)]["spec"]["template"]["spec"]["containers"][0]
        assert operator_parser().parse_args(operator["args"]).log_format == expected
        assert metrics_api_parser().parse_args(metrics["args"]).log_format == expected
    verbose = by_kind_name(render(helm_bin, "verbose=true"))[("Deployment", "rel-triptych")]
    assert operator_parser().parse_args(verbose["spec"]["template"]["spec"]["containers"][0]["args"]).verbose
    with pytest.raises(AssertionError, match=re.escape("at '/logFormat': value must be one of 'text', 'json'")):
        render(helm_bin, "logFormat=xml")


def test_the_heads_ca_reaches_the_metrics_api_as_the_file_its_flag_names(helm_bin: Path) -> None:
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    objs = by_kind_name(render(helm_bin, f"metricsApi.headsCABundle={base64.b64encode(pem.encode()).decode()}"))
    assert objs[("ConfigMap", f"{METRICS}-heads-ca")]["data"] == {"ca.crt": pem}
    pod = objs[("Deployment", METRICS)]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = metrics_api_parser().parse_args(container["args"])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "heads-ca")
    assert args.head_ca_file == f"{mount['mountPath']}/ca.crt"
    assert {"name": "heads-ca", "configMap": {"name": f"{METRICS}-heads-ca"}} in pod["volumes"]
    default = by_kind_name(render(helm_bin))  # unset: no CA, the flag not given (HTTPS heads scraped unverified)
    assert (
        metrics_api_parser()
        .parse_args(default[("Deployment", METRICS)]["spec"]["template"]["spec"]["containers"][0]["args"])
        .head_ca_file
        is None
    )
    assert ("ConfigMap", f"{METRICS}-heads-ca") not in default


@pytest.mark.parametrize(
    "bundle",
    ["-----BEGIN CERTIFICATE-----MIIB-----END CERTIFICATE-----", "not base64!", base64.b64encode(b"MIIB").decode()],
    ids=["plain-pem", "not-base64", "base64-of-no-pem"],
)
def test_a_heads_ca_that_is_not_base64_pem_is_refused_naming_the_value(helm_bin: Path, bundle: str) -> None:
    """A metrics API handed garbage as its --head-ca-file would crash-loop: refuse it at install instead."""
    flags = ["template", "rel", str(CHART), "--set-string", f"metricsApi.headsCABundle={bundle}"]
    proc = subprocess.run([str(helm_bin), *flags], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0, proc.stdout
    assert "metricsApi.headsCABundle must be the base64 of the heads' CA certificate in PEM" in proc.stderr


def test_metrics_api_rbac_follows_the_extension_apiserver_convention(helm_bin: Path) -> None:
    objs = by_kind_name(render(helm_bin))
    sa = {"kind": "ServiceAccount", "name": METRICS, "namespace": "ops"}
    delegator = objs[("ClusterRoleBinding", f"{METRICS}:system:auth-delegator")]
    assert (delegator["roleRef"]["name"], delegator["subjects"]) == ("system:auth-delegator", [sa])
    reader = objs[("RoleBinding", f"{METRICS}-auth-reader")]
    assert reader["metadata"]["namespace"] == "kube-system"
    assert (reader["roleRef"]["name"], reader["subjects"]) == ("extension-apiserver-authentication-reader", [sa])
    hpa = objs[("ClusterRoleBinding", f"{METRICS}-reader")]
    assert hpa["subjects"] == [
        {"kind": "ServiceAccount", "name": "horizontal-pod-autoscaler", "namespace": "kube-system"}
    ]
    [rule] = objs[("ClusterRole", f"{METRICS}-reader")]["rules"]
    # Exactly the metrics the server serves, each a subresource of deployments.apps.
    assert sorted(rule["resources"]) == sorted(f"deployments.apps/{m}" for m in HEAD_GAUGES)
    own = objs[("ClusterRole", METRICS)]["rules"]
    assert {(g, r, v) for rule in own for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]} == {
        ("triptych.ai", "diffusionpipelines", "get"),
        ("triptych.ai", "diffusionpipelines", "list"),
        ("discovery.k8s.io", "endpointslices", "list"),
    }


def test_the_metrics_api_can_be_turned_off(helm_bin: Path) -> None:
    docs = render(helm_bin, "metricsApi.enabled=false")
    assert not [d for d in docs if "metrics-api" in d["metadata"]["name"] or d["kind"] == "APIService"]


def test_a_users_certificate_secret_comes_with_its_ca(helm_bin: Path) -> None:
    objs = by_kind_name(render(helm_bin, "metricsApi.tls.secretName=mine", "metricsApi.tls.caBundle=Q0E="))
    assert ("Secret", f"{METRICS}-tls") not in objs
    assert objs[("APIService", "v1beta2.custom.metrics.k8s.io")]["spec"]["caBundle"] == "Q0E="
    assert objs[("Deployment", METRICS)]["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == "mine"
    flags = ["template", "rel", str(CHART), "--set", "metricsApi.tls.secretName=mine"]
    proc = subprocess.run([str(helm_bin), *flags], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "metricsApi.tls.caBundle" in proc.stderr


def series_matcher(series_query: str) -> re.Pattern[str]:
    """The metric names a prometheus-adapter rule's seriesQuery selects (`__name__=~"..."` or `__name__="..."`)."""
    found = re.search(r'__name__(=~?)"([^"]+)"', series_query)
    assert found is not None, series_query
    return re.compile(found.group(2) if found.group(1) == "=~" else re.escape(found.group(2)))


def test_prometheus_alternative_yields_the_same_metric_names(helm_bin: Path) -> None:
    sets = ("metricsApi.enabled=false", "monitoring.podMonitor.enabled=true",
            "metricsApi.prometheus.adapterRules.enabled=true")  # fmt: skip
    objs = by_kind_name(render(helm_bin, *sets, api_versions=[PROMETHEUS_OPERATOR]))
    monitor = objs[("PodMonitor", "rel-triptych-heads")]["spec"]
    assert monitor["selector"]["matchLabels"]["app.kubernetes.io/component"] == "head"
    # The deployment label's values: test_chart_monitoring.py applies the relabelings.
    assert {r["targetLabel"] for r in monitor["podMetricsEndpoints"][0]["metricRelabelings"]} == {"deployment"}
    rules = yaml.safe_load(objs[("ConfigMap", "rel-triptych-prometheus-adapter-rules")]["data"]["config.yaml"])["rules"]
    for metric, gauge in HEAD_GAUGES.items():
        [rule] = [r for r in rules if series_matcher(r["seriesQuery"]).fullmatch(gauge)]
        assert rule["resources"]["overrides"]["deployment"] == {"group": "apps", "resource": "deployment"}
        served = re.compile(rule["name"]["matches"])
        assert served.sub(rule["name"]["as"].replace("${1}", r"\1"), gauge) == metric


def test_replicas_above_one_peer_through_kopf_with_only_the_peering_rights_they_need(helm_bin: Path) -> None:
    docs = render(helm_bin, "replicas=2", "watchNamespaces={a,b}", "metricsApi.enabled=false")
    deployment = operator_deployment(docs)
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    env = {
        e["name"]: e["value"] if "value" in e else e["valueFrom"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["TRIPTYCH_PEERING"] == "rel-triptych" and env["TRIPTYCH_PEERING_LIFETIME"] == "60"
    assert env[POD_ID_ENV] == {"fieldRef": {"fieldPath": "metadata.name"}}  # its peer name: the pod's
    peerings = sorted((d["kind"], d["metadata"]["namespace"]) for d in docs if d["apiVersion"] == "kopf.dev/v1")
    assert peerings == [("KopfPeering", "a"), ("KopfPeering", "b")]
    for role in (d for d in docs if d["kind"] == "Role"):
        peering_rules = [r for r in role["rules"] if "kopf.dev" in r["apiGroups"]]
        assert peering_rules == [
            {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"], "verbs": ["get", "list", "watch", "patch"]}
        ]
    cluster_wide = render(helm_bin, "replicas=2", "metricsApi.enabled=false")
    assert [d["kind"] for d in cluster_wide if d["apiVersion"] == "kopf.dev/v1"] == ["ClusterKopfPeering"]
    crds = yaml.safe_load_all((CHART / "crds" / "kopf-peerings.yaml").read_text())
    assert sorted(c["metadata"]["name"] for c in crds) == ["clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"]
