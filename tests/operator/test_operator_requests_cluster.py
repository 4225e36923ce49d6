"""What the operator costs the API server: requests proportional to what changed, none at rest.

The operator runs as its own process under the chart's ServiceAccount, and FlowSchemas that match
only that account count its requests (tests/operator/api_requests.py), so other tests sharing the
cluster do not disturb the figures.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.fixtures import KubeCluster, poll
from tests.operator.api_requests import RequestCounter, delta
from tests.operator.test_operator_cluster import (
    CHART,
    CRD,
    _healthz,
    apply,
    free_port,
    get,
    operator_command,
    pipeline_manifest,
    service_account_kubeconfig,
    wait_phase,
)

pytestmark = pytest.mark.cluster

STEADY_S = 60
# One pipeline's children: 4 Deployments, 6 Services (the roles', the head's, the heads' headless one,
# the api), 2 NetworkPolicies; plus its key Secret and kopf's one annotation of the handled spec on the
# pipeline. One head (the example's results are not shared): no PodDisruptionBudget.
CHILDREN = 12
CREATE_WRITES = CHILDREN + 1 + 1


class Operator:
    """`triptych-operator` as a process, as the chart's ServiceAccount, with its requests counted."""

    def __init__(self, cluster: KubeCluster, namespace: str, tmp_path: Path) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.release = f"r{namespace[-6:]}"
        self.account = f"{self.release}-triptych"
        self.counter = RequestCounter(cluster, namespace, self.account)
        self.log_path = tmp_path / "operator.log"
        self.tmp_path = tmp_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        flags = ["--set", f"watchNamespaces={{{self.namespace}}}", "--set", "metricsApi.enabled=false"]
        self.cluster.helm("install", self.release, str(CHART), "--namespace", self.namespace, *flags, timeout=120)
        self.counter.install()
        kubeconfig = service_account_kubeconfig(
            self.cluster, self.namespace, self.account, self.tmp_path / "operator.kubeconfig"
        )
        port = free_port()
        env = {**self.cluster.env, "KUBECONFIG": str(kubeconfig)}
        self.proc = subprocess.Popen(
            operator_command(self.namespace, port), env=env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT
        )
        poll(lambda: _healthz(port), timeout=60, what="the operator's liveness endpoint")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.counter.remove()
        self.cluster.helm("uninstall", self.release, "--namespace", self.namespace, check=False, timeout=120)

    def log(self) -> str:
        return self.log_path.read_text()[-3000:]


@pytest.fixture
def counted_operator(kube_cluster: KubeCluster, kube_namespace: str, tmp_path: Path) -> Iterator[Operator]:
    kube_cluster.apply_crd(CRD)
    operator = Operator(kube_cluster, kube_namespace, tmp_path)
    try:
        operator.start()
        yield operator
    finally:
        operator.stop()


def test_requests_follow_changes_and_stop_at_rest(kube_cluster: KubeCluster, counted_operator: Operator) -> None:
    cluster, ns, counter = kube_cluster, counted_operator.namespace, counted_operator.counter
    started = counter.wait_quiet()

    # One create: each child applied once, the key Secret created once, nothing listed per event.
    apply(cluster, ns, pipeline_manifest("cost"))
    wait_phase(cluster, ns, "cost", "Ready")
    created = counter.wait_quiet()
    create = delta(created, started)
    print(f"one create: {create}")
    assert create["writes"] == CREATE_WRITES, (create, counted_operator.log())
    # Reads: the Secret's existence check, the first look at each child (not yet in the watch), discovery.
    assert create["reads"] <= CHILDREN + 1 + 25, create
    # Written only when it changes: per component missing, rolling out (pods 0/n ... n/n), ready; racing events
    # coalesce, so the count depends on timing (6-11 seen), never on how many events arrived.
    assert 1 <= create["status"] <= 20, create
    # Events: the new keys, one naming every child created, the phase changes (Progressing, Ready); none per child.
    assert 1 <= create["events"] <= 5, create

    # A pod event that changes nothing the status reports costs nothing at all.
    pods = (get(cluster, ns, "pods", "-l", "app.kubernetes.io/instance=cost") or {})["items"]
    denoiser = next(p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/component"] == "denoiser")
    cluster.kubectl("label", "pod", denoiser["metadata"]["name"], "-n", ns, "touched=yes")
    time.sleep(3)
    labelled = counter.wait_quiet(quiet_s=3)
    assert delta(labelled, created) == dict.fromkeys(created, 0)

    # A pod lost and replaced: the status follows it (written when it changes), nothing is applied or read.
    cluster.kubectl("delete", "pod", denoiser["metadata"]["name"], "-n", ns, "--wait=false")

    def replacement_ready() -> bool:
        now = (get(cluster, ns, "pods", "-l", "app.kubernetes.io/component=denoiser") or {})["items"]
        names = {p["metadata"]["name"] for p in now if p["status"].get("phase") == "Running"}
        return len(names) == 2 and denoiser["metadata"]["name"] not in names

    poll(replacement_ready, timeout=60, what="a replacement denoiser pod")
    wait_phase(cluster, ns, "cost", "Ready")
    replaced = counter.wait_quiet()
    pod_loss = delta(replaced, labelled)
    print(f"one pod replaced: {pod_loss}")
    assert pod_loss["writes"] == 0 and pod_loss["reads"] == 0, pod_loss
    assert pod_loss["status"] <= 4, pod_loss  # 0 when kwok replaced the pod between two status reads

    # Steady state: a minute with nothing changing writes nothing.
    time.sleep(STEADY_S)
    steady = delta(counter.snapshot(), replaced)
    print(f"{STEADY_S} s at rest: {steady}")
    assert steady["writes"] == steady["status"] == steady["events"] == 0, steady
    # No polling: at most a watch the API server ended and the operator reopened (one request each).
    assert steady["reads"] <= 2, steady
    assert json.loads(cluster.kubectl("get", "dp", "cost", "-n", ns, "-o", "json").stdout)["status"]["phase"] == "Ready"
