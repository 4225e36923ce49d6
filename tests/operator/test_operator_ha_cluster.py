"""Two operator replicas (kopf peering, as the chart runs them with replicas > 1): one works, the
other waits; killed, the working one is replaced within the stated time and an edit made meanwhile
is applied exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.fixtures import KubeCluster, poll
from tests.operator.test_operator_cluster import (
    CHART,
    CRD,
    _healthz,
    apply,
    children,
    free_port,
    get,
    operator_command,
    pipeline_manifest,
    service_account_kubeconfig,
    wait_phase,
)

pytestmark = pytest.mark.cluster

LIFETIME_S = 10  # --peering-lifetime: a replica silent this long is taken for dead
HANDOVER_S = LIFETIME_S + 20  # the stated bound: the lifetime, then a re-list and one reconcile


class Replica:
    def __init__(self, name: str, proc: subprocess.Popen[bytes], log: Path, port: int) -> None:
        self.name, self.proc, self.log_path, self.port = name, proc, log, port

    def log(self) -> str:
        return self.log_path.read_text()


@pytest.fixture
def release(kube_cluster: KubeCluster, kube_namespace: str) -> Iterator[str]:
    kube_cluster.apply_crd(CRD)
    release = f"r{kube_namespace[-6:]}"
    flags = ["--set", f"watchNamespaces={{{kube_namespace}}}", "--set", "metricsApi.enabled=false"]
    flags += ["--set", "replicas=2", "--set", f"peeringLifetimeSeconds={LIFETIME_S}"]
    kube_cluster.helm("install", release, str(CHART), "--namespace", kube_namespace, *flags, timeout=120)
    yield release
    kube_cluster.helm("uninstall", release, "--namespace", kube_namespace, check=False, timeout=120)


class Replicas:
    """Operator replicas of a release's peering, started as the chart's pods run them: the release's
    service account (`kubeconfig`), each its peer name (POD_ID, as in a pod) and its log in `workdir`."""

    def __init__(self, cluster: KubeCluster, namespace: str, release: str, workdir: Path) -> None:
        self.cluster, self.namespace, self.peering, self.workdir = cluster, namespace, f"{release}-triptych", workdir
        self.kubeconfig = service_account_kubeconfig(cluster, namespace, self.peering, workdir / "kc")
        self.started: list[Replica] = []

    def start(self, name: str, priority: int) -> Replica:
        """A replica `name` of `priority`, once its liveness endpoint answers."""
        port = free_port()
        cmd = operator_command(self.namespace, port)
        cmd += ["--peering", self.peering, "--priority", str(priority), "--peering-lifetime", str(LIFETIME_S)]
        env = {**self.cluster.env, "KUBECONFIG": str(self.kubeconfig), "POD_ID": name}
        log = self.workdir / f"{name}.log"
        replica = Replica(
            name, subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT), log, port
        )
        self.started.append(replica)
        poll(lambda: _healthz(port), timeout=60, what=f"{name}'s liveness endpoint")
        return replica

    def stop(self) -> None:
        for replica in self.started:
            if replica.proc.poll() is None:
                replica.proc.terminate()
                replica.proc.wait(timeout=30)


@pytest.fixture
def replicas(kube_cluster: KubeCluster, kube_namespace: str, release: str, tmp_path: Path) -> Iterator[Replicas]:
    """Replicas of the release's peering; every one started is stopped after the test, before the release goes."""
    started = Replicas(kube_cluster, kube_namespace, release, tmp_path)
    yield started
    started.stop()


