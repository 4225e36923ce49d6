"""torch's CPU threads fitted to a CPU limit: called by every process that loads a pipeline, before it does.

torch starts one intra-op thread per physical core of the host, whatever the container may use: a
worker pod limited to 8 CPUs on a 128-core GPU node runs 64 threads at every parallel operator
(tokenising aside, a GPU worker's CPU work is small, but a CPU worker's whole stage is such
operators) against an 8-CPU quota, and once they have used a period's quota the kernel stops
every thread of the pod, its leader polling writes and sockets included, until the next period
(docs/benchmarks.md, "Media encoding", has the same effect on the head). Where the process has a
CPU quota (triptych.cpus.cpu_quota) below torch's thread count, the count is lowered to the quota
rounded up (a role's ranks, processes of one pod, share it); never raised, and left alone where
OMP_NUM_THREADS says how many (as torch itself does). Without a quota nothing changes, so outputs
stay byte-identical to a stock pipeline run in the same environment.
"""

from __future__ import annotations

import logging
import math
import os

from triptych.cpus import cpu_quota

log = logging.getLogger(__name__)


def fit_torch_threads(quota: float | None = None, processes: int = 1) -> int:
    """Lower torch's intra-op threads to this process's share of the CPU quota (default: the process's
    own quota; `processes`: how many processes of the pod share it, e.g. a role's ranks); the count after."""
    import torch

    before = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return before
    quota = cpu_quota() if quota is None else quota
    if quota is None:
        return before
    cap = max(1, math.ceil(quota / max(1, processes)))
    if before > cap:
        log.info("torch CPU threads %d -> %d: %.2f CPUs of quota for %d process(es)", before, cap, quota, processes)
        torch.set_num_threads(cap)
    return torch.get_num_threads()
