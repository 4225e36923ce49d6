"""A real node (containerd + runc + kubelet + kube-proxy + CoreDNS) beside the kwok nodes, and that it leaves
nothing behind. Opt-in: TRIPTYCH_REAL_NODE=1 (root; `TRIPTYCH_REAL_NODE=1 make setup` builds the node's
binaries and installs containerd, conntrack; `make images` builds the head image).

The module runs its own throw-away cluster (another state dir and ports, TRIPTYCH_REAL_NODE=1), so the
shared session cluster is untouched; only one real node can run on a machine at a time.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster.fixtures import CLUSTER_SRC, KubeCluster, cluster_env, cluster_settings, missing_binaries, poll

REPO = CLUSTER_SRC.parent.parent
HEAD_IMAGE = "localhost/triptych-head:0.1.0"
OUTPUTS = REPO / "outputs" / "real-node"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
    pytest.mark.skipif(
        os.environ.get("TRIPTYCH_REAL_NODE") != "1",
        reason="opt-in: TRIPTYCH_REAL_NODE=1 (a real kubelet node; docs/local-cluster.md, 'A real node')",
    ),
]

# What a real node may leave on the host, and what node-down.sh must remove (see _host_leftovers).
HOST_PATHS = ("/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/run/containerd")
NODE_PROCESSES = ("containerd", "containerd-shim-runc-v2", "kubelet", "kube-proxy", "coredns")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout


def _host_leftovers(settings: dict[str, str]) -> list[str]:
    """Everything of a real node that can outlive its processes: processes, mounts, iptables chains,
    cgroups, the bridge, the node IP, paths outside the state dir."""
    node_dir = settings["NODE_DIR"]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            exe = os.path.basename(os.readlink(proc / "exe"))
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if exe in NODE_PROCESSES and (node_dir + "/" in cmdline or exe == "containerd-shim-runc-v2"):
            found.append(f"process {exe}:{proc.name}")
    found += [
        f"mount {line.split()[1]}" for line in Path("/proc/self/mounts").read_text().splitlines() if node_dir in line
    ]
    for tool in ("iptables-save", "ip6tables-save"):
        found += [f"{tool}: {line}" for line in _sh(tool).splitlines() if line.startswith(":KUBE-")]
    found += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob("*/kubepods*")]
    if _sh("ip", "link", "show", settings["NODE_BRIDGE"]).strip():
        found.append(f"bridge {settings['NODE_BRIDGE']}")
    if f"inet {settings['NODE_IP']}/" in _sh("ip", "-o", "addr", "show"):
        found.append(f"address {settings['NODE_IP']}")
    found += [f"path {p}" for p in HOST_PATHS if Path(p).exists()]
    found += [f"netns {p.name}" for p in Path("/run/netns").glob("cni-*")]
    return found


def _get_json(url: str) -> dict | None:
    """GET url without any proxy; None while nothing answers (kube-proxy syncs a new Service within ~1 s)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def _save_logs(cluster: KubeCluster, namespace: str, test: str) -> Path:
    out = OUTPUTS / test
    out.mkdir(parents=True, exist_ok=True)
    pods = cluster.kubectl("-n", namespace, "get", "pods", "-o", "name", check=False).stdout.split()
    for pod in pods:
        logs = cluster.kubectl("-n", namespace, "logs", pod, "--all-containers", "--tail=500", check=False)
        (out / f"{pod.split('/')[-1]}.log").write_text(logs.stdout + logs.stderr)
    describe = cluster.kubectl("-n", namespace, "describe", "pods", check=False)
    (out / "describe.txt").write_text(describe.stdout + describe.stderr)
    for log in Path(cluster.settings["NODE_DIR"], "logs").glob("*.log"):
        (out / f"node-{log.name}").write_text(log.read_text(errors="replace")[-200_000:])
    return out


