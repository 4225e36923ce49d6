"""Operator benchmark: N DiffusionPipelines created at once on the local cluster, then one field edited on all.

Runs against the local control plane of `make cluster-up` (real kube-apiserver, scheduler and
controller manager; kwok fakes the kubelets), which it shares and never restarts. It adds a few
tainted kwok nodes for the pipelines' pods (4 per pipeline: every role on CPU, one replica, plus
the head) and removes them at the end. The operator runs as its own process (`triptych-operator
-n NS`) under the chart's ServiceAccount, so its API requests are counted per category by
FlowSchemas that match only that account (tests/operator/api_requests.py), and its CPU seconds
and peak RSS come from /proc.

Phases: create N pipelines (all requests sent at once from a thread pool) and wait until every
one is Ready; edit one field on all N (head.timeoutSeconds, which rolls each head Deployment)
and wait until every head runs the new argument and every pipeline is Ready at its new
generation; then --steady seconds with nothing changing.

    python bench/operator_bench.py [--pipelines 200] [--steady 60] [--no-edit] [--json PATH]

Prints a table and writes bench/results/operator.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kubernetes import client, config  # noqa: E402

from tests.cluster.fixtures import KubeCluster, _cluster_for, cluster_settings  # noqa: E402
from tests.operator.api_requests import RequestCounter, delta  # noqa: E402
from tests.operator.test_operator_cluster import (  # noqa: E402
    _healthz,
    free_port,
    operator_command,
    service_account_kubeconfig,
)
from triptych_operator.constants import API_TIME_FORMAT, MANAGER  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CHART = ROOT / "charts" / "triptych"
CRD = ROOT / "crds" / "diffusionpipelines.yaml"
RESULTS = ROOT / "bench" / "results"
TAINT_KEY = "triptych.ai/bench"
PODS_PER_NODE = 200  # kwok takes pod IPs from the node's /24
NODE_IP_BASE = 200  # bench nodes' InternalIPs: 192.0.2.200-239 (TEST-NET-1, below the cluster's own nodes' .240-.250)
MAX_NODES = 40


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def bench_node(name: str, ip: str) -> dict[str, Any]:
    resources = {"cpu": "1000", "memory": "4Ti", "pods": str(PODS_PER_NODE), "ephemeral-storage": "1Ti"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "type": "kwok", TAINT_KEY: "true"},
        },
        "spec": {"taints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}]},
        "status": {
            "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
            "capacity": resources,
            "allocatable": resources,
        },
    }


def pipeline(name: str) -> dict[str, Any]:
    placement = {
        "nodeSelector": {TAINT_KEY: "true"},
        "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
    }
    role = {"replicas": 1, "gpusPerReplica": 0, **placement}
    return {
        "apiVersion": "triptych.ai/v1alpha1",
        "kind": "DiffusionPipeline",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": "tiny-flux", "volume": {"hostPath": {"path": "/var/lib/triptych/models"}}},
            "encoder": role,
            "denoiser": role,
            "decoder": role,
            "head": placement,
        },
    }


def wait(what: str, done: Callable[[], tuple[bool, str]], timeout: float) -> float:
    """Seconds until done() says so (polled every second); fails after `timeout`."""
    start = time.monotonic()
    last = ""
    while time.monotonic() - start < timeout:
        ok, last = done()
        if ok:
            return time.monotonic() - start
        time.sleep(1.0)
    raise TimeoutError(f"{what}: not done after {timeout:.0f} s ({last})")


def _epoch(stamp: str | None) -> float | None:
    """An API timestamp (RFC 3339, UTC, second resolution) as seconds since the epoch."""
    if not stamp:
        return None
    return datetime.datetime.strptime(stamp, API_TIME_FORMAT).replace(tzinfo=datetime.UTC).timestamp()


def _condition_time(obj: dict[str, Any], type_: str) -> float | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_ and cond.get("status") == "True":
            return _epoch(cond.get("lastTransitionTime"))
    return None


def _applied_time(obj: dict[str, Any]) -> float | None:
    """When the operator last applied `obj` (its server-side apply entry in managedFields)."""
    for entry in obj["metadata"].get("managedFields") or []:
        if entry.get("manager") == MANAGER and entry.get("operation") == "Apply":
            return _epoch(entry.get("time"))
    return None


# Where the time of a phase goes, stage by stage along a pipeline's path, from the timestamps the
# API server and the controllers leave on the objects (read once, after the phase): who acts, on
# what, and the moment it did. Objects that existed before the phase do not count.
STAGES: tuple[tuple[str, str, str, Callable[[dict[str, Any]], float | None]], ...] = (
    ("operator", "applies the Deployments", "deploy", lambda o: _applied_time(o)),
    ("controller manager", "creates the ReplicaSets", "rs", lambda o: _epoch(o["metadata"].get("creationTimestamp"))),
    ("controller manager", "creates the pods", "pods", lambda o: _epoch(o["metadata"].get("creationTimestamp"))),
    ("scheduler", "binds the pods", "pods", lambda o: _condition_time(o, "PodScheduled")),
    ("kwok", "makes the pods Ready", "pods", lambda o: _condition_time(o, "Ready")),
    ("controller manager", "marks the Deployments Available", "deploy", lambda o: _condition_time(o, "Available")),
    ("operator", "marks the pipelines Ready", "dp", lambda o: _condition_time(o, "Ready")),
)


def stage_times(objects: dict[str, list[dict[str, Any]]], start: float) -> list[dict[str, Any]]:
    """Per stage: seconds after `start` when half and when all of its objects (made since) got there."""
    out = []
    for who, what, kind, moment in STAGES:
        times = sorted(t - start for t in (moment(o) for o in objects[kind]) if t is not None and t >= start - 1)
        if times:
            half, last = round(times[len(times) // 2]), round(times[-1])
            out.append({"who": who, "what": what, "count": len(times), "median_s": half, "last_s": last})
    return out


def in_parallel(fn: Callable[[int], Any], n: int, workers: int = 16) -> None:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(fn, range(n)))


class Bench:
    def __init__(self, cluster: KubeCluster, pipelines: int, tmp: Path) -> None:
        self.cluster, self.n, self.tmp = cluster, pipelines, tmp
        self.ns = f"bench-operator-{uuid.uuid4().hex[:6]}"
        self.release = f"r{self.ns[-6:]}"
        count = -(-pipelines * 4 // PODS_PER_NODE) + 1
        if count > MAX_NODES:
            raise SystemExit(
                f"--pipelines {pipelines}: needs {count} nodes, more than the {MAX_NODES} addresses kept for them"
            )
        self.nodes = [f"bench-node-{self.ns[-6:]}-{i}" for i in range(count)]
        self.counter = RequestCounter(cluster, self.ns, f"{self.release}-triptych")
        api_client = config.new_client_from_config(config_file=cluster.kubeconfig)
        self.api, self.apps = client.CustomObjectsApi(api_client), client.AppsV1Api(api_client)
        self.proc: subprocess.Popen[bytes] | None = None

    def setup(self) -> None:
        kubectl = self.cluster.kubectl
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
        kubectl("create", "namespace", self.ns)
        kubectl("label", "namespace", self.ns, "triptych.test/ephemeral=true")
        for i, node in enumerate(self.nodes):
            kubectl("create", "-f", "-", input=json.dumps(bench_node(node, f"192.0.2.{NODE_IP_BASE + i}")))
        kubectl("wait", "--for=condition=Ready", *(f"node/{n}" for n in self.nodes), "--timeout=60s", timeout=70)
        flags = ["--set", f"watchNamespaces={{{self.ns}}}", "--set", "metricsApi.enabled=false"]
        self.cluster.helm("install", self.release, str(CHART), "--namespace", self.ns, *flags, timeout=120)
        self.counter.install()
        kubeconfig = service_account_kubeconfig(self.cluster, self.ns, f"{self.release}-triptych", self.tmp / "kc")
        port = free_port()
        env = {**self.cluster.env, "KUBECONFIG": str(kubeconfig)}
        self.proc = subprocess.Popen(
            operator_command(self.ns, port),
            env=env,
            stdout=(self.tmp / "operator.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        wait("the operator's liveness endpoint", lambda: (_healthz(port), ""), 60)

    def teardown(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.counter.remove()
        kubectl = self.cluster.kubectl
        self.cluster.helm("uninstall", self.release, "--namespace", self.ns, check=False, timeout=120)
        kubectl("delete", "namespace", self.ns, "--wait=false", check=False)

        def pods_gone() -> tuple[bool, str]:
            out = kubectl("get", "pods", "-n", self.ns, "--no-headers", check=False).stdout
            return not out.strip(), f"{len(out.splitlines())} pods left"

        try:
            wait("the bench pods to go", pods_gone, 300)
        finally:
            kubectl("delete", "node", *self.nodes, "--ignore-not-found", check=False)

    def sample(self) -> dict[str, Any]:
        assert self.proc is not None
        return {"cpu_s": cpu_seconds(self.proc.pid), "requests": self.counter.snapshot()}

    def objects(self) -> dict[str, list[dict[str, Any]]]:
        args = ("get", "deploy,rs,pods,dp", "-n", self.ns, "-o", "json", "--show-managed-fields")
        out = self.cluster.kubectl(*args, timeout=120).stdout
        by_kind: dict[str, list[dict[str, Any]]] = {"deploy": [], "rs": [], "pods": [], "dp": []}
        kinds = {"Deployment": "deploy", "ReplicaSet": "rs", "Pod": "pods", "DiffusionPipeline": "dp"}
        for item in json.loads(out)["items"]:
            by_kind[kinds[item["kind"]]].append(item)
        return by_kind

    def phase(self, before: dict[str, Any], seconds: float, started_at: float) -> dict[str, Any]:
        after = self.sample()
        requests = delta(after["requests"], before["requests"])
        assert self.proc is not None
        return {
            "seconds": round(seconds, 1),
            "stages": stage_times(self.objects(), started_at),
            "operator_cpu_s": round(after["cpu_s"] - before["cpu_s"], 1),
            "operator_peak_rss_mib": round(peak_rss_mib(self.proc.pid), 1),
            "requests": requests,
            "requests_per_pipeline": {k: round(v / self.n, 2) for k, v in requests.items()},
            # Runnable processes on the machine (5-minute average) as the phase ended: what else wanted the cores.
            "machine_load_5m": round(os.getloadavg()[1], 1),
        }

    def pipelines(self) -> list[dict[str, Any]]:
        # Polled every second: through the client already loaded, not a kubectl process each time.
        rsp: Any = self.api.list_namespaced_custom_object(
            "triptych.ai", "v1alpha1", self.ns, "diffusionpipelines", _preload_content=False
        )
        return list(json.loads(rsp.data)["items"])

    def all_ready(self, generation: int) -> tuple[bool, str]:
        items = self.pipelines()
        ready = sum(
            1
            for p in items
            if (p.get("status") or {}).get("phase") == "Ready"
            and p["status"].get("observedGeneration") == p["metadata"]["generation"] == generation
        )
        return ready == self.n, f"{ready}/{self.n} Ready"

    def heads_rolled(self, timeout_s: int) -> tuple[bool, str]:
        rsp: Any = self.apps.list_namespaced_deployment(
            self.ns, label_selector="app.kubernetes.io/component=head", _preload_content=False
        )
        done = 0
        for d in json.loads(rsp.data)["items"]:
            args = d["spec"]["template"]["spec"]["containers"][0]["args"]
            status = d.get("status") or {}
            new = "--disagg-timeout" in args and float(args[args.index("--disagg-timeout") + 1]) == timeout_s
            if (
                new
                and status.get("observedGeneration") == d["metadata"]["generation"]
                and status.get("updatedReplicas") == status.get("readyReplicas") == 1
            ):
                done += 1
        return done == self.n, f"{done}/{self.n} heads rolled"

    def run(self, steady_s: float, edit: bool) -> dict[str, Any]:
        names = [f"p{i:03d}" for i in range(self.n)]
        before = self.sample()
        start, started_at = time.monotonic(), time.time()
        in_parallel(
            lambda i: self.api.create_namespaced_custom_object(
                "triptych.ai", "v1alpha1", self.ns, "diffusionpipelines", pipeline(names[i])
            ),
            self.n,
        )
        wait(f"{self.n} pipelines Ready", lambda: self.all_ready(1), 900)
        create_s = time.monotonic() - start
        self.counter.wait_quiet(quiet_s=5)
        create = self.phase(before, create_s, started_at)
        print(f"create: {create}", flush=True)
        result = {"pipelines": self.n, "create": create}
        if edit:
            result["edit_one_field"] = self.edit_all(names)
        before = self.sample()
        time.sleep(steady_s)
        result["steady"] = self.phase(before, steady_s, time.time() - steady_s)
        print(f"steady: {result['steady']}", flush=True)
        return result

    def edit_all(self, names: list[str]) -> dict[str, Any]:
        new_timeout = 601
        before = self.sample()
        start, started_at = time.monotonic(), time.time()
        patch = {"spec": {"head": {"timeoutSeconds": new_timeout}}}
        in_parallel(
            lambda i: self.api.patch_namespaced_custom_object(
                "triptych.ai", "v1alpha1", self.ns, "diffusionpipelines", names[i], patch
            ),
            self.n,
        )
        wait("every head rolled", lambda: self.heads_rolled(new_timeout), 900)
        wait(f"{self.n} pipelines Ready again", lambda: self.all_ready(2), 900)
        edit_s = time.monotonic() - start
        self.counter.wait_quiet(quiet_s=5)
        edit = self.phase(before, edit_s, started_at)
        print(f"edit: {edit}", flush=True)
        return edit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=int, default=200)
    parser.add_argument("--steady", type=float, default=60.0, help="seconds of steady state measured at the end")
    parser.add_argument("--no-edit", action="store_true", help="skip editing the pipelines (to iterate on create)")
    parser.add_argument("--json", type=Path, default=RESULTS / "operator.json", help="where to write the results")
    args = parser.parse_args()
    cluster = _cluster_for(cluster_settings())
    if not cluster.is_ready():
        print("the local cluster is not running: make cluster-up", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(cluster, args.pipelines, Path(tmp))
        try:
            bench.setup()
            result = bench.run(args.steady, edit=not args.no_edit)
        finally:
            bench.teardown()
            args.json.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(tmp) / "operator.log", args.json.parent / "operator.log")
    result["date"] = time.strftime("%Y-%m-%d")
    out = args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{args.pipelines} pipelines, {os.cpu_count()} CPUs (shared)")
    print(
        "| phase | seconds | operator CPU s | peak RSS MiB | writes/pipeline | status/pipeline | events/pipeline "
        "| reads/pipeline | machine load (5 min) |"
    )
    phases = [key for key in ("create", "edit_one_field", "steady") if key in result]
    for key in phases:
        r = result[key]
        per = r["requests_per_pipeline"]
        print(
            f"| {key} | {r['seconds']} | {r['operator_cpu_s']} | {r['operator_peak_rss_mib']} | {per['writes']} "
            f"| {per['status']} | {per['events']} | {per['reads']} | {r['machine_load_5m']} |"
        )
    for key in phases[:-1]:
        print(f"\n{key}: where the time went (seconds after the first request)")
        print("| who | does what | objects | half done | all done |")
        for stage in result[key]["stages"]:
            print(f"| {stage['who']} | {stage['what']} | {stage['count']} | {stage['median_s']} | {stage['last_s']} |")
    print(f"wrote {out} (and the operator's log beside it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
