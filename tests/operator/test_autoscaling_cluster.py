"""Autoscaling end to end on the local control plane: a real head under real load, the custom
metrics API server, the aggregator, the real HPA controller and the operator.

The pods of the local cluster are kwok's (no container runs), so the pipeline's head runs here as
a local process (with null workers whose denoiser is slow, so requests queue) and the pipeline
says where it is with the `triptych.ai/head-metrics-url` annotation, the documented override. The
metrics API server also runs here, as `triptych-metrics-api`, with the ServiceAccount, RBAC,
APIServices and Service the Helm chart renders; the Service has no selector and an EndpointSlice
points the aggregator at the server. The aggregator only routes to addresses an Endpoint may hold
(not loopback), so the server listens on 192.0.2.251 (TEST-NET-1) put on this machine for the test.
"""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kopf.testing import KopfRunner

from tests.cluster.fixtures import KubeCluster, poll
from tests.local_address import local_address
from tests.operator.helpers import REPO
from tests.operator.test_operator_cluster import CRD, apply, condition, get, pipeline_manifest
from triptych.roles import Role
from triptych_dev.localdeploy import free_port_block, local_deployment
from triptych_operator.constants import HEAD_METRICS_URL_ANNOTATION
from triptych_operator.metrics_api.source import HeadEndpoint, KubePipelineReader, head_metrics_urls
from triptych_operator.wake import ASLEEP

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CHART = REPO / "charts" / "triptych"
METRICS_IP = "192.0.2.251"
METRICS_DEVICE = "trp-metrics"
CUSTOM_METRICS = "/apis/custom.metrics.k8s.io/v1beta2"
APISERVICES = ("v1beta2.custom.metrics.k8s.io", "v1beta1.custom.metrics.k8s.io")
STEP_SECONDS = 0.05  # null denoiser: 20 steps take 1 s, so a few concurrent clients keep work queued
STEPS = 20
CLIENTS = 6
TARGET_WORK_SECONDS = 1  # per replica: ~6 s of pending work asks for the maximum
MAX_REPLICAS = 4


@pytest.fixture
def metrics_address() -> Iterator[str]:
    """192.0.2.251 on this machine: on a dummy interface, or (no dummy driver) as a /32 on lo."""
    with local_address(METRICS_IP, METRICS_DEVICE) as address:
        yield address


def _available(apiservice: dict[str, Any]) -> bool:
    conditions = (apiservice.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Available" and c.get("status") == "True" for c in conditions)


def render_chart(cluster: KubeCluster, release: str, namespace: str) -> list[dict[str, Any]]:
    out = cluster.helm("template", release, str(CHART), "--namespace", namespace, "--set", "metricsApi.cacheSeconds=2")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def metrics_api_objects(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the chart installs for the metrics API, less its Deployment (the server runs here)."""
    picked = []
    for doc in docs:
        component = doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        if component != "metrics-api" or doc["kind"] in ("Deployment", "Secret"):
            continue
        if doc["kind"] == "Service":
            doc["spec"].pop("selector")  # no pod behind it: the EndpointSlice below says where the server is
        picked.append(doc)
    return picked


def sa_kubeconfig(cluster: KubeCluster, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig with the chart's ServiceAccount token: the server gets exactly the chart's RBAC."""
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": admin["clusters"],
                "users": [{"name": account, "user": {"token": token}}],
                "contexts": [{"name": "sa", "context": {"cluster": admin["clusters"][0]["name"], "user": account}}],
                "current-context": "sa",
            }
        )
    )
    return path


def load(url: str, stop: threading.Event, counts: list[int], deadline: float) -> None:
    """One client: image requests back to back until told to stop (or the deadline)."""
    body = {"prompt": "a lighthouse", "size": "32x32", "seed": 1, "num_inference_steps": STEPS}
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set() and time.monotonic() < deadline:
            if client.post("/v1/images/generations", json=body).status_code == 200:
                counts.append(1)


