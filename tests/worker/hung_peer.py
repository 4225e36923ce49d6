"""`python -m tests.worker.hung_peer RANK PORT CHECK`: one of two gloo ranks whose peer hangs.

Both ranks join a RankMesh (world of two, Ulysses 2) with STEP_TIMEOUT shortened to STEP_S. The
rank that runs CHECK calls it and prints how it ended; the other rank ("the peer") does what comes
before it and then hangs, alive, for as long as the test lets it. `idle` checks the opposite: a
follower waiting for its next job outlasts STEP_TIMEOUT and still takes the job.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch

from tests.unit.scripted import PARAMS
from triptych.parallelism import Parallelism
from triptych.params import GenerationParams
from triptych_worker.parallel import mesh as mesh_module
from triptych_worker.parallel.apply import every_rank_agrees
from triptych_worker.parallel.jobs import receive_jobs, send_jobs, step_flag
from triptych_worker.parallel.mesh import RankMesh
from triptych_worker.stages import StageBatch

STEP_S = 2.0
HANG_S = 120.0
CALLERS = {"step_flag": 1, "job_inputs": 1, "agree": 0, "gather": 0, "edges": 0}
"""The rank that runs each check; the other one is the hung peer."""


def _job() -> StageBatch:
    return StageBatch(params=GenerationParams(**PARAMS), tensors={"x": torch.ones(2)}, meta={})


def main(rank: int, port: int, check: str) -> None:
    mesh_module.STEP_TIMEOUT = datetime.timedelta(seconds=STEP_S)
    mesh = RankMesh.join(rank, Parallelism(sp=2, ulysses=2), "cpu", port)
    # (who calls, what it calls): the other rank is the hung peer
    checks = {  # the caller is CALLERS[check]
        "step_flag": lambda: step_flag(mesh),  # a follower after a step, rank 0 hung
        "job_inputs": lambda: receive_jobs(mesh),  # rank 0 hangs after the job's first broadcast
        "agree": lambda: every_rank_agrees(mesh, True),
        "gather": lambda: mesh.all_gather_cat(torch.zeros(3, dtype=torch.float64), None, dim=0),
        "edges": lambda: mesh.exchange_edges(torch.zeros(2), torch.zeros(2), [0, 1]),
    }
    if check == "idle":
        if rank == 0:
            time.sleep(STEP_S * 3)  # rank 0 idles past the step timeout, then sends a job
            send_jobs(mesh, [_job()])
        else:
            batches, _ = receive_jobs(mesh)
            print(f"job taken: {batches[0].tensors['x'].tolist()}", flush=True)
        mesh.close()
        return
    caller, call = CALLERS[check], checks[check]
    if rank != caller:
        if check == "job_inputs":  # only the size of the header reaches the follower
            torch.distributed.broadcast(torch.tensor([100], dtype=torch.int64), src=0)
        time.sleep(HANG_S)
        return
    started = time.monotonic()
    try:
        call()
    except Exception as exc:  # what gloo raises for a collective past its timeout
        print(f"gave up after {time.monotonic() - started:.1f} s: {type(exc).__name__}", flush=True)
    else:
        print("returned", flush=True)
    os._exit(0)  # not a clean exit: its peer still hangs in the group


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