@pytest.fixture(scope="module")
def real_node() -> Iterator[KubeCluster]:
    names = [
        "TRIPTYCH_ETCD_PORT",
        "TRIPTYCH_ETCD_PEER_PORT",
        "TRIPTYCH_APISERVER_PORT",
        "TRIPTYCH_KCM_PORT",
        "TRIPTYCH_SCHEDULER_PORT",
        "TRIPTYCH_KWOK_PORT",
    ]
    state = Path(os.environ.get("TRIPTYCH_REAL_NODE_TEST_DIR", "/tmp/triptych-real-node-test"))
    env = dict(
        os.environ,
        TRIPTYCH_CLUSTER_DIR=str(state),
        TRIPTYCH_GPU_NODES="1",
        TRIPTYCH_REAL_NODE="1",
        **{k: str(p) for k, p in zip(names, _free_ports(len(names)), strict=True)},
    )
    settings = cluster_settings(env)
    missing = missing_binaries(settings["BIN_DIR"]) + [
        b for b in ("kubelet", "kube-proxy", "coredns", "pause") if not (Path(settings["NODE_BIN_DIR"]) / b).exists()
    ]
    if missing:
        pytest.fail(f"missing {missing}: run `TRIPTYCH_REAL_NODE=1 make setup`", pytrace=False)
    before = _host_leftovers(settings)
    assert before == [], f"the host already has a real node's state (another cluster's node?): {before}"
    subprocess.run(["bash", str(CLUSTER_SRC / "down.sh"), "--purge"], env=env, capture_output=True, timeout=180)
    cluster = KubeCluster(
        kubeconfig=settings["KUBECONFIG_PATH"],
        env=cluster_env(settings, env),
        bin_dir=settings["BIN_DIR"],
        state_dir=settings["CLUSTER_DIR"],
        settings=settings | {"_env": json.dumps(env)},
    )
    try:
        t0 = time.monotonic()
        up = subprocess.run(
            ["bash", str(CLUSTER_SRC / "up.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        print(f"cluster with a real node up in {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        imported = subprocess.run(
            ["bash", str(CLUSTER_SRC / "node-import.sh"), HEAD_IMAGE],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert imported.returncode == 0, f"{HEAD_IMAGE} (make images): {imported.stdout}{imported.stderr}"
        print(f"{HEAD_IMAGE} imported in {time.monotonic() - t0:.1f} s")
        yield cluster
    finally:
        subprocess.run(["bash", str(CLUSTER_SRC / "down.sh"), "--purge"], env=env, capture_output=True, timeout=180)


def _head_manifest(model_dir: Path) -> str:
    """The head image as the chart runs it (non-root, read-only model volume), pinned to the real node,
    behind a ClusterIP Service; its worker URLs are dns:// names of that Service (resolved by CoreDNS)."""
    host = "head.{ns}.svc.cluster.local"
    urls = [
        f"--{role}-urls=dns://{host}:{port}"
        for role, port in (("encoder", 9002), ("denoiser", 9000), ("decoder", 9001))
    ]
    container = {
        "name": "head",
        "image": HEAD_IMAGE,
        "imagePullPolicy": "Never",
        "args": [
            "serve",
            "--model-path",
            "/models/tiny-flux",
            "--disagg-role",
            "server",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--disagg-insecure",
            *urls,
        ],
        "securityContext": {"runAsUser": 10001, "runAsNonRoot": True, "allowPrivilegeEscalation": False},
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "head", "labels": {"app": "head"}},
        "spec": {
            "nodeSelector": {"triptych.dev/real-node": "true"},
            "tolerations": [{"key": "triptych.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [container],
            "volumes": [{"name": "models", "hostPath": {"path": str(model_dir), "type": "Directory"}}],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "head"},
        "spec": {"selector": {"app": "head"}, "ports": [{"port": 80, "targetPort": 8000}]},
    }
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [pod, service]})


def test_the_head_image_runs_on_the_real_node_behind_kube_proxy_and_coredns(
    real_node: KubeCluster, tiny_models: dict[str, Path]
) -> None:
    ns = "real-node-head"
    real_node.kubectl("create", "namespace", ns)
    try:
        t0 = time.monotonic()
        real_node.apply(_head_manifest(tiny_models["tiny-flux"].parent).replace("{ns}", ns), ns)
        real_node.kubectl("-n", ns, "wait", "--for=condition=Ready", "pod/head", "--timeout=90s", timeout=100)
        print(f"head pod Ready in {time.monotonic() - t0:.1f} s")
        pod = real_node.kubectl_json("-n", ns, "get", "pod", "head")
        assert pod["spec"]["nodeName"] == real_node.settings["NODE_NAME"]
        assert real_node.kubectl("-n", ns, "exec", "head", "--", "id", "-u").stdout.strip() == "10001"

        # From the host: the Service's ClusterIP through kube-proxy's iptables rules.
        cluster_ip = real_node.kubectl_json("-n", ns, "get", "service", "head")["spec"]["clusterIP"]
        health = poll(lambda: _get_json(f"http://{cluster_ip}/health"), timeout=30, what="/health via the ClusterIP")
        assert health["status"] == "ok" and health["model"] == "tiny-flux"
        # The head resolved its dns:// worker URLs through CoreDNS to the Service's ClusterIP.
        assert {w["url"] for w in health["workers"]["denoiser"]} == {f"tcp://{cluster_ip}:9000"}

        # From inside a pod: the Service by name (CoreDNS via the kube-dns Service) and its ClusterIP
        # (kube-proxy, hairpin back to the same pod), and the apiserver through the `kubernetes` Service.
        probe = (
            "import json, socket, ssl, urllib.request as u;"
            f"ip = socket.gethostbyname('head.{ns}.svc.cluster.local');"
            f"h = json.load(u.urlopen('http://head.{ns}.svc.cluster.local/health', timeout=10));"
            "ctx = ssl.create_default_context(cafile='/var/run/secrets/kubernetes.io/serviceaccount/ca.crt');"
            "v = json.load(u.urlopen('https://kubernetes.default.svc/version', context=ctx, timeout=10));"
            "print(json.dumps([ip, h['status'], v['gitVersion']]))"
        )
        out = real_node.kubectl("-n", ns, "exec", "head", "--", "python", "-c", probe).stdout
        assert json.loads(out) == [cluster_ip, "ok", "v1.34.4"]

        # Names outside cluster.local are not forwarded anywhere.
        refused = real_node.kubectl(
            "-n",
            ns,
            "exec",
            "head",
            "--",
            "python",
            "-c",
            "import socket; socket.gethostbyname('example.com')",
            check=False,
        )
        assert refused.returncode != 0 and "gaierror" in refused.stderr
    except BaseException:
        print(f"logs saved in {_save_logs(real_node, ns, 'head')}")
        raise
    finally:
        real_node.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_kwok_nodes_keep_their_pods_off_the_real_node(real_node: KubeCluster) -> None:
    node = real_node.kubectl_json("get", "node", real_node.settings["NODE_NAME"])
    assert {"key": "triptych.dev/real-node", "value": "true", "effect": "NoSchedule"} in node["spec"]["taints"]
    assert node["metadata"]["labels"]["triptych.dev/real-node"] == "true"
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == real_node.settings["NODE_IP"]


E2E_IMAGES = ("localhost/triptych-operator:0.1.0", HEAD_IMAGE, "localhost/triptych-worker:0.1.0")
ON_REAL_NODE = {
    "nodeSelector": {"triptych.dev/real-node": "true"},
    "tolerations": [{"key": "triptych.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}],
}


def _pipeline_manifest(models: Path) -> str:
    """examples/tiny-flux-cpu.yaml on the real node: every role on CPU, the model on a hostPath."""
    role = {"replicas": 1, "gpusPerReplica": 0, "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}
    spec = {
        "model": {"path": "tiny-flux", "volume": {"hostPath": {"path": str(models)}}},
        **{r: role | ON_REAL_NODE for r in ("encoder", "denoiser", "decoder")},
        "head": ON_REAL_NODE,
        "transfer": {"mode": "tcp", "poolSize": "64MiB"},
    }
    dp = {"apiVersion": "triptych.ai/v1alpha1", "kind": "DiffusionPipeline", "metadata": {"name": "tiny"}, "spec": spec}
    return json.dumps(dp)


def _post_json(url: str, body: dict, timeout: float) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with opener.open(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def test_helm_install_serves_tiny_flux_with_pixels_equal_to_stock_diffusers(
    real_node: KubeCluster, tiny_models: dict[str, Path]
) -> None:
    """The chart with the local images: the operator as a pod under the chart's ServiceAccount, a CPU
    pipeline Ready with real pods, a request through the head's Service, `helm uninstall` removes it all."""
    absent = [i for i in E2E_IMAGES if subprocess.run(["podman", "image", "exists", i], timeout=30).returncode]
    if absent:
        pytest.skip(f"{absent} not built: TRIPTYCH_BUILD_WORKER_IMAGE=1 make images")
    env = json.loads(real_node.settings["_env"])
    t0 = time.monotonic()
    imported = subprocess.run(
        ["bash", str(CLUSTER_SRC / "node-import.sh"), *E2E_IMAGES], env=env, capture_output=True, text=True, timeout=900
    )
    assert imported.returncode == 0, imported.stdout + imported.stderr
    print(f"images imported in {time.monotonic() - t0:.1f} s")
    values = {
        "image": {"repository": "localhost/triptych-operator", "tag": "0.1.0", "pullPolicy": "Never"},
        "workerImage": E2E_IMAGES[2],
        "headImage": HEAD_IMAGE,
        **ON_REAL_NODE,
    }
    values_file = Path(real_node.state_dir) / "e2e-values.json"
    values_file.write_text(json.dumps(values))
    ns, release, system = "real-node-e2e", "triptych", "triptych-system"
    chart = str(REPO / "charts" / "triptych")
    try:
        t0 = time.monotonic()
        real_node.helm("install", release, chart, "-n", system, "--create-namespace", "-f", str(values_file),
                       "--wait", "--timeout=180s", timeout=200)  # fmt: skip
        print(f"helm install (operator and metrics API Ready) in {time.monotonic() - t0:.1f} s")
        chart_objects = real_node.helm("get", "manifest", release, "-n", system).stdout
        operator = real_node.kubectl_json("-n", system, "get", "deployment", release)
        assert operator["spec"]["template"]["spec"]["serviceAccountName"] == release
        assert operator["status"]["readyReplicas"] == 1

        real_node.kubectl("create", "namespace", ns)
        t0 = time.monotonic()
        real_node.apply(_pipeline_manifest(tiny_models["tiny-flux"].parent), ns)

        def ready() -> bool:
            conditions = real_node.kubectl_json("-n", ns, "get", "dp", "tiny").get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        poll(ready, timeout=300, interval=2, what="the DiffusionPipeline Ready")
        print(f"pipeline Ready in {time.monotonic() - t0:.1f} s")
        pods = real_node.kubectl_json("-n", ns, "get", "pods")["items"]
        assert {p["spec"]["nodeName"] for p in pods} == {real_node.settings["NODE_NAME"]}
        assert all(s["ready"] for p in pods for s in p["status"]["containerStatuses"])

        from tests.e2e.test_pixels import IMAGE, stock_image

        api = real_node.kubectl_json("-n", ns, "get", "service", "tiny-api")["spec"]
        t0 = time.monotonic()
        body = _post_json(f"http://{api['clusterIP']}:{api['ports'][0]['port']}/v1/images/generations", IMAGE, 300)
        print(f"request through the head's Service in {time.monotonic() - t0:.1f} s")
        import base64
        import io

        import numpy as np
        from PIL import Image

        got = np.stack([np.array(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in body["data"]])
        np.testing.assert_array_equal(got, stock_image(tiny_models["tiny-flux"]))

        real_node.kubectl("-n", ns, "delete", "dp", "tiny", "--timeout=60s", timeout=90)
        t0 = time.monotonic()
        real_node.helm("uninstall", release, "-n", system, "--wait", "--timeout=120s", timeout=150)
        print(f"helm uninstall in {time.monotonic() - t0:.1f} s")
        cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "APIService", "Namespace"}
        for obj in filter(None, yaml.safe_load_all(chart_objects)):
            meta = obj["metadata"]
            where = [] if obj["kind"] in cluster_scoped else ["-n", meta.get("namespace", system)]
            left = real_node.kubectl("get", obj["kind"], meta["name"], *where, "--ignore-not-found", "-o", "name")
            assert left.stdout == "", f"{obj['kind']}/{meta['name']} survived helm uninstall"
        poll(lambda: not real_node.kubectl("get", "pods", "-n", system, "-o", "name").stdout.strip()
             and not real_node.kubectl("get", "pods", "-n", ns, "-o", "name").stdout.strip(),
             timeout=90, what="every pod of the chart and the pipeline gone")  # fmt: skip
    except BaseException:
        print(f"logs saved in {_save_logs(real_node, ns, 'e2e')} and {_save_logs(real_node, system, 'e2e-system')}")
        raise
    finally:
        real_node.helm("uninstall", release, "-n", system, "--ignore-not-found", check=False, timeout=150)
        real_node.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


def test_node_down_leaves_nothing_behind(real_node: KubeCluster) -> None:
    env = json.loads(real_node.settings["_env"])
    poll(lambda: real_node.settings["NODE_NAME"] in real_node.kubectl("get", "nodes").stdout, what="the real node")
    t0 = time.monotonic()
    down = subprocess.run(
        ["bash", str(CLUSTER_SRC / "down.sh"), "--purge"], env=env, capture_output=True, text=True, timeout=180
    )
    assert down.returncode == 0, down.stdout + down.stderr
    print(f"cluster with a real node down in {time.monotonic() - t0:.1f} s:\n{down.stdout}")
    assert _host_leftovers(real_node.settings) == []
    assert not Path(real_node.state_dir).exists()
