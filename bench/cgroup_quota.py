"""A CPU quota for a benchmark's process (and the children it starts from then on): a new cgroup
(v2, else v1's cpu controller) limited to N CPUs, as a pod with a CPU limit runs; needs root."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


@contextmanager
def limited_to(cpus: float, name: str) -> Iterator[Path]:
    """This process inside a cgroup limited to `cpus` CPUs until the block ends; the cgroup's path.
    OSError (with what to do) where there is no writable cgroup hierarchy."""
    group = _enter(cpus, f"{name}-{os.getpid()}")
    try:
        yield group
    finally:
        (group.parent / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()


def _enter(cpus: float, name: str) -> Path:
    quota = int(cpus * PERIOD_US)
    try:
        if (CGROUP / "cgroup.controllers").exists():  # v2: the root hands the cpu controller down
            if "cpu" not in (CGROUP / "cgroup.subtree_control").read_text().split():
                (CGROUP / "cgroup.subtree_control").write_text("+cpu")
            group = CGROUP / name
            group.mkdir()
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            group = CGROUP / "cpu" / name
            group.mkdir()
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        raise OSError(f"a CPU quota needs root and a writable cgroup hierarchy under {CGROUP}: {exc}") from exc
    return group