def test_the_standby_takes_over_within_the_lifetime_and_applies_an_edit_once(
    kube_cluster: KubeCluster, kube_namespace: str, release: str, replicas: Replicas
) -> None:
    cluster, ns, start = kube_cluster, kube_namespace, replicas.start
    peering = get(cluster, ns, "kopfpeering", f"{release}-triptych")
    assert peering is not None, "the chart creates the peering object with replicas > 1"
    active = start("active", priority=200)
    standby = start("standby", priority=100)
    # Both keep alive in the peering object; the active one resumed, the standby (which starts paused) did not.
    poll(
        lambda: len((get(cluster, ns, "kopfpeering", f"{release}-triptych") or {}).get("status") or {}) == 2,
        timeout=30,
        what="both replicas in the peering object",
    )
    assert "Resuming operations" in active.log()
    assert "Resuming operations" not in standby.log()

    apply(cluster, ns, pipeline_manifest("ha"))
    wait_phase(cluster, ns, "ha", "Ready")
    assert "Created: Deployment ha-decoder" in active.log()
    assert "Created:" not in standby.log() and "Updated:" not in standby.log(), standby.log()[-2000:]
    before = {k: v["metadata"] for k, v in children(cluster, ns, "ha").items()}

    active.proc.send_signal(signal.SIGKILL)
    active.proc.wait(timeout=10)
    killed = time.monotonic()
    cluster.kubectl(
        "patch", "dp", "ha", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"decoder": {"replicas": 2}}})
    )

    def decoder_scaled() -> bool:
        dep = get(cluster, ns, "deployment", "ha-decoder")
        return bool(dep and dep["spec"]["replicas"] == 2)

    poll(decoder_scaled, timeout=HANDOVER_S + 30, what="the standby to apply the edit")
    handover = time.monotonic() - killed
    print(f"handover: the edit was applied {handover:.1f} s after the active replica was killed")
    assert handover <= HANDOVER_S, f"handover took {handover:.1f}s:\n" + standby.log()[-3000:]
    assert "Resuming operations after the pause" in standby.log()
    wait_phase(cluster, ns, "ha", "Ready")

    after = {k: v["metadata"] for k, v in children(cluster, ns, "ha").items()}
    assert after["Deployment/ha-decoder"]["generation"] == before["Deployment/ha-decoder"]["generation"] + 1
    for key, meta in before.items():
        if key != "Deployment/ha-decoder":
            assert after[key]["resourceVersion"] == meta["resourceVersion"], f"{key} was rewritten by the standby"
    assert standby.log().count("Updated: Deployment ha-decoder") == 1, standby.log()[-3000:]
    events = cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", "involvedObject.name=ha")["items"]
    updates = [e for e in events if e["reason"] == "Updated" and "Deployment ha-decoder" in e["message"]]
    assert sum(int(e.get("count") or 1) for e in updates) == 1, updates


def test_a_replica_that_loses_the_lead_stops_scaling_to_zero(
    kube_cluster: KubeCluster,
    kube_namespace: str,
    release: str,
    monkeypatch: pytest.MonkeyPatch,
    replicas: Replicas,
) -> None:
    """kopf pauses a replica's watches and handlers when one of a higher priority appears, but not the
    operator's own scale-to-zero loop: that loop reads the peering object itself (leading.py). The first
    replica leads and checks its sleepy role; once a second of a higher priority is up, the first stands
    by, and the second, which resumes and reconciles the pipeline, leads. The rule applied to the live
    peering object (read with the operator's own credentials) says the same."""
    from triptych_operator import kube
    from triptych_operator.leading import leads

    cluster, ns, start, peering = kube_cluster, kube_namespace, replicas.start, replicas.peering
    monkeypatch.setenv("KUBECONFIG", str(replicas.kubeconfig))  # the replicas' credentials: their RBAC reads it

    def peers() -> dict:
        return kube.peering_status(peering, ns) or {}

    leading_line = f"scale to zero in {ns}: this replica leads"
    standing_line = f"scale to zero in {ns}: another replica leads; standing by"
    first = start("first", priority=100)
    sleepy = {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2}}
    apply(cluster, ns, pipeline_manifest("lead", denoiser=sleepy))
    wait_phase(cluster, ns, "lead", "Ready")
    poll(lambda: leading_line in first.log(), timeout=30, what="the first replica's loop to lead")
    assert leads(peers(), "first", 100)

    second = start("second", priority=200)
    poll(lambda: "second" in peers(), timeout=30, what="the second replica in the peering object")
    poll(lambda: standing_line in first.log(), timeout=30, what="the first replica's loop to stand by")
    poll(lambda: leading_line in second.log(), timeout=60, what="the second replica's loop to lead")
    assert not leads(peers(), "first", 100) and leads(peers(), "second", 200)
    assert "Pausing operations" in first.log()  # kopf paused it too: the two agree
    said = first.log()
    assert said.count(standing_line) == 1 and said.index(standing_line) > said.index(leading_line), said[-3000:]
