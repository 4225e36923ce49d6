"""Every `triptych serve` process raises its soft open-file limit to the hard one (triptych/open_files.py):
a container runtime's soft 1024 would otherwise cap a head's clients and a worker's peers."""

from __future__ import annotations

import logging
import re
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.e2e.harness import deployment
from triptych.open_files import UNLIMITED_TARGET, raise_open_files_limit
from triptych.roles import Role
from triptych_dev.localdeploy import Proc

LOW = 256


def _limit(text: str) -> int:
    return resource.RLIM_INFINITY if text == "unlimited" else int(text)


def open_files_limits(pid: int) -> tuple[int, int]:
    """(soft, hard) "Max open files" of process `pid`, as /proc shows it."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return _limit(soft), _limit(hard)
    raise AssertionError(f"no open-files line in /proc/{pid}/limits")


def gauge(metrics: str, suffix: str, proc: Proc) -> float:
    """triptych_worker_open_files[_`suffix`] of the worker `proc` in the head's /metrics `metrics` (0: none yet)."""
    name = "triptych_worker_open_files" + (f"_{suffix}" if suffix else "")
    labels = re.escape(f'{{role="{proc.role.value}",worker="{proc.url}"}}')
    found = re.search(rf"^{name}{labels} (\S+)$", metrics, re.M)
    return float(found[1]) if found else 0.0


@contextmanager
def low_soft_limit() -> Iterator[int]:
    """This process's soft limit at LOW while the block starts processes (they inherit it); the soft
    limit a process raises it to (its hard limit, or UNLIMITED_TARGET under no hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, hard))
    try:
        yield UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_process_started_under_a_low_soft_limit_runs_at_its_hard_limit():
    script = "from triptych.open_files import raise_open_files_limit as r; import resource; r(); " \
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE))"  # fmt: skip
    with low_soft_limit() as raised:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert int(out.split()[0]) == raised, out


def test_a_limit_raised_once_is_left_as_it_is_and_said_once(caplog):
    with low_soft_limit() as raised, caplog.at_level(logging.INFO, logger="triptych.open_files"):
        assert raise_open_files_limit() == raised
        assert raise_open_files_limit() == raised
    assert [m.partition(" (")[0] for m in caplog.messages] == [f"open-files limit raised from {LOW} to {raised}"]


def test_a_deployment_started_under_a_low_soft_limit_raises_it_and_exports_each_workers_descriptors(
    tiny_models, tmp_path
):
    runner = resource.getrlimit(resource.RLIMIT_NOFILE)
    with low_soft_limit() as raised, deployment(tiny_models["tiny-flux"], tmp_path, null_payload=4096) as dep:
        resource.setrlimit(resource.RLIMIT_NOFILE, runner)  # all started: the test runner's own back
        with dep.client(timeout=30) as c:
            assert c.get("/ready").status_code == 200
        for proc in dep.procs:  # workers forked from a preloaded interpreter (conftest) raise theirs too
            assert open_files_limits(proc.popen.pid)[0] == raised, proc.role
        head_log = dep.head.log.read_text()
        assert f"open-files limit raised from {LOW} to {raised}" in head_log, head_log[-2000:]
        # Each worker's descriptors and limit, from its heartbeats, on the head's /metrics and /health.
        workers = [p for p in dep.procs if p.role is not Role.SERVER]
        with dep.client(timeout=30) as c:
            deadline = time.monotonic() + 10
            while not all(gauge(text := c.get("/metrics").text, "limit", p) for p in workers):
                assert time.monotonic() < deadline, text[-3000:]  # published at each tick of the head's upkeep
                time.sleep(0.1)
            health = c.get("/health").json()["workers"]
        head_limit = re.search(r"^process_max_fds (\S+)$", text, re.M)  # the head's own, beside its process_open_fds
        assert head_limit and float(head_limit[1]) == raised and re.search(r"^process_open_fds \d", text, re.M)
        for proc in workers:
            in_use, limit = gauge(text, "", proc), gauge(text, "limit", proc)
            now = len(list(Path(f"/proc/{proc.popen.pid}/fd").iterdir()))
            assert 10 <= in_use <= now + 10 and limit == raised, (proc.role, in_use, now, limit)
            (entry,) = (w for w in health[proc.role.value] if w["url"] == proc.url)
            assert entry["open_files_limit"] == raised and entry["open_files"] > 0, entry


def test_no_soft_limit_is_left_as_it_is_and_under_no_hard_limit_the_soft_one_is_raised_to_a_bound(monkeypatch):
    """What the kernel would answer, given through getrlimit: setrlimit may not lower an unlimited soft
    limit, and raises a finite one to UNLIMITED_TARGET where there is no hard limit."""
    inf, calls = resource.RLIM_INFINITY, []
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: calls.append(limits))
    monkeypatch.setattr(resource, "getrlimit", lambda which: (inf, inf))
    assert raise_open_files_limit() == inf and calls == []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, inf))
    assert raise_open_files_limit() == UNLIMITED_TARGET and calls == [(UNLIMITED_TARGET, inf)]
