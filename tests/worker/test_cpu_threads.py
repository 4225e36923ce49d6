"""torch's CPU threads fitted to a CPU quota (worker/triptych_worker/cpu_threads.py).

Each case runs in a fresh interpreter (the thread count is the process's), started with a known
count so that the outcome does not depend on this machine's cores.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def threads_after(start: int, quota: str, omp: str | None = None, processes: int = 1) -> int:
    """torch's thread count after fit_torch_threads(quota, processes), from `start` threads."""
    code = (
        f"import torch; torch.set_num_threads({start})\n"
        "from triptych_worker.cpu_threads import fit_torch_threads\n"
        f"print(fit_torch_threads({quota}, {processes}), torch.get_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / d) for d in ("", "worker", "head"))
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    returned, actual = (int(x) for x in out.stdout.split())
    assert returned == actual
    return actual


@pytest.mark.parametrize(("start", "quota", "expected"), [(4, "1.5", 2), (4, "0.25", 1), (4, "3.0", 3)])
def test_a_quota_below_the_thread_count_lowers_it_to_the_quota_rounded_up(start, quota, expected):
    assert threads_after(start, quota) == expected


@pytest.mark.parametrize(("quota", "processes", "expected"), [("4.0", 2, 2), ("3.0", 2, 2), ("1.0", 4, 1)])
def test_processes_sharing_a_quota_each_take_their_share_rounded_up(quota, processes, expected):
    assert threads_after(8, quota, processes=processes) == expected


def test_never_raised_by_a_larger_quota():
    assert threads_after(2, "8.0") == 2


def test_omp_num_threads_is_left_to_decide():
    assert threads_after(4, "1.0", omp="4") == 4


def test_this_machines_quota_or_none_leaves_a_count_within_it():
    from triptych.cpus import cpu_quota

    quota = cpu_quota()
    got = threads_after(4, "None")
    assert got == (4 if quota is None else min(4, max(1, math.ceil(quota))))
