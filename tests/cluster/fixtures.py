"""Pytest plugin: a real local Kubernetes control plane with fake (kwok) GPU/RDMA nodes.

Registered from tests/conftest.py (``pytest_plugins = ["tests.cluster.fixtures"]``).

Fixtures
  ``k8s_toolchain`` (session): the built binaries; FAILS (does not skip) when ``make setup`` has not built them.
  ``kube_cluster``  (session): starts the cluster with tests/cluster/up.sh (from an empty etcd, once more
                               after a failed start), or reuses a running one.
                               The cluster is left running at the end of the session (other sessions
                               may share it; `make cluster-down` stops it). TRIPTYCH_CLUSTER_TEARDOWN=1
                               stops it at the end if this session started it.
  ``kube_namespace`` (function): a fresh, uniquely named namespace, deleted afterwards without waiting.

Tests that use ``kube_cluster`` (directly or through ``kube_namespace``) are marked ``cluster``
automatically, so ``pytest -m "not cluster"`` deselects them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import yaml

CLUSTER_SRC = Path(__file__).resolve().parent
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
BINARIES = (*COMPONENTS, "kubectl", "helm")


class CommandError(subprocess.CalledProcessError):
    """A failed kubectl/helm call; str() includes stdout and stderr."""

    def __str__(self) -> str:
        cmd = " ".join(map(str, self.cmd))
        return f"{cmd} exited with {self.returncode}\nstdout: {self.stdout}\nstderr: {self.stderr}"


def cluster_settings(env: dict[str, str] | None = None) -> dict[str, str]:
    """The resolved settings of env.sh (paths, ports, versions) for the given environment."""
    out = subprocess.run(
        ["bash", str(CLUSTER_SRC / "env.sh")], env=env, capture_output=True, text=True, check=True, timeout=30
    )
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def missing_binaries(bin_dir: str | Path) -> list[str]:
    return [b for b in BINARIES if not os.access(Path(bin_dir) / b, os.X_OK)]


def cluster_env(settings: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ + KUBECONFIG + PATH with our kubectl/helm first + helm state inside the cluster dir."""
    env = dict(os.environ if base is None else base)
    env["KUBECONFIG"] = settings["KUBECONFIG_PATH"]
    env["PATH"] = settings["BIN_DIR"] + os.pathsep + env.get("PATH", "")
    helm_home = Path(settings["CLUSTER_DIR"]) / "helm"
    env["HELM_CACHE_HOME"] = str(helm_home / "cache")
    env["HELM_CONFIG_HOME"] = str(helm_home / "config")
    env["HELM_DATA_HOME"] = str(helm_home / "data")
    return env


def run(cmd: list[str], *, env: dict[str, str], check: bool = True, timeout: float = 60, input: str | None = None):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise CommandError(proc.returncode, cmd, proc.stdout, proc.stderr)
    return proc


