"""Start-up phases (triptych.startup): every real process reports where its start-up time went, each
phase once, in order, in seconds since the process started. Ordinary processes here, not the tests'
preloaded interpreter (triptych_dev.prefork), so that imports and the re-execution under the bind
shim happen as in production (bench/cold_start_bench.py times them)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from triptych import startup
from triptych.roles import COMBINED_ROLES, Role
from triptych_dev import localdeploy
from triptych_dev.localdeploy import local_deployment, local_monolithic

pytestmark = pytest.mark.slow

WORKER_PHASES = ["reexec", "started", "imported", "loaded", "transfer", "listening", "registered"]
MONOLITHIC_PHASES = ["started", "imported", "loaded", "listening"]
HEAD_PHASES = ["started", "listening"]


@pytest.fixture
def ordinary_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(localdeploy, "_launcher", None)


def assert_in_order(phases: dict[str, float] | None, expected: list[str]) -> None:
    assert phases is not None, "no start-up line"
    assert list(phases) == expected, phases
    values = list(phases.values())
    assert values == sorted(values) and values[0] > 0, phases


def test_every_worker_logs_its_phases_in_order_up_to_its_first_heartbeat(
    tiny_models: dict[str, Path], tmp_path: Path, ordinary_processes: None
) -> None:
    with local_deployment(tiny_models["tiny-flux"], tmp_path, worker_flags=("--device", "cpu")) as dep:
        for role in COMBINED_ROLES:
            (worker,) = dep.workers(role)
            assert_in_order(startup.parse_line(worker.log.read_text()), WORKER_PHASES)
        health = httpx.get(f"{dep.http}/health", timeout=10).json()
    assert_in_order(health["startup"], HEAD_PHASES)
    assert all(w["ready"] for role in COMBINED_ROLES for w in health["workers"][role.value])


def test_monolithic_mode_reports_its_phases_in_health(
    tiny_models: dict[str, Path], tmp_path: Path, ordinary_processes: None
) -> None:
    with local_monolithic(tiny_models["tiny-flux"], tmp_path, flags=("--device", "cpu")) as dep:
        health = httpx.get(f"{dep.http}/health", timeout=10).json()
        (proc,) = dep.procs
        assert proc.role is Role.MONOLITHIC
        logged = startup.parse_line(proc.log.read_text())
    assert_in_order(health["startup"], MONOLITHIC_PHASES)
    assert logged == pytest.approx(health["startup"], abs=1e-3)  # the log line says the same
