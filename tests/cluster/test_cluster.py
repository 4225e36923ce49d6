"""End-to-end checks of the local control plane (tests/cluster/up.sh): real apiserver, controllers and
scheduler; kwok fakes the kubelets of the GPU/RDMA nodes. Every wait is bounded and polls."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.fixtures import (
    CLUSTER_SRC,
    COMPONENTS,
    KubeCluster,
    cluster_env,
    cluster_settings,
    free_port_settings,
    poll,
    running_processes,
)

pytestmark = pytest.mark.cluster

GPU_NODES = {"gpu-node-0", "gpu-node-1"}


def deployment(name: str, *, replicas: int = 1, gpus: int = 0, labels: dict[str, str] | None = None) -> str:
    labels = labels or {"app": name}
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    return json.dumps(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "containers": [
                            {
                                "name": "main",
                                "image": "registry.invalid/triptych/noop:0.1",
                                "resources": {"requests": {"cpu": "100m"}, "limits": limits},
                            }
                        ],
                    },
                },
            },
        }
    )


def pods(kube: KubeCluster, ns: str, selector: str) -> list[dict]:
    return kube.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"]


def condition(obj: dict, ctype: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == ctype), {})


# --------------------------------------------------------------------------- the cluster itself


def test_server_version_and_fake_gpu_nodes(kube_cluster: KubeCluster) -> None:
    version = json.loads(kube_cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == kube_cluster.settings["K8S_VERSION"]
    assert version["clientVersion"]["gitVersion"] == kube_cluster.settings["K8S_VERSION"]

    nodes = {n["metadata"]["name"]: n for n in kube_cluster.kubectl_json("get", "nodes")["items"]}
    assert GPU_NODES | {"cpu-node-0"} <= set(nodes)
    rdma = kube_cluster.settings["RDMA_RESOURCE"]
    for name in GPU_NODES:
        node = nodes[name]
        assert condition(node, "Ready").get("status") == "True"
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
        assert node["metadata"]["labels"]["nvidia.com/gpu.count"] == "8"
        assert "node-role.kubernetes.io/gpu" in node["metadata"]["labels"]
        for field in ("capacity", "allocatable"):
            res = node["status"][field]
            assert res["nvidia.com/gpu"] == "8" and res[rdma] == "1"
            assert res["cpu"] == "64" and res["memory"] == "512Gi" and res["pods"] == "110"
        assert node["spec"].get("podCIDR"), "the node IPAM controller assigns pod CIDRs"
    cpu = nodes["cpu-node-0"]["status"]["allocatable"]
    assert "nvidia.com/gpu" not in cpu and cpu["cpu"] == "16" and cpu["memory"] == "64Gi"


def test_aggregation_layer_is_configured(kube_cluster: KubeCluster) -> None:
    cm = kube_cluster.kubectl_json("get", "configmap", "-n", "kube-system", "extension-apiserver-authentication")
    data = cm["data"]
    assert "BEGIN CERTIFICATE" in data["requestheader-client-ca-file"]
    assert json.loads(data["requestheader-allowed-names"]) == ["front-proxy-client"]
    assert json.loads(data["requestheader-extra-headers-prefix"]) == ["X-Remote-Extra-"]
    assert "BEGIN CERTIFICATE" in data["client-ca-file"]


# --------------------------------------------------------------------------- scheduling


def test_gpu_deployment_is_scheduled_on_a_gpu_node(kube_cluster: KubeCluster, kube_namespace: str) -> None:
    ns = kube_namespace
    kube_cluster.apply(deployment("gpu-worker", replicas=2, gpus=2), ns)
    kube_cluster.wait_condition("deployment/gpu-worker", "Available", ns)
    running = poll(
        lambda: [
            p
            for p in pods(kube_cluster, ns, "app=gpu-worker")
            if p["status"].get("phase") == "Running" and p["status"].get("podIP")
        ],
        what="2 running pods with IPs",
    )
    assert len(running) == 2
    for pod in running:
        assert pod["spec"]["nodeName"] in GPU_NODES
        assert condition(pod, "Ready")["status"] == "True"
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    dep = kube_cluster.kubectl_json("get", "deployment", "-n", ns, "gpu-worker")
    assert dep["status"]["availableReplicas"] == 2


def test_pod_asking_for_too_many_gpus_stays_pending(kube_cluster: KubeCluster, kube_namespace: str) -> None:
    ns = kube_namespace
    kube_cluster.apply(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "too-big"},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "registry.invalid/noop:0.1",
                            "resources": {"limits": {"nvidia.com/gpu": "9"}},
                        }
                    ]
                },
            }
        ),
        ns,
    )

    def unschedulable() -> dict:
        pod = kube_cluster.kubectl_json("get", "pod", "-n", ns, "too-big")
        cond = condition(pod, "PodScheduled")
        return pod if cond.get("status") == "False" and cond.get("reason") == "Unschedulable" else {}

    pod = poll(unschedulable, timeout=30, what="PodScheduled=False/Unschedulable")
    assert "nvidia.com/gpu" in condition(pod, "PodScheduled")["message"]
    time.sleep(2)  # and it stays that way
    pod = kube_cluster.kubectl_json("get", "pod", "-n", ns, "too-big")
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")


# --------------------------------------------------------------------------- controllers


def test_service_gets_an_endpointslice_with_the_ready_pods(kube_cluster: KubeCluster, kube_namespace: str) -> None:
    ns = kube_namespace
    kube_cluster.apply(deployment("web", replicas=2), ns)
    kube_cluster.apply(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "web"},
                "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
            }
        ),
        ns,
    )

    def ready_pod_ips() -> set[str]:
        return {
            p["status"]["podIP"]
            for p in pods(kube_cluster, ns, "app=web")
            if condition(p, "Ready").get("status") == "True" and p["status"].get("podIP")
        }

    ips = poll(lambda: got if len(got := ready_pod_ips()) == 2 else set(), what="2 ready pods with IPs")

    def slice_ips() -> set[str]:
        slices = kube_cluster.kubectl_json("get", "endpointslices", "-n", ns, "-l", "kubernetes.io/service-name=web")[
            "items"
        ]
        got = {
            addr
            for s in slices
            for ep in (s.get("endpoints") or [])
            if ep.get("conditions", {}).get("ready")
            for addr in ep["addresses"]
        }
        return got if got == ips else set()

    assert poll(slice_ips, what="EndpointSlice listing the ready pods") == ips
    svc = kube_cluster.kubectl_json("get", "service", "-n", ns, "web")
    assert svc["spec"]["clusterIP"].startswith("198.18.")


def test_garbage_collector_deletes_dependents(kube_cluster: KubeCluster, kube_namespace: str) -> None:
    ns = kube_namespace
    # A ConfigMap owned by another ConfigMap.
    kube_cluster.kubectl("create", "configmap", "owner", "-n", ns, "--from-literal=a=1")
    uid = kube_cluster.kubectl_json("get", "configmap", "-n", ns, "owner")["metadata"]["uid"]
    kube_cluster.apply(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": "dependent",
                    "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}],
                },
                "data": {"b": "2"},
            }
        ),
        ns,
    )
    # A Deployment owns ReplicaSets, which own Pods.
    kube_cluster.apply(deployment("gc-web", replicas=1), ns)
    kube_cluster.wait_condition("deployment/gc-web", "Available", ns)
    assert pods(kube_cluster, ns, "app=gc-web")

    kube_cluster.kubectl("delete", "configmap", "owner", "-n", ns, "--wait=false")
    kube_cluster.kubectl("delete", "deployment", "gc-web", "-n", ns, "--wait=false")

    def gone(*args: str) -> bool:
        return not kube_cluster.kubectl_json("get", *args, "-n", ns)["items"]

    poll(lambda: gone("configmaps", "--field-selector=metadata.name=dependent"), what="dependent ConfigMap GC")
    poll(lambda: gone("replicasets", "-l", "app=gc-web"), what="ReplicaSet GC")
    poll(lambda: gone("pods", "-l", "app=gc-web"), what="Pod GC")


def test_service_account_tokens_work(kube_cluster: KubeCluster, kube_namespace: str) -> None:
    ns = kube_namespace
    # The serviceaccount controller creates `default` in every new namespace.
    poll(
        lambda: kube_cluster.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0,
        timeout=30,
        what="the default ServiceAccount",
    )
    token = kube_cluster.kubectl("create", "token", "default", "-n", ns, "--duration=10m").stdout.strip()
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert claims["sub"] == f"system:serviceaccount:{ns}:default"
    assert claims["iss"] == "https://kubernetes.default.svc.cluster.local"

    review = json.loads(
        kube_cluster.kubectl(
            "create",
            "-o",
            "json",
            "-f",
            "-",
            input=json.dumps(
                {
                    "apiVersion": "authentication.k8s.io/v1",
                    "kind": "TokenReview",
                    "spec": {"token": token},
                }
            ),
        ).stdout
    )
    assert review["status"]["authenticated"] is True
    assert review["status"]["user"]["username"] == f"system:serviceaccount:{ns}:default"

    # The token authenticates against the apiserver; RBAC then denies the unprivileged account.
    who = kube_cluster.kubectl(
        "auth",
        "whoami",
        "-o",
        "json",
        f"--token={token}",
        "--kubeconfig=/dev/null",
        f"--server=https://127.0.0.1:{kube_cluster.settings['APISERVER_PORT']}",
        "--insecure-skip-tls-verify=true",
    )
    assert json.loads(who.stdout)["status"]["userInfo"]["username"] == f"system:serviceaccount:{ns}:default"

    # Pods get the projected service-account token volume (kwok does not mount it: no kubelet).
    kube_cluster.apply(deployment("sa-user"), ns)
    pod = poll(lambda: pods(kube_cluster, ns, "app=sa-user"), what="a pod")[0]
    assert any(v["name"].startswith("kube-api-access-") for v in pod["spec"]["volumes"])


# --------------------------------------------------------------------------- helm


def test_helm_template_and_install(kube_cluster: KubeCluster, kube_namespace: str) -> None:
    ns = kube_namespace
    chart = str(CLUSTER_SRC / "charts" / "trivial")
    rendered = kube_cluster.helm("template", "demo", chart, "--namespace", ns).stdout
    assert "name: demo-config" in rendered and "kind: Deployment" in rendered

    kube_cluster.helm("install", "demo", chart, "--namespace", ns, "--wait", "--timeout", "90s", timeout=120)
    cm = kube_cluster.kubectl_json("get", "configmap", "-n", ns, "demo-config")
    assert cm["data"]["message"] == "hello from triptych"
    assert cm["data"]["kubeVersion"] == kube_cluster.settings["K8S_VERSION"]
    dep = kube_cluster.kubectl_json("get", "deployment", "-n", ns, "demo-worker")
    assert dep["status"].get("availableReplicas") == 1
    releases = json.loads(kube_cluster.helm("list", "--namespace", ns, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("demo", "deployed")]
    kube_cluster.helm("uninstall", "demo", "--namespace", ns, "--wait", "--timeout", "60s", timeout=90)
    assert kube_cluster.kubectl("get", "configmap", "-n", ns, "demo-config", check=False).returncode != 0


# --------------------------------------------------------------------------- up -> down (separate instance)


def _listening_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _our_processes(state_dir: str) -> list[str]:
    ours = [(pid, exe) for pid, exe, cmdline in running_processes() if state_dir + "/" in cmdline]
    return [f"{exe}:{pid}" for pid, exe in ours if exe in COMPONENTS]


@pytest.mark.slow
def test_up_then_down_leaves_nothing_behind(k8s_toolchain: dict[str, str], tmp_path: Path) -> None:
    """A second, throw-away cluster on other ports and another state dir (the session cluster is untouched)."""
    port_settings = free_port_settings()
    ports = [int(p) for p in port_settings.values()]
    flex = Path("/usr/libexec/kubernetes/kubelet-plugins/volume/exec")  # kube-controller-manager's default
    flex_before = flex.exists()
    env = dict(os.environ, TRIPTYCH_CLUSTER_DIR=str(tmp_path / "cluster"), TRIPTYCH_GPU_NODES="1", **port_settings)
    settings = cluster_settings(env)
    kenv = cluster_env(settings, env)
    kubectl = [str(Path(settings["BIN_DIR"]) / "kubectl")]
    try:
        t0 = time.monotonic()
        up = subprocess.run(
            ["bash", str(CLUSTER_SRC / "up.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        took = time.monotonic() - t0
        assert took < 120, f"up.sh took {took:.0f}s to bring the cluster up"
        assert len(_our_processes(settings["CLUSTER_DIR"])) == len(COMPONENTS)
        assert set(ports) <= _listening_ports()
        nodes = subprocess.run(
            [*kubectl, "get", "nodes", "-o", "name"], env=kenv, capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()
        assert sorted(nodes) == ["node/cpu-node-0", "node/gpu-node-0"]

        again = subprocess.run(
            ["bash", str(CLUSTER_SRC / "up.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert again.returncode == 0 and "already running" in again.stdout, again.stdout + again.stderr
    finally:
        down = subprocess.run(
            ["bash", str(CLUSTER_SRC / "down.sh"), "--purge"], env=env, capture_output=True, text=True, timeout=120
        )
    assert down.returncode == 0, down.stdout + down.stderr
    assert _our_processes(settings["CLUSTER_DIR"]) == []
    assert not set(ports) & _listening_ports()
    assert not Path(settings["CLUSTER_DIR"]).exists()
    assert flex_before or not flex.exists(), f"{flex}: made by the controller manager outside the cluster dir"