@dataclasses.dataclass
class KubeCluster:
    kubeconfig: str
    env: dict[str, str]
    bin_dir: str
    state_dir: str
    settings: dict[str, str]

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60, input: str | None = None):
        """Run our kubectl against this cluster; raises CommandError on failure unless check=False."""
        cmd = [str(Path(self.bin_dir) / "kubectl"), *args]
        return run(cmd, env=self.env, check=check, timeout=timeout, input=input)

    def kubectl_json(self, *args: str, timeout: float = 60) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout).stdout)

    def apply(self, manifest: str, namespace: str | None = None):
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=manifest)

    def wait_condition(self, ref: str, condition: str, namespace: str | None = None, timeout: float = 60) -> None:
        """Wait until `ref` (kind/name) reports `condition` True; TimeoutError after `timeout` seconds.

        Polled here rather than with `kubectl wait`: an object created a moment ago can have no
        status.conditions yet, and kubectl wait then exits at once with an accessor error instead of
        waiting (seen in CI for a CRD right after its apply).
        """
        ns = ["-n", namespace] if namespace else []
        query = f'{{.status.conditions[?(@.type=="{condition}")].status}}'
        deadline = time.monotonic() + timeout
        while True:
            out = self.kubectl(*ns, "get", ref, "-o", f"jsonpath={query}", check=False)
            if out.stdout.strip() == "True":
                return
            if time.monotonic() > deadline:
                last = out.stdout.strip() or out.stderr.strip() or "no such condition yet"
                raise TimeoutError(f"{ref} not {condition} after {timeout:.0f} s (last: {last})")
            time.sleep(0.5)

    def apply_crd(self, path: Path, timeout: float = 60) -> None:
        """Apply a CRD and wait until the API server serves it (condition Established)."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        self.wait_condition(f"crd/{name}", "Established", timeout=timeout)

    def helm(self, *args: str, check: bool = True, timeout: float = 120):
        return run([str(Path(self.bin_dir) / "helm"), *args], env=self.env, check=check, timeout=timeout)

    def is_ready(self) -> bool:
        return self.kubectl("get", "--raw", "/readyz", check=False, timeout=10).returncode == 0


def _cluster_for(settings: dict[str, str]) -> KubeCluster:
    return KubeCluster(
        kubeconfig=settings["KUBECONFIG_PATH"],
        env=cluster_env(settings),
        bin_dir=settings["BIN_DIR"],
        state_dir=settings["CLUSTER_DIR"],
        settings=settings,
    )


@pytest.fixture(scope="session")
def k8s_toolchain() -> dict[str, str]:
    settings = cluster_settings()
    missing = missing_binaries(settings["BIN_DIR"])
    if missing:
        pytest.fail(
            f"the local Kubernetes toolchain is not built (missing {', '.join(missing)} in {settings['BIN_DIR']}): "
            "run `make setup` (or `bash tests/cluster/build.sh`, ~15-25 min the first time)",
            pytrace=False,
        )
    return settings


def _up(fresh: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRIPTYCH_CLUSTER_FRESH": "1"} if fresh else None
    return subprocess.run(
        ["bash", str(CLUSTER_SRC / "up.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def _why(proc: subprocess.CompletedProcess) -> str:
    """up.sh's reason (its last line on stderr), for the one line pytest's summary shows."""
    lines = [line for line in (proc.stderr or "").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"


@pytest.fixture(scope="session")
def kube_cluster(k8s_toolchain: dict[str, str]) -> Iterator[KubeCluster]:
    cluster = _cluster_for(k8s_toolchain)
    was_running = Path(cluster.kubeconfig).exists() and cluster.is_ready()
    # up.sh is idempotent: on a running cluster it only re-checks components and nodes (~1 s). A session
    # that starts the cluster starts it from an empty etcd (certs kept): what earlier sessions left there
    # is no input to this one.
    proc = _up(fresh=not was_running)
    if proc.returncode != 0:
        # Once more from a clean stop, so that one bad start costs a retry, not every cluster test.
        subprocess.run(["bash", str(CLUSTER_SRC / "down.sh")], capture_output=True, timeout=180)
        first, proc = proc, _up(fresh=True)
        if proc.returncode != 0:
            pytest.fail(
                f"tests/cluster/up.sh failed twice: {_why(proc)} (first: {_why(first)}); logs in "
                f"{cluster.state_dir}/logs\n{proc.stdout}\n{proc.stderr}",
                pytrace=False,
            )
    yield cluster
    # Left running by default: other pytest sessions (other workers, other engineers) may share it, and
    # the next session then starts in ~2 s. `make cluster-down` stops it.
    if not was_running and os.environ.get("TRIPTYCH_CLUSTER_TEARDOWN") == "1":
        subprocess.run(["bash", str(CLUSTER_SRC / "down.sh")], capture_output=True, timeout=120)


@pytest.fixture
def kube_namespace(kube_cluster: KubeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{base}-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", name)
    kube_cluster.kubectl("label", "namespace", name, "triptych.test/ephemeral=true")
    yield name
    # The namespace controller finishes the deletion in the background.
    kube_cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False, timeout=30)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if ("kube_cluster" in fixtures or "kube_namespace" in fixtures) and not item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.cluster)


PORT_SETTINGS = (
    "TRIPTYCH_ETCD_PORT",
    "TRIPTYCH_ETCD_PEER_PORT",
    "TRIPTYCH_APISERVER_PORT",
    "TRIPTYCH_KCM_PORT",
    "TRIPTYCH_SCHEDULER_PORT",
    "TRIPTYCH_KWOK_PORT",
)


def free_port_settings() -> dict[str, str]:
    """Every port setting of env.sh -> a port free on 127.0.0.1 now: a throw-away cluster beside the shared one."""
    socks = [socket.socket() for _ in PORT_SETTINGS]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return {name: str(s.getsockname()[1]) for name, s in zip(PORT_SETTINGS, socks, strict=True)}
    finally:
        for s in socks:
            s.close()


def running_processes() -> Iterator[tuple[str, str, str]]:
    """(pid, executable's base name, NUL-separated command line) of every process this user can read."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            exe = os.path.basename(os.readlink(proc / "exe"))
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        yield proc.name, exe, cmdline


T = TypeVar("T")


def poll(fn: Callable[[], T | None], *, timeout: float = 60, interval: float = 0.5, what: str = "condition") -> T:
    """Call fn until it returns something truthy; fail with the last value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
        time.sleep(interval)
