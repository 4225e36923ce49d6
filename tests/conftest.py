from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from triptych_dev import localdeploy
from triptych_dev.prefork import Launcher

pytest_plugins = ["tests.cluster.fixtures", "tests.models.fixtures", "tests.s3.seaweedfs"]


@pytest.fixture(scope="session", autouse=True)
def preloaded_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher | None]:
    """Local deployments start their workers from one interpreter that imported torch and diffusers
    once (triptych_dev.prefork; ~5 s of CPU saved per worker); TRIPTYCH_PREFORK=0: ordinary processes.
    The server starts with the first worker, so a session without one never pays for it."""
    if os.environ.get("TRIPTYCH_PREFORK", "1") == "0":
        yield None
        return
    with Launcher(tmp_path_factory.mktemp("prefork")) as launcher:
        localdeploy.use_prefork(launcher)
        _launchers.append(launcher)
        try:
            yield launcher
        finally:
            localdeploy.use_prefork(None)


_launchers: list[Launcher] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many workers were forked, and why any were not: a decline costs each worker ~5 s of CPU,
    and a run where most are declined is slower without failing."""
    for launcher in _launchers:
        if launcher.forked or launcher.declined:
            terminalreporter.write_line(f"prefork: {launcher.forked} processes forked")
        for reason, count in sorted(launcher.declined.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"prefork: {count} declined: {reason}")
