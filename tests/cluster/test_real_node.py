"""The product as users deploy it, on a real node (containerd + runc + kubelet + kube-proxy + CoreDNS) beside
the kwok nodes: the images built from images/*.Dockerfile, the README's Kubernetes commands, the chart's
operator as a pod reconciling CPU pipelines of real pods, requests end to end through the head's Service,
scaling and losing a worker; and that the node leaves nothing behind.

Part of `make test` (root: iptables, mounts, cgroups). `make setup` builds the node's binaries and installs
containerd; the module builds the three images (scripts/images.sh, cached by content) and runs its own
throw-away cluster (another state dir and ports), so the shared session cluster is untouched; only one real
node can run on a machine at a time. When a test fails, the logs of every pod, `kubectl describe` and the
node's own logs are saved under outputs/real-node/<test>/.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tests.cluster.fixtures import (
    CLUSTER_SRC,
    KubeCluster,
    cluster_env,
    cluster_settings,
    free_port_settings,
    missing_binaries,
    poll,
    running_processes,
)
from tests.e2e.test_pixels import http_image, http_video, stock_image, stock_video
from tests.operator.tls import make_ca, make_cert
from tests.setup_check import missing
from triptych_dev.rollout import ServiceLoad

REPO = CLUSTER_SRC.parent.parent
IMAGES = {name: f"localhost/triptych-{name}:0.1.0" for name in ("operator", "head", "worker")}
HEAD_IMAGE, WORKER_IMAGE = IMAGES["head"], IMAGES["worker"]
OUTPUTS = REPO / "outputs" / "real-node"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
    # The module's set-up builds the images and imports them into the node: on a new machine that
    # alone can pass the suite's 600 s per test (cold: ~8 min idle, more when loaded). Its own steps
    # are bounded (images 2400 s, cluster 300 s, import 900 s); pytest-timeout bounds each test's body.
    pytest.mark.timeout(600, func_only=True),
]
if os.geteuid() != 0:
    missing("root", "a real node needs root for iptables, mounts and cgroups, as CI has")

# What a real node may leave on the host, and what node-down.sh must remove (see _host_leftovers).
HOST_PATHS = ("/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/run/containerd")
NODE_PROCESSES = ("containerd", "containerd-shim-runc-v2", "kubelet", "kube-proxy", "coredns")


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout


def _host_leftovers(settings: dict[str, str]) -> list[str]:
    """Everything of a real node that can outlive its processes: processes, mounts, iptables chains,
    cgroups, the bridge, the node IP, paths outside the state dir."""
    node_dir = settings["NODE_DIR"]
    found = [
        f"process {exe}:{pid}"
        for pid, exe, cmdline in running_processes()
        if exe in NODE_PROCESSES and (node_dir + "/" in cmdline or exe == "containerd-shim-runc-v2")
    ]
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


def _reclaim_dead_node(settings: dict[str, str], env: dict[str, str]) -> None:
    """Fail if another real node runs on this host; undo what a dead one left (a killed run on a reused
    machine: its node IP, chains, paths), then check that node-down.sh left nothing."""
    before = _host_leftovers(settings)
    live = [item for item in before if item.startswith("process ")]
    owner = Path("/run/triptych-real-node.owner")
    other = owner.read_text().strip() if owner.exists() else ""
    assert not live, f"another real node runs on this host: {live}"
    assert not other or other == settings["CLUSTER_DIR"] or not Path(other).exists(), (
        f"the real node of {other} is still set up on this host: "
        f"TRIPTYCH_CLUSTER_DIR={other} bash tests/cluster/node-down.sh"
    )
    if not before:
        return
    done = subprocess.run(
        ["bash", str(CLUSTER_SRC / "node-down.sh"), "--reclaim"], env=env, capture_output=True, text=True, timeout=180
    )
    after = _host_leftovers(settings)
    assert after == [], f"a dead node's state {before} could not be undone ({done.stderr[-2000:]}): {after} is left"


def _get_json(url: str) -> dict | None:
    """GET url without any proxy; None while nothing answers (kube-proxy syncs a new Service within ~1 s)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def _save_logs(cluster: KubeCluster, out: Path) -> None:
    """Every pod's logs (all namespaces), `kubectl describe pods` and the node's own logs, into out/."""
    out.mkdir(parents=True, exist_ok=True)
    pods = cluster.kubectl("get", "pods", "-A", "-o", "json", check=False)
    for pod in json.loads(pods.stdout or "{}").get("items", []):
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        for previous in ("", "--previous"):
            logs = cluster.kubectl("-n", ns, "logs", name, "--all-containers", "--tail=2000", *filter(None, [previous]),
                                   check=False)  # fmt: skip
            if logs.stdout or not previous:
                (out / f"{ns}.{name}{'.previous' if previous else ''}.log").write_text(logs.stdout + logs.stderr)
    describe = cluster.kubectl("describe", "pods", "-A", check=False)
    (out / "describe-pods.txt").write_text(describe.stdout + describe.stderr)
    for log in Path(cluster.settings["NODE_DIR"], "logs").glob("*.log"):
        (out / f"node-{log.name}").write_text(log.read_text(errors="replace")[-200_000:])