@contextmanager
def under_load(url: str, seconds: float) -> Iterator[list[int]]:
    """CLIENTS clients sending requests to the head at `url` until the block ends (or `seconds` pass:
    the load stops by itself even if the test fails); yields the list of completed requests."""
    stop = threading.Event()
    deadline = time.monotonic() + seconds
    done: list[int] = []
    clients = [threading.Thread(target=load, args=(url, stop, done, deadline)) for _ in range(CLIENTS)]
    for client in clients:
        client.start()
    try:
        yield done
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=70)


def autoscaled_pipeline(
    cluster: KubeCluster, namespace: str, name: str, head_url: str, min_replicas: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pipeline whose denoiser the HPA scales (5 s stabilization), its heads' metrics read from the
    local head at `head_url`; (its manifest, its denoiser's HPA as the operator made it)."""
    autoscaling = {
        "enabled": True,
        "minReplicas": min_replicas,
        "maxReplicas": MAX_REPLICAS,
        "targetWorkSecondsPerReplica": TARGET_WORK_SECONDS,
        "scaleDownStabilizationSeconds": 5,
    }
    cr = pipeline_manifest(name, denoiser={"autoscaling": autoscaling})
    cr["metadata"]["annotations"] = {HEAD_METRICS_URL_ANNOTATION: f"{head_url}/metrics"}
    apply(cluster, namespace, cr)
    hpa = poll(lambda: get(cluster, namespace, "hpa", f"{name}-denoiser"), what="the operator's HPA")
    return cr, hpa


def replicas(cluster: KubeCluster, namespace: str, name: str) -> int:
    dep = get(cluster, namespace, "deployment", name) or {}
    return int((dep.get("spec") or {}).get("replicas") or 0)


def managed_fields(cluster: KubeCluster, namespace: str, name: str) -> list[dict[str, Any]]:
    """The Deployment's managedFields (kubectl leaves them out of its output unless asked)."""
    dep = get(cluster, namespace, "deployment", name, "--show-managed-fields") or {}
    fields = dep["metadata"].get("managedFields")
    assert fields, f"deployment {name} shows no managedFields"  # else the checks below would pass for nothing
    return list(fields)


def operator_owns_replicas(cluster: KubeCluster, namespace: str, name: str) -> bool:
    for entry in managed_fields(cluster, namespace, name):
        if entry.get("manager") == "triptych-operator" and "f:replicas" in json.dumps(entry.get("fieldsV1", {})):
            return True
    return False


@pytest.fixture
def custom_metrics_api(
    kube_cluster: KubeCluster, kube_namespace: str, metrics_address: str, tmp_path: Path
) -> Iterator[None]:
    """triptych-metrics-api as a local process, registered with the objects the chart renders."""
    cluster, ns = kube_cluster, kube_namespace
    docs = render_chart(cluster, f"am-{ns[-6:]}", ns)
    objects = metrics_api_objects(docs)
    service = next(d for d in objects if d["kind"] == "Service")
    account_name = next(d for d in objects if d["kind"] == "ServiceAccount")["metadata"]["name"]
    secret = next(d for d in docs if d["kind"] == "Secret")
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    crt.write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
    key.write_bytes(base64.b64decode(secret["data"]["tls.key"]))
    ca = base64.b64decode(next(d for d in objects if d["kind"] == "APIService")["spec"]["caBundle"])
    outside_namespace = [d for d in objects if d["metadata"].get("namespace", "kube-system") == "kube-system"]
    for existing in APISERVICES:
        other = get(cluster, "default", "apiservice", existing)
        if not other or (other["spec"].get("service") or {}).get("namespace") == ns:
            continue
        if _available(other):  # another session's live server: never take it over
            pytest.fail(f"APIService {existing} is already served by {other['spec'].get('service')}", pytrace=False)
        # Left by a run killed before its teardown (a reused machine): nothing answers behind it.
        cluster.kubectl("delete", "apiservice", existing, "--ignore-not-found")
    port = free_port_block(1)
    endpoint_slice = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service['metadata']['name']}-local",
            "labels": {
                "kubernetes.io/service-name": service["metadata"]["name"],
                "endpointslice.kubernetes.io/managed-by": "triptych-tests",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [metrics_address], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
    }
    log_path = tmp_path / "metrics-api.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        endpoint_slice["metadata"]["namespace"] = ns
        # The account first, the routing to the server once it serves. Each object names its
        # namespace (the chart's, or kube-system for the auth reader binding).
        service_and_slice = [service, endpoint_slice]
        apiservices = [d for d in objects if d["kind"] == "APIService"]
        account = [d for d in objects if d["kind"] not in ("Service", "APIService")]
        cluster.apply("\n---\n".join(json.dumps(d) for d in account))
        kubeconfig = sa_kubeconfig(cluster, ns, account_name, tmp_path / "sa.kubeconfig")
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "triptych_operator.metrics_api", "--bind-address", metrics_address,
                 "--secure-port", str(port), "--tls-cert-file", str(crt), "--tls-private-key-file", str(key),
                 "--cache-seconds", "2", "--kubeconfig", str(kubeconfig)],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        tls = ssl.create_default_context(cadata=ca.decode())
        tls.check_hostname = False  # the certificate names the Service, not the address

        def healthy() -> bool:
            assert proc is not None and proc.poll() is None, log_path.read_text()
            try:
                url = f"https://{metrics_address}:{port}/healthz"
                return bool(urllib.request.urlopen(url, context=tls, timeout=2).status == 200)
            except OSError:
                return False

        poll(healthy, timeout=30, what="triptych-metrics-api to serve")
        cluster.apply("\n---\n".join(json.dumps(d) for d in service_and_slice))
        cluster.apply("\n---\n".join(json.dumps(d) for d in apiservices))
        cluster.wait_condition(f"apiservice/{APISERVICES[0]}", "Available")
        yield
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for doc in outside_namespace:
            kind, name = doc["kind"].lower(), doc["metadata"]["name"]
            where = ["-n", doc["metadata"]["namespace"]] if doc["metadata"].get("namespace") else []
            cluster.kubectl("delete", kind, name, *where, "--ignore-not-found", "--wait=false", check=False)


