"""The Helm chart: lints clean, renders least-privilege RBAC, and agrees with the operator's defaults."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.fixtures import cluster_settings
from tests.operator.helpers import REPO
from triptych_operator.constants import DEFAULT_HEAD_IMAGE, DEFAULT_WORKER_IMAGE, HEAD_IMAGE_ENV, WORKER_IMAGE_ENV
from triptych_operator.main import LIVENESS_ENV, WATCH_NAMESPACES_ENV

CHART = REPO / "charts" / "triptych"


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


def render(helm_bin: Path, *sets: str) -> list[dict[str, Any]]:
    flags = [f for s in sets for f in ("--set", s)]
    out = helm(helm_bin, "template", "rel", str(CHART), "--namespace", "ops", "--kube-version", "1.34.0", *flags)
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_values_default_images_are_the_operators_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert (values["workerImage"], values["headImage"]) == (DEFAULT_WORKER_IMAGE, DEFAULT_HEAD_IMAGE)


def test_helm_lint_is_clean(helm_bin: Path) -> None:
    out = helm(helm_bin, "lint", "--strict", str(CHART), "--set", "examplePipeline.enabled=true")
    assert "[WARNING]" not in out and "[ERROR]" not in out


def test_cluster_wide_install_uses_a_cluster_role_without_wildcards(helm_bin: Path) -> None:
    docs = render(helm_bin)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRole",
        "ClusterRoleBinding",
        "ClusterRoleBinding",
        "Deployment",
        "ServiceAccount",
    ]
    for role in (d for d in docs if d["kind"] == "ClusterRole"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            assert "kopf.dev" not in rule["apiGroups"]  # standalone: no peering resources


def test_namespaced_install_uses_a_role_per_namespace(helm_bin: Path) -> None:
    docs = render(helm_bin, "watchNamespaces={a,b}")
    roles = sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "Role")
    assert roles == ["a", "b"]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TRIPTYCH_WATCH_NAMESPACES"] == "a,b"


def test_example_pipeline_is_optional_and_valid(helm_bin: Path) -> None:
    from triptych_operator.spec import parse_pipeline

    assert not [d for d in render(helm_bin) if d["kind"] == "DiffusionPipeline"]
    [example] = [d for d in render(helm_bin, "examplePipeline.enabled=true") if d["kind"] == "DiffusionPipeline"]
    parse_pipeline(example["metadata"]["name"], "ops", example["spec"])


def test_the_operator_env_the_chart_sets_is_the_env_the_operator_reads(helm_bin: Path) -> None:
    deployment = next(d for d in render(helm_bin) if d["kind"] == "Deployment")
    env = {e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env == {WATCH_NAMESPACES_ENV, LIVENESS_ENV, WORKER_IMAGE_ENV, HEAD_IMAGE_ENV}