@pytest.fixture(autouse=True)
def _logs_when_a_test_fails(request: pytest.FixtureRequest, real_node: KubeCluster) -> Iterator[None]:
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed and real_node.is_ready():
        out = OUTPUTS / request.node.name
        if out.exists():  # saved by _pipeline before it deleted the pipeline's pods: these are the later ones
            out = out / "after"
        _save_logs(real_node, out)
        print(f"logs of every pod saved in {out}")


def _current_test() -> str:
    """The running test's name (pytest's PYTEST_CURRENT_TEST: 'path::name (phase)')."""
    return os.environ.get("PYTEST_CURRENT_TEST", "unknown").split("::")[-1].split(" ")[0]


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> None:
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"{' '.join(cmd)}: exit {out.returncode}\n{out.stdout}{out.stderr}"
    print(f"{Path(cmd[1]).name} {' '.join(cmd[2:])[:60]}: {time.monotonic() - t0:.1f} s\n{out.stdout.strip()}")


@pytest.fixture(scope="module")
def real_node() -> Iterator[KubeCluster]:
    state = Path(os.environ.get("TRIPTYCH_REAL_NODE_TEST_DIR", "/tmp/triptych-real-node-test"))
    env = dict(
        os.environ,
        TRIPTYCH_CLUSTER_DIR=str(state),
        # Four kwok GPU nodes (8 GPUs and one RDMA device each): examples/wan-t2v.yaml's four RDMA pods fit.
        TRIPTYCH_GPU_NODES="4",
        TRIPTYCH_REAL_NODE="1",
        # The node's image store outlives the cluster: an unchanged image is not imported again (the
        # worker's 6.5 GB take minutes), a changed one only its new layers.
        TRIPTYCH_NODE_CONTAINERD_ROOT=str(Path.home() / ".cache" / "triptych" / "node-containerd"),
        **free_port_settings(),
    )
    settings = cluster_settings(env)
    missing = missing_binaries(settings["BIN_DIR"]) + [
        b for b in ("kubelet", "kube-proxy", "coredns", "pause") if not (Path(settings["NODE_BIN_DIR"]) / b).exists()
    ]
    if missing:
        pytest.fail(f"missing {missing}: run `make setup`", pytrace=False)
    _reclaim_dead_node(settings, env)
    _run(["bash", str(REPO / "scripts" / "images.sh"), *IMAGES], env, timeout=2400)
    subprocess.run(["bash", str(CLUSTER_SRC / "down.sh"), "--purge"], env=env, capture_output=True, timeout=180)
    cluster = KubeCluster(
        kubeconfig=settings["KUBECONFIG_PATH"],
        env=cluster_env(settings, env),
        bin_dir=settings["BIN_DIR"],
        state_dir=settings["CLUSTER_DIR"],
        settings=settings | {"_env": json.dumps(env)},
    )
    try:
        _run(["bash", str(CLUSTER_SRC / "up.sh")], env, timeout=300)
        _run(["bash", str(CLUSTER_SRC / "node-import.sh"), *IMAGES.values()], env, timeout=900)
        yield cluster
    finally:
        subprocess.run(["bash", str(CLUSTER_SRC / "down.sh"), "--purge"], env=env, capture_output=True, timeout=180)


@pytest.fixture(scope="module")
def node_models(tiny_models: dict[str, Path]) -> Iterator[dict[str, Path]]:
    """The tiny packages where the pods' user (uid 10001) reads them through a hostPath: a copy in a
    world-readable dir of its own (the checkout may sit under a dir only root enters, as a CI clone does)."""
    root = Path(tempfile.mkdtemp(prefix="triptych-node-models-"))
    try:
        root.chmod(0o755)
        copies = {name: Path(shutil.copytree(path, root / name)) for name, path in tiny_models.items()}
        subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True, timeout=60)
        yield copies
    finally:
        shutil.rmtree(root, ignore_errors=True)


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
    real_node: KubeCluster, node_models: dict[str, Path]
) -> None:
    ns = "real-node-head"
    real_node.kubectl("create", "namespace", ns)
    try:
        t0 = time.monotonic()
        real_node.apply(_head_manifest(node_models["tiny-flux"].parent).replace("{ns}", ns), ns)
        real_node.wait_condition("pod/head", "Ready", ns, timeout=90)
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
    finally:
        real_node.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_kwok_nodes_keep_their_pods_off_the_real_node(real_node: KubeCluster) -> None:
    node = real_node.kubectl_json("get", "node", real_node.settings["NODE_NAME"])
    assert {"key": "triptych.dev/real-node", "value": "true", "effect": "NoSchedule"} in node["spec"]["taints"]
    assert node["metadata"]["labels"]["triptych.dev/real-node"] == "true"
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == real_node.settings["NODE_IP"]


