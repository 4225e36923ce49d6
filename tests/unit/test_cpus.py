"""How many CPUs a process may use (triptych/cpus.py): its affinity capped by its cgroups' CPU quota.

The cgroup trees here are folders laid out as the kernel mounts them (v2, v1, a hybrid host), read
through the same code as /sys/fs/cgroup; the last test reads this machine's own.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from triptych.cpus import cpu_quota, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def proc_cgroup(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


def test_v2_the_tightest_quota_on_the_way_up_counts_rounded_up(tmp_path):
    root = tree(tmp_path / "cg", {
        "cpu.max": "max 100000",  # the host's root has none
        "kubepods/cpu.max": "max 100000",
        "kubepods/pod1/cpu.max": "250000 100000",  # the pod: 2.5 CPUs
        "kubepods/pod1/c1/cpu.max": "400000 100000",  # the container asks for more than its pod has
    })  # fmt: skip
    own = proc_cgroup(tmp_path, "0::/kubepods/pod1/c1\n")
    assert cpu_quota(root, own) == 2.5
    assert usable_cpus(root, own) == min(AFFINITY, 3)


def test_v2_in_a_cgroup_namespace_the_root_is_the_container(tmp_path):
    root = tree(tmp_path / "cg", {"cpu.max": "50000 100000"})
    own = proc_cgroup(tmp_path, "0::/\n")
    assert cpu_quota(root, own) == 0.5
    assert usable_cpus(root, own) == 1, "half a CPU is still one thread"


def test_v1_quota_and_period_of_the_cpu_controller(tmp_path):
    root = tree(tmp_path / "cg", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1",
        "cpu,cpuacct/cpu.cfs_period_us": "100000",
    })  # fmt: skip
    own = proc_cgroup(tmp_path, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n")
    assert cpu_quota(root, own) == 1.5
    assert usable_cpus(root, own) == min(AFFINITY, 2)


def test_a_hybrid_host_reads_v2_under_unified_and_v1_beside_it(tmp_path):
    root = tree(tmp_path / "cg", {
        "unified/cgroup.procs": "",
        "cpu/cpu.cfs_quota_us": "-1",
        "cpu/cpu.cfs_period_us": "100000",
        "cpu/job/cpu.cfs_quota_us": "100000",
        "cpu/job/cpu.cfs_period_us": "100000",
    })  # fmt: skip
    own = proc_cgroup(tmp_path, "1:cpu:/job\n0::/\n")
    assert cpu_quota(root, own) == 1.0
    assert usable_cpus(root, own) == 1


def test_a_cgroup_outside_the_namespaces_view_reads_only_the_root(tmp_path):
    root = tree(tmp_path / "cg", {"cpu.max": "200000 100000", "x/cpu.max": "50000 100000"})
    own = proc_cgroup(tmp_path, "0::/../../x\n")
    assert cpu_quota(root, own) == 2.0


@pytest.mark.parametrize(
    "files",
    [
        {},  # no cgroup files at all (not Linux's layout, or not mounted)
        {"cpu.max": "max 100000"},
        {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},
        {"cpu.max": "garbage here"},
        {"cpu.max": "0 100000"},
    ],
)
def test_without_a_usable_quota_the_affinity_decides(tmp_path, files):
    root = tree(tmp_path / "cg", files)
    for own in (proc_cgroup(tmp_path, "0::/\n"), tmp_path / "missing", proc_cgroup(tmp_path, "not a cgroup line\n")):
        assert cpu_quota(root, own) is None
        assert usable_cpus(root, own) == AFFINITY


def test_this_machine():
    quota = cpu_quota()
    expected = AFFINITY if quota is None else max(1, min(AFFINITY, math.ceil(quota)))
    assert usable_cpus() == expected