@pytest.fixture
def operator(kube_cluster: KubeCluster, kube_namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[KopfRunner]:
    """The operator in this process, watching the test namespace, with this branch's CRD."""
    kube_cluster.apply_crd(CRD)
    monkeypatch.setenv("KUBECONFIG", kube_cluster.kubeconfig)
    args = ["run", "--standalone", "--namespace", kube_namespace, "-m", "triptych_operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        yield runner
    assert runner.exception is None, runner.output


@pytest.fixture
def busy_head(tiny_models: dict[str, Path], tmp_path: Path) -> Iterator[str]:
    """A real head with null workers whose denoiser takes STEP_SECONDS a step; yields its HTTP URL."""
    with local_deployment(
        tiny_models["tiny-flux"],
        tmp_path / "deployment",
        null_payload_bytes=4096,
        worker_flags=("--device", "cpu"),
        role_flags={Role.DENOISER: ("--step-seconds", str(STEP_SECONDS))},
    ) as dep:
        yield dep.http


def test_a_heads_pending_work_drives_the_real_hpa_up_and_back_down(
    kube_cluster: KubeCluster,
    kube_namespace: str,
    custom_metrics_api: None,
    operator: KopfRunner,
    busy_head: str,
) -> None:
    cluster, ns = kube_cluster, kube_namespace
    _, hpa = autoscaled_pipeline(cluster, ns, "auto", busy_head, min_replicas=1)
    target = hpa["spec"]["metrics"][0]["object"]["target"]
    assert target == {"type": "AverageValue", "averageValue": str(TARGET_WORK_SECONDS)}, "the CRD lacks the field?"
    poll(lambda: replicas(cluster, ns, "auto-denoiser") == 1, what="the denoiser Deployment")

    with under_load(busy_head, 150) as done:
        path = f"{CUSTOM_METRICS}/namespaces/{ns}/deployments.apps/auto-denoiser/triptych_pending_work_seconds"

        def pending_work() -> dict[str, Any] | None:
            proc = cluster.kubectl("get", "--raw", path, check=False)
            if proc.returncode != 0:
                return None
            [item] = json.loads(proc.stdout)["items"]
            return item if parse_quantity(item["value"]) > TARGET_WORK_SECONDS else None

        item = poll(pending_work, timeout=60, interval=1, what="kubectl get --raw to return the head's pending work")
        assert item["describedObject"] == {
            "kind": "Deployment",
            "namespace": ns,
            "name": "auto-denoiser",
            "apiVersion": "apps/v1",
        }

        scaled = poll(
            lambda: (lambda n: n if n > 1 else None)(replicas(cluster, ns, "auto-denoiser")),
            timeout=90,
            interval=1,
            what="the HPA to scale the denoiser up",
        )
        current = (get(cluster, ns, "hpa", "auto-denoiser") or {})["status"]["currentMetrics"][0]["object"]
        assert current["metric"]["name"] == "triptych_pending_work_seconds"
        # The operator reconciles on every change of its Deployment, and leaves the HPA's count alone.
        poll(
            lambda: status_replicas(cluster, ns, "auto") == replicas(cluster, ns, "auto-denoiser"),
            timeout=30,
            what="the pipeline's status to report the HPA's replica count",
        )
        assert replicas(cluster, ns, "auto-denoiser") >= scaled
        assert not operator_owns_replicas(cluster, ns, "auto-denoiser")
    assert done, "no request completed under load"

    poll(
        lambda: replicas(cluster, ns, "auto-denoiser") == 1,
        timeout=120,
        interval=1,
        what="the HPA to scale the denoiser back down after the load stopped",
    )
    assert not operator_owns_replicas(cluster, ns, "auto-denoiser")


def annotations(cluster: KubeCluster, namespace: str, name: str) -> dict[str, str]:
    return dict(((get(cluster, namespace, "deployment", name) or {}).get("metadata") or {}).get("annotations") or {})


def event_reasons(cluster: KubeCluster, namespace: str, pipeline: str) -> list[str]:
    events = get(cluster, namespace, "events", "--field-selector", f"involvedObject.name={pipeline}") or {}
    return [e["reason"] for e in events.get("items", [])]


def test_a_role_that_scales_to_zero_sleeps_while_idle_and_wakes_for_pending_work(
    kube_cluster: KubeCluster,
    kube_namespace: str,
    custom_metrics_api: None,
    operator: KopfRunner,
    busy_head: str,
) -> None:
    """autoscaling.minReplicas 0: the operator takes the idle denoiser to 0 (the HPA stands aside at 0),
    back up when the head reports work for it, and to 0 again once the work is done; the pipeline
    stays Ready at 0. The head's own workers are local processes here: what is shown is the signal
    (head -> metrics API -> operator) moving the Deployment, not pods starting."""
    cluster, ns = kube_cluster, kube_namespace
    cr, hpa = autoscaled_pipeline(cluster, ns, "zero", busy_head, min_replicas=0)
    assert hpa["spec"]["minReplicas"] == 1
    head = get(cluster, ns, "deployment", "zero-head") or {}
    args = head["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--disagg-no-instance-wait") + 1] == "600.0"  # requests wait for a pod to start

    poll(lambda: replicas(cluster, ns, "zero-denoiser") == 0, timeout=90, interval=1, what="the idle denoiser at 0")
    # (a scale to 0 leaves no managedFields entry: the Scale object omits a zero count; its Event names the step)
    assert not operator_owns_replicas(cluster, ns, "zero-denoiser")  # its applies still leave replicas alone
    ready = poll(
        lambda: (lambda c: c if c.get("reason") == "IdleAtZero" else None)(
            condition(get(cluster, ns, "dp", "zero"), "DenoiserReady")
        ),
        timeout=30,
        what="the status to say the denoiser sleeps",
    )
    assert ready["status"] == "True"
    poll(lambda: "ScaledToZero" in event_reasons(cluster, ns, "zero"), timeout=30, what="the ScaledToZero event")

    with under_load(busy_head, 120) as done:
        woken = poll(
            lambda: (lambda n: n if n > 0 else None)(replicas(cluster, ns, "zero-denoiser")),
            timeout=60,
            interval=1,
            what="pending work to wake the denoiser",
        )
        assert 1 <= woken <= MAX_REPLICAS
        poll(
            lambda: "ScaledFromZero" in event_reasons(cluster, ns, "zero"), timeout=30, what="the ScaledFromZero event"
        )
    assert done, "no request completed under load"
    poll(
        lambda: replicas(cluster, ns, "zero-denoiser") == 0,
        timeout=120,
        interval=1,
        what="the denoiser back at 0 once its work was done",
    )
    assert ASLEEP in annotations(cluster, ns, "zero-denoiser")

    # minReplicas raised while it sleeps: its HPA would stand aside at 0 for good, so the reconcile wakes it.
    cr["spec"]["denoiser"]["autoscaling"]["minReplicas"] = 2
    apply(cluster, ns, cr)
    poll(lambda: replicas(cluster, ns, "zero-denoiser") >= 2, timeout=60, interval=1, what="the raised minimum")
    poll(lambda: ASLEEP not in annotations(cluster, ns, "zero-denoiser"), timeout=30, what="the asleep mark to go")


def status_replicas(cluster: KubeCluster, namespace: str, name: str) -> int | None:
    status = (get(cluster, namespace, "dp", name) or {}).get("status") or {}
    return (status.get("denoiser") or {}).get("replicas")


def parse_quantity(text: str) -> float:
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_without_the_annotation_the_heads_are_the_head_services_endpoints_those_serving_required(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    """The default discovery, through the real API: EndpointSlices of <pipeline>-head, ready ones only."""
    from kubernetes import config

    ns = kube_namespace
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "flux-head-abc", "namespace": ns, "labels": {"kubernetes.io/service-name": "flux-head"}},
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": ["192.0.2.10"], "conditions": {"ready": True}},
            {"addresses": ["192.0.2.11"], "conditions": {"ready": False}},  # e.g. terminating
            # As with publishNotReadyAddresses (the head Service): ready whatever the pod, serving its readiness.
            {"addresses": ["192.0.2.12"], "conditions": {"ready": True, "serving": False}},
        ],
        "ports": [{"name": "http", "port": 30000, "protocol": "TCP"}],
    }
    other = {
        **slice_,
        "metadata": {**slice_["metadata"], "name": "other", "labels": {"kubernetes.io/service-name": "x"}},
    }
    kube_cluster.apply("\n---\n".join(json.dumps(s) for s in (slice_, other)))
    reader = KubePipelineReader(config.new_client_from_config(config_file=kube_cluster.kubeconfig))
    pipeline = {"metadata": {"name": "flux", "namespace": ns}, "spec": {"head": {"port": 31000}}}
    assert head_metrics_urls(pipeline, reader) == [
        HeadEndpoint("http://192.0.2.10:31000/metrics", required=True),
        HeadEndpoint("http://192.0.2.11:31000/metrics", required=False),
        HeadEndpoint("http://192.0.2.12:31000/metrics", required=False),
    ]
    assert reader.get_pipeline(ns, "no-such-pipeline") is None