def test_an_import_after_a_one_layer_change_sends_only_that_layer(real_node: KubeCluster, tmp_path: Path) -> None:
    """The head image plus one new layer (a code change's shape): node-import.sh sends containerd that
    layer, the config and the manifest (its own count), not the image; containerd then has it, unpacked,
    under podman's image ID."""
    env = json.loads(real_node.settings["_env"])
    podman_env = dict(env, CONTAINERS_CONF=str(REPO / "images" / "local" / "containers.conf"))
    probe, tag = f"{time.time_ns()}\n", "localhost/triptych-import-probe:test"
    (tmp_path / "probe.txt").write_text(probe)
    (tmp_path / "Containerfile").write_text(f"FROM {HEAD_IMAGE}\nCOPY probe.txt /probe.txt\n")
    ctr = ["ctr", "--address", f"{real_node.settings['NODE_DIR']}/containerd/containerd.sock", "-n", "k8s.io"]
    build = ["podman", "build", "--pull=never", "--quiet", "-t", tag, "-f", "Containerfile", "."]
    subprocess.run(build, cwd=tmp_path, env=podman_env, check=True, capture_output=True, timeout=300)
    try:
        out = subprocess.run(["bash", str(CLUSTER_SRC / "node-import.sh"), tag], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        print(out.stdout)
        sent = re.search(r"sent (\d+) blobs, (\d+) bytes", out.stdout)
        assert sent, out.stdout
        assert int(sent[1]) == 3, out.stdout  # the new layer, the config, the manifest
        assert int(sent[2]) < 64 * 1024, out.stdout  # the head's own layers stay behind (~380 MB)
        image_id = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", tag], env=podman_env,
                                  capture_output=True, text=True, check=True, timeout=60).stdout.strip()  # fmt: skip
        target = next(line.split()[2] for line in _sh(*ctr, "images", "ls").splitlines() if line.split()[0] == tag)
        assert json.loads(_sh(*ctr, "content", "get", target))["config"]["digest"] == f"sha256:{image_id}"
        mount = tmp_path / "mnt"
        mount.mkdir()
        subprocess.run([*ctr, "images", "mount", tag, str(mount)], check=True, capture_output=True, timeout=120)
        try:
            assert (mount / "probe.txt").read_text() == probe
            assert (mount / "etc" / "passwd").exists()  # the head's layers, from containerd's own store
        finally:
            subprocess.run([*ctr, "images", "unmount", "--rm", str(mount)], capture_output=True, timeout=60)
        again = subprocess.run(["bash", str(CLUSTER_SRC / "node-import.sh"), tag], env=env, capture_output=True,
                               text=True, timeout=120)  # fmt: skip
        assert f"node-import: {tag} up to date" in again.stdout, again.stdout + again.stderr
    finally:
        subprocess.run([*ctr, "images", "rm", "--sync", tag], capture_output=True, timeout=120)
        subprocess.run(["podman", "rmi", tag], env=podman_env, capture_output=True, timeout=120)


