"""How many CPUs this process may use: what sizes a pool of CPU-bound threads.

os.cpu_count() counts the host's CPUs: in a container limited to 2 CPUs on a 64-core node it says
64, and a pool that wide (asyncio's default executor has CPUs + 4 threads, libx264 1.5 threads per
CPU) runs that many threads against a 2-CPU quota; once they have used the period's quota the
kernel stops every thread of the container until the next period, event loops included (a
measured 50 ms at p99: docs/benchmarks.md, "Media encoding"). Here: the CPUs of this process's
affinity, capped by the CPU quota of its cgroup and of the cgroups above it (v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded up; at least 1.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The CPUs this process may keep busy at once (see the module's docstring)."""
    cpus = len(os.sched_getaffinity(0))
    quota = cpu_quota(root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The tightest CPU quota on this process, in CPUs (1.5: a quota of 150 ms per 100 ms period);
    None without one, or where the cgroup files cannot be read."""
    quotas = [q for d in _cgroup_dirs(root, proc_cgroup) if (q := _quota_of(d)) is not None]
    return min(quotas) if quotas else None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's cgroup directories that can hold a CPU quota, its own first, then each one
    above it up to the mount's root (in a container with its own cgroup namespace: just the root)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    mounts: list[tuple[Path, str]] = []
    for line in lines:  # "0::/path" (v2), "4:cpu,cpuacct:/path" (v1)
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2; a hybrid host mounts it at unified/
            mounts.append((root / "unified" if (root / "unified").is_dir() else root, path))
        elif "cpu" in controllers.split(","):
            for name in (controllers, "cpu", "cpu,cpuacct"):
                if (root / name).is_dir():
                    mounts.append((root / name, path))
                    break
    if not mounts:  # no /proc/self/cgroup: the root of either layout
        mounts = [(root, "/"), (root / "cpu", "/")]
    dirs: list[Path] = []
    for mount, path in mounts:
        parts = [p for p in path.split("/") if p]
        if ".." in parts:  # a cgroup outside this namespace's view: only the mount's root is ours to read
            parts = []
        here = mount.joinpath(*parts)
        while True:
            if here.is_dir():
                dirs.append(here)
            if here == mount or here == here.parent:
                break
            here = here.parent
    return dirs


def _quota_of(cgroup: Path) -> float | None:
    v2 = _read(cgroup / "cpu.max")  # "max 100000" or "150000 100000"
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return None if quota == "max" else _ratio(quota, period)
    v1_quota = _read(cgroup / "cpu.cfs_quota_us")  # -1: none
    v1_period = _read(cgroup / "cpu.cfs_period_us")
    if v1_quota is None or v1_period is None or v1_quota.startswith("-"):
        return None
    return _ratio(v1_quota, v1_period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