ON_REAL_NODE = {
    "nodeSelector": {"triptych.dev/real-node": "true"},
    "tolerations": [{"key": "triptych.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}],
}
RELEASE, SYSTEM = "triptych", "triptych-system"


def _chart_values(cluster: KubeCluster) -> Path:
    """The local images and the operator's placement on the real node: what a cluster that cannot pull the
    chart's default images gives `helm install -f` (the README says so)."""
    values = {
        "image": {"repository": "localhost/triptych-operator", "tag": "0.1.0", "pullPolicy": "Never"},
        "workerImage": WORKER_IMAGE,
        "headImage": HEAD_IMAGE,
        **ON_REAL_NODE,
    }
    path = Path(cluster.state_dir) / "chart-values.json"
    path.write_text(json.dumps(values))
    return path


def _readme_commands(section: str = "On Kubernetes") -> list[str]:
    """The commands of the first bash block of a README section, one per line, as written."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```bash\n(.*?)```", body, re.S)
    assert match, f"no bash block in the README's section {section!r}"
    return [line for line in match.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _models_volume() -> str:
    """The volume examples/wan-t2v.yaml says exists beforehand (a PVC `models` holding the package);
    bound to a hostPath PV. Its pods land on kwok GPU nodes, which mount nothing."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": "readme-models"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "hostPath": {"path": "/nonexistent/readme-models"},
            "claimRef": {"namespace": "default", "name": "models"},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "models", "namespace": "default"},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": "readme-models",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]})


def test_the_readme_on_kubernetes_commands_work_as_written(real_node: KubeCluster) -> None:
    """The README's "On Kubernetes" block, each line run by bash from the repository root with the local
    kubectl and helm; the one substitution is the README's own: `-f VALUES` on `helm install` with the
    local images (no registry here). The operator runs as a real pod on the real node, examples/wan-t2v.yaml's
    GPU pods on kwok GPU nodes, and `kubectl get dp` shows the pipeline Ready with its documented columns."""
    commands = _readme_commands()
    assert [c.split()[:2] for c in commands] == [["helm", "install"], ["kubectl", "apply"], ["kubectl", "get"]]
    values = _chart_values(real_node)
    real_node.apply(_models_volume())

    def sh(line: str) -> str:
        if line.startswith("helm install"):
            line = line.replace("--create-namespace", f"--create-namespace -f {values}", 1)
        out = subprocess.run(["bash", "-c", line], cwd=REPO, env=real_node.env, capture_output=True, text=True,
                             timeout=240)  # fmt: skip
        assert out.returncode == 0, f"{line}: exit {out.returncode}\n{out.stdout}{out.stderr}"
        return out.stdout

    try:
        for line in commands:
            out = sh(line)
        assert out.split("\n")[0].split() == ["NAME", "PHASE", "ENCODER", "DENOISER", "DECODER", "AGE"]
        real_node.wait_condition(f"deployment/{RELEASE}", "Available", SYSTEM, timeout=180)
        operator = real_node.kubectl_json("-n", SYSTEM, "get", "pods", "-l", "app.kubernetes.io/name=triptych")
        assert {p["spec"]["nodeName"] for p in operator["items"]} == {real_node.settings["NODE_NAME"]}

        def wan_ready() -> list[str] | None:
            row = next((r.split() for r in sh(commands[-1]).splitlines() if r.startswith("wan-t2v ")), None)
            return row if row and row[1:5] == ["Ready", "1/1", "2/2", "1/1"] else None

        poll(wan_ready, timeout=180, interval=2, what="`kubectl get dp` showing wan-t2v Ready, 1/1 2/2 1/1")
    finally:
        real_node.kubectl("delete", "-f", str(REPO / "examples" / "wan-t2v.yaml"), "--ignore-not-found",
                          "--timeout=60s", check=False, timeout=90)  # fmt: skip
        real_node.helm("uninstall", RELEASE, "-n", SYSTEM, "--ignore-not-found", "--wait", check=False, timeout=150)
        real_node.kubectl("delete", "-f", "-", "--ignore-not-found", input=_models_volume(), check=False)


def _pipeline_manifest(name: str, package: Path) -> str:
    """examples/tiny-flux-cpu.yaml on the real node: every role on CPU, the model on a hostPath."""
    role = {"replicas": 1, "gpusPerReplica": 0, "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}
    spec = {
        "model": {"path": package.name, "volume": {"hostPath": {"path": str(package.parent)}}},
        **{r: role | ON_REAL_NODE for r in ("encoder", "denoiser", "decoder")},
        "head": ON_REAL_NODE,
        "transfer": {"mode": "tcp", "poolSize": "64MiB"},
    }
    dp = {"apiVersion": "triptych.ai/v1alpha1", "kind": "DiffusionPipeline", "metadata": {"name": name}, "spec": spec}
    return json.dumps(dp)


@dataclasses.dataclass
class Pipeline:
    """A DiffusionPipeline Ready on the real node, and an HTTP client of its head's Service (kube-proxy)."""

    name: str
    namespace: str
    http: httpx.Client

    def head(self) -> dict:
        return self.http.get("/health").json()

    def denoisers(self) -> list[dict]:
        return [d for d in self.head()["workers"]["denoiser"] if d["ready"]]


def _pipeline_ready(cluster: KubeCluster, ns: str, name: str) -> bool:
    conditions = cluster.kubectl_json("-n", ns, "get", "dp", name).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@contextlib.contextmanager
def _pipeline(
    cluster: KubeCluster, ns: str, name: str, package: Path, manifest: str | None = None
) -> Iterator[Pipeline]:
    """`manifest`: the DiffusionPipeline to apply (default: _pipeline_manifest's)."""
    t0 = time.monotonic()
    cluster.apply(manifest or _pipeline_manifest(name, package), ns)
    try:
        poll(
            lambda: _pipeline_ready(cluster, ns, name), timeout=300, interval=2, what=f"DiffusionPipeline {name} Ready"
        )
        print(f"pipeline {name} Ready in {time.monotonic() - t0:.1f} s")
        pods = cluster.kubectl_json("-n", ns, "get", "pods", "-l", f"app.kubernetes.io/instance={name}")["items"]
        assert {p["spec"]["nodeName"] for p in pods} == {cluster.settings["NODE_NAME"]}
        api = cluster.kubectl_json("-n", ns, "get", "service", f"{name}-api")["spec"]
        url = f"http://{api['clusterIP']}:{api['ports'][0]['port']}"
        with httpx.Client(base_url=url, timeout=600, trust_env=False) as http:
            yield Pipeline(name, ns, http)
    except BaseException:
        # Now, while its pods are there: deleting the pipeline takes the head's log with it.
        out = OUTPUTS / _current_test()
        _save_logs(cluster, out)
        print(f"logs of every pod saved in {out} (before the pipeline was deleted)")
        raise
    finally:
        cluster.kubectl("-n", ns, "delete", "dp", name, "--ignore-not-found", "--timeout=90s", check=False, timeout=120)


@pytest.fixture(scope="module")
def heads_ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The CA of HTTPS heads' certificates: (cert, key); the chart's metrics API is given it."""
    return make_ca(tmp_path_factory.mktemp("heads-ca"), "heads-ca")


@pytest.fixture(scope="module")
def chart(real_node: KubeCluster, heads_ca: tuple[Path, Path]) -> Iterator[str]:
    """`helm install` of the chart with the local images (and the heads' CA); the namespace for pipelines."""
    ns = "real-node-e2e"
    t0 = time.monotonic()
    ca = f"metricsApi.headsCABundle={base64.b64encode(heads_ca[0].read_bytes()).decode()}"
    real_node.helm("install", RELEASE, str(REPO / "charts" / "triptych"), "-n", SYSTEM, "--create-namespace",
                   "-f", str(_chart_values(real_node)), "--set", ca, "--wait", "--timeout=180s",
                   timeout=200)  # fmt: skip
    print(f"helm install (operator and metrics API Ready) in {time.monotonic() - t0:.1f} s")
    real_node.kubectl("create", "namespace", ns)
    try:
        yield ns
    finally:
        real_node.kubectl("delete", "dp", "--all", "-n", ns, "--timeout=90s", check=False, timeout=120)
        real_node.helm("uninstall", RELEASE, "-n", SYSTEM, "--ignore-not-found", "--wait", check=False, timeout=150)
        real_node.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def tiny_flux(real_node: KubeCluster, chart: str, node_models: dict[str, Path]) -> Iterator[Pipeline]:
    with _pipeline(real_node, chart, "tiny", node_models["tiny-flux"]) as pipeline:
        yield pipeline


def test_the_operator_runs_under_the_chart_service_account(real_node: KubeCluster, chart: str) -> None:
    operator = real_node.kubectl_json("-n", SYSTEM, "get", "deployment", RELEASE)
    assert operator["spec"]["template"]["spec"]["serviceAccountName"] == RELEASE
    assert operator["status"]["readyReplicas"] == 1


def test_an_image_request_through_the_head_service_equals_stock_diffusers(
    real_node: KubeCluster, tiny_flux: Pipeline, tiny_models: dict[str, Path]
) -> None:
    """Served by pods on a read-only root filesystem: what the head and the workers write lands on their volumes."""
    t0 = time.monotonic()
    got = http_image(tiny_flux.http)
    print(f"request through the head's Service in {time.monotonic() - t0:.1f} s")
    np.testing.assert_array_equal(got, stock_image(tiny_models["tiny-flux"]))
    selector = f"app.kubernetes.io/instance={tiny_flux.name}"
    pods = real_node.kubectl_json("-n", tiny_flux.namespace, "get", "pods", "-l", selector)["items"]
    containers = [c for pod in pods for c in pod["spec"]["containers"]]
    assert len(containers) == 4 and all(c["securityContext"]["readOnlyRootFilesystem"] for c in containers)


def test_a_wan_video_job_completes_with_frames_equal_to_stock_diffusers(
    real_node: KubeCluster, chart: str, node_models: dict[str, Path]
) -> None:
    with _pipeline(real_node, chart, "wan", node_models["tiny-wan"]) as wan:
        t0 = time.monotonic()
        frames = http_video(wan.http)
        print(f"video job through the head's Service in {time.monotonic() - t0:.1f} s")
    np.testing.assert_array_equal(frames, stock_video(node_models["tiny-wan"]))


def test_a_head_with_tls_serves_https_is_probed_over_it_and_its_metrics_are_read_over_it(
    real_node: KubeCluster, chart: str, heads_ca: tuple[Path, Path], node_models: dict[str, Path],
    tiny_models: dict[str, Path], tmp_path: Path,
) -> None:  # fmt: skip
    """spec.head.tls: the head serves HTTPS with the Secret's pair (Ready: its probes are HTTPS), a client
    trusting the CA gets stock pixels through the api Service, plain HTTP gets nothing, and the metrics
    API (given the CA by the chart) reads the head's metrics over HTTPS, verified."""
    name, ns = "secure", chart
    names = f"DNS:{name}-api.{ns}.svc,DNS:{name}-head.{ns}.svc"
    cert, key = make_cert(tmp_path, "head", heads_ca, cn=f"{name}-api", san=names, usage="serverAuth")
    real_node.kubectl("-n", ns, "create", "secret", "tls", f"{name}-head-tls", f"--cert={cert}", f"--key={key}")
    dp = json.loads(_pipeline_manifest(name, node_models["tiny-flux"]))
    dp["spec"]["head"]["tls"] = {"secretName": f"{name}-head-tls"}
    try:
        with _pipeline(real_node, ns, name, node_models["tiny-flux"], json.dumps(dp)) as pipeline:
            api = real_node.kubectl_json("-n", ns, "get", "service", f"{name}-api")["spec"]
            assert api["ports"][0]["name"] == "https" and api["ports"][0]["appProtocol"] == "https"
            url = f"https://{api['clusterIP']}:{api['ports'][0]['port']}"
            trusted = ssl.create_default_context(cafile=str(heads_ca[0]))

            def by_service_name(request: httpx.Request) -> None:  # checked against the name its certificate carries
                request.extensions["sni_hostname"] = f"{name}-api.{ns}.svc"

            hooks = {"request": [by_service_name]}
            with httpx.Client(base_url=url, timeout=600, trust_env=False, verify=trusted, event_hooks=hooks) as https:
                np.testing.assert_array_equal(http_image(https), stock_image(tiny_models["tiny-flux"]))
            with pytest.raises(httpx.HTTPError):
                pipeline.http.get("/health", timeout=10)  # the fixture's plain-HTTP client: nothing answers
            path = f"/apis/custom.metrics.k8s.io/v1beta2/namespaces/{ns}/deployments.apps/{name}-denoiser/" \
                "triptych_pending_work_seconds"  # fmt: skip

            def read_over_https() -> bool:
                proc = real_node.kubectl("get", "--raw", path, check=False)
                return proc.returncode == 0 and len(json.loads(proc.stdout)["items"]) == 1

            poll(read_over_https, timeout=60, interval=2, what="the metrics API reading the HTTPS head's metrics")
    finally:
        real_node.kubectl("-n", ns, "delete", "secret", f"{name}-head-tls", "--ignore-not-found", check=False)


def _role_pods(cluster: KubeCluster, pipeline: Pipeline, role: str) -> list[dict]:
    selector = f"app.kubernetes.io/instance={pipeline.name},app.kubernetes.io/component={role}"
    return cluster.kubectl_json("-n", pipeline.namespace, "get", "pods", "-l", selector)["items"]


def _head_pod(cluster: KubeCluster, pipeline: Pipeline) -> tuple[str, int]:
    pods = _role_pods(cluster, pipeline, "head")
    assert len(pods) == 1
    return pods[0]["metadata"]["uid"], pods[0]["status"]["containerStatuses"][0]["restartCount"]


def test_scaling_the_denoiser_to_two_gives_the_head_two_within_seconds_without_a_restart(
    real_node: KubeCluster, tiny_flux: Pipeline
) -> None:
    head_before = _head_pod(real_node, tiny_flux)
    assert len(tiny_flux.denoisers()) == 1
    real_node.kubectl("-n", tiny_flux.namespace, "patch", "dp", tiny_flux.name, "--type=merge",
                      "-p", '{"spec": {"denoiser": {"replicas": 2}}}')  # fmt: skip
    deployment = f"{tiny_flux.name}-denoiser"
    poll(lambda: real_node.kubectl_json("-n", tiny_flux.namespace, "get", "deployment", deployment)["status"]
         .get("readyReplicas") == 2, timeout=240, interval=0.5, what="two denoiser pods Ready")  # fmt: skip
    pod_ready = time.monotonic()
    poll(lambda: len(tiny_flux.denoisers()) == 2, timeout=60, interval=0.25, what="the head's two ready denoisers")
    seen = time.monotonic() - pod_ready
    print(f"the head had its second denoiser {seen:.1f} s after the pod was Ready")
    # DNS discovery every 5 s, then the worker's first heartbeat.
    assert seen < 15, f"the head had its second denoiser {seen:.1f}s after the pod was Ready"
    assert _head_pod(real_node, tiny_flux) == head_before  # same pod, no restart


# Long enough (several seconds of denoising even on an idle machine) for the kill to land mid-run.
LONG_IMAGE = {"prompt": "a lighthouse at night", "size": "384x384", "seed": 7, "num_inference_steps": 48,
              "guidance_scale": 3.5, "n": 1}  # fmt: skip


def _counter(pipeline: Pipeline, name: str, label: str = "") -> float:
    """The sum of a head counter's samples (those with `label` among their labels)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in pipeline.http.get("/metrics").text.splitlines()
        if line.startswith(f"{name}{{") and label in line
    )


def test_deleting_a_busy_denoiser_pod_loses_no_request(
    real_node: KubeCluster, tiny_flux: Pipeline, tiny_models: dict[str, Path]
) -> None:
    """Two denoisers (the scaling test's); the one holding a long request is deleted with no grace
    (SIGTERM, its container killed 2 s later): it hands the request to the other at its next step
    boundary (drain by migration), or, killed first, the head retries it there. Either way the
    request completes with stock diffusers' pixels."""
    poll(lambda: len(tiny_flux.denoisers()) == 2, timeout=240, what="two ready denoisers")

    def moved_or_retried() -> float:
        retried = _counter(tiny_flux, "triptych_retries_total", 'role="denoiser"')
        return retried + _counter(tiny_flux, "triptych_migrations_total")

    before = moved_or_retried()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(http_image, tiny_flux.http, LONG_IMAGE)
        busy = poll(lambda: [d for d in tiny_flux.denoisers() if d["free_slots"] < d["capacity"]], timeout=120,
                    interval=0.1, what="a denoiser holding the request")  # fmt: skip
        ip = busy[0]["url"].removeprefix("tcp://").rsplit(":", 1)[0]
        pods = _role_pods(real_node, tiny_flux, "denoiser")
        victim = next(p["metadata"]["name"] for p in pods if p["status"].get("podIP") == ip)
        real_node.kubectl("-n", tiny_flux.namespace, "delete", "pod", victim, "--grace-period=0", "--force")
        print(f"deleted {victim} ({ip}) while it held the request")
        got = result.result(timeout=600)
    assert moved_or_retried() > before, "the request finished neither moved nor retried: it never left the pod"
    np.testing.assert_array_equal(got, stock_image(tiny_models["tiny-flux"], LONG_IMAGE))


# The tests below need the chart and the node: they run before the uninstall and the teardown.


def _shared_results(ns: str, folder: Path) -> str:
    """A ReadWriteMany claim every head mounts: a hostPath PV on the one real node (on a cluster: NFS,
    CephFS, EFS...), writable by the heads' user."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{ns}-results"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "hostPath": {"path": str(folder)},
            "claimRef": {"namespace": ns, "name": "results"},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "results", "namespace": ns},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": f"{ns}-results",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]})


QUICK_VIDEO = {"prompt": "waves", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
LONG_VIDEO = {"prompt": "waves", "size": "48x32", "num_frames": 5, "num_inference_steps": 60}


def _jobs_completed(pipeline: Pipeline, ids: list[str], timeout: float) -> dict[str, dict]:
    """Each job as the Service answers for it, once every one has ended (or the last seen at the timeout)."""
    deadline, jobs = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        jobs = {i: pipeline.http.get(f"/v1/videos/{i}").json() for i in ids}
        if all(j.get("status") in ("completed", "failed", "cancelled") for j in jobs.values()):
            break
        time.sleep(1)
    return jobs


def test_two_heads_roll_on_a_cr_edit_under_load_and_a_deleted_head_loses_no_video_job(
    real_node: KubeCluster, chart: str, node_models: dict[str, Path]
) -> None:
    """`head.replicas: 2` over a shared ReadWriteMany claim: a CR edit of a head field rolls the heads
    (a surge head first, the old one leaves the Service during its preStop pause, then drains) under a
    video job every 500 ms through the head Service: none fails and every job completes; then one head
    pod is deleted while video jobs run on both: every job completes."""
    folder = Path(tempfile.mkdtemp(prefix="triptych-results-"))
    folder.chmod(0o777)  # the heads' user (10001) writes there
    real_node.apply(_shared_results(chart, folder), chart)
    manifest = json.loads(_pipeline_manifest("heads", node_models["tiny-wan"]))
    manifest["spec"]["head"] |= {"replicas": 2, "results": {"persistentVolumeClaim": {"claimName": "results"}}}
    try:
        with _pipeline(real_node, chart, "heads", node_models["tiny-wan"], json.dumps(manifest)) as heads:
            pods = _role_pods(real_node, heads, "head")
            assert len(pods) == 2
            pdb = real_node.kubectl_json("-n", chart, "get", "pdb", "heads-head")
            assert pdb["spec"]["maxUnavailable"] == 1

            api = str(heads.http.base_url).rstrip("/")
            with ServiceLoad([api], QUICK_VIDEO, interval=0.5, path="/v1/videos") as load:
                time.sleep(3)
                before = {p["metadata"]["name"] for p in pods}
                real_node.kubectl("-n", chart, "patch", "dp", "heads", "--type=merge",
                                  "-p", '{"spec": {"head": {"timeoutSeconds": 700}}}')  # fmt: skip

                def rolled() -> bool:
                    now = _role_pods(real_node, heads, "head")
                    names = {p["metadata"]["name"] for p in now}
                    ready = all(c.get("ready") for p in now for c in p["status"].get("containerStatuses", []))
                    return len(now) == 2 and not names & before and ready

                poll(rolled, timeout=240, interval=1, what="both heads replaced and ready")
                time.sleep(3)
            failed = load.failed()
            assert not failed, f"{len(failed)} of {len(load.answers)} requests failed during the rollout: {failed[:5]}"
            assert len(load.answers) >= 30, len(load.answers)
            jobs = _jobs_completed(heads, [a.detail for a in load.answers], 300)
            assert all(j["status"] == "completed" for j in jobs.values()), [
                j for j in jobs.values() if j["status"] != "completed"
            ][:3]

            # Video jobs spread over both heads (the Service picks per connection), then one head pod goes.
            ids = [heads.http.post("/v1/videos", json={**LONG_VIDEO, "seed": s}).json()["id"] for s in range(6)]
            poll(lambda: any(heads.http.get(f"/v1/videos/{i}").json()["step"] >= 1 for i in ids), timeout=120,
                 interval=0.5, what="a video job denoising")  # fmt: skip
            victim = _role_pods(real_node, heads, "head")[0]["metadata"]["name"]
            real_node.kubectl("-n", chart, "delete", "pod", victim, "--wait=false")
            jobs = _jobs_completed(heads, ids, 400)
            assert all(j["status"] == "completed" for j in jobs.values()), list(jobs.values())
    finally:
        real_node.kubectl("delete", "-f", "-", "--ignore-not-found", input=_shared_results(chart, folder), check=False)
        shutil.rmtree(folder, ignore_errors=True)


def test_helm_uninstall_removes_every_chart_object(real_node: KubeCluster, chart: str) -> None:
    chart_objects = real_node.helm("get", "manifest", RELEASE, "-n", SYSTEM).stdout
    real_node.kubectl("-n", chart, "delete", "dp", "--all", "--timeout=90s", timeout=120)
    t0 = time.monotonic()
    real_node.helm("uninstall", RELEASE, "-n", SYSTEM, "--wait", "--timeout=120s", timeout=150)
    print(f"helm uninstall in {time.monotonic() - t0:.1f} s")
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "APIService", "Namespace"}
    for obj in filter(None, yaml.safe_load_all(chart_objects)):
        meta = obj["metadata"]
        where = [] if obj["kind"] in cluster_scoped else ["-n", meta.get("namespace", SYSTEM)]
        left = real_node.kubectl("get", obj["kind"], meta["name"], *where, "--ignore-not-found", "-o", "name")
        assert left.stdout == "", f"{obj['kind']}/{meta['name']} survived helm uninstall"
    poll(lambda: not real_node.kubectl("get", "pods", "-n", SYSTEM, "-o", "name").stdout.strip()
         and not real_node.kubectl("get", "pods", "-n", chart, "-o", "name").stdout.strip(),
         timeout=90, what="every pod of the chart and the pipelines gone")  # fmt: skip


def test_node_down_leaves_nothing_behind(real_node: KubeCluster) -> None:
    env = json.loads(real_node.settings["_env"])
    poll(lambda: real_node.settings["NODE_NAME"] in real_node.kubectl("get", "nodes").stdout, what="the real node")
    preexisting = set((Path(real_node.settings["NODE_DIR"]) / "preexisting").read_text().split())
    t0 = time.monotonic()
    down = subprocess.run(
        ["bash", str(CLUSTER_SRC / "down.sh"), "--purge"], env=env, capture_output=True, text=True, timeout=180
    )
    assert down.returncode == 0, down.stdout + down.stderr
    print(f"cluster with a real node down in {time.monotonic() - t0:.1f} s:\n{down.stdout}")
    assert _host_leftovers(real_node.settings) == []
    assert not Path(real_node.state_dir).exists()
    for path in ("/run/netns", "/usr/libexec/kubernetes"):  # the machine as the node found it
        assert path in preexisting or not Path(path).exists(), f"{path} was made by the node and left behind"
