"""A rank whose peer hangs inside a job (alive, stuck) gives up after STEP_TIMEOUT in every kind
of collective a job uses, world-wide ones included; a follower waiting between jobs does not
(triptych_worker.parallel.mesh; docs/parallelism.md "Failure"). Two real gloo processes each
(tests/worker/hung_peer.py). And a follower that may have fallen out of step ends at once."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.worker.hung_peer import CALLERS, HANG_S, STEP_S
from triptych.lora import BadAdapter
from triptych_dev.localdeploy import free_port_block
from triptych_worker.parallel.jobs import StopFollowing
from triptych_worker.parallel.ranks import check_in_step
from triptych_worker.resume import CannotResume


def _run(check: str) -> str:
    """Both ranks for `check`; what the checking rank printed."""
    port = free_port_block(1)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.worker.hung_peer", str(rank), str(port), check],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:  # the checking rank prints (in `idle`, rank 1); its peer hangs until killed
        checking = ranks[CALLERS.get(check, 1)]
        try:
            return checking.communicate(timeout=HANG_S / 2)[0]
        except subprocess.TimeoutExpired:
            return "still waiting"
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait(30)


@pytest.mark.parametrize("check", ["step_flag", "job_inputs", "agree", "gather", "edges"])
def test_a_collective_inside_a_job_gives_up_on_a_hung_peer(check: str) -> None:
    out = _run(check)
    given_up = re.search(r"gave up after ([\d.]+) s", out)
    assert given_up, f"{check}: the rank kept waiting for its hung peer ({out!r})"
    assert float(given_up.group(1)) < STEP_S + 20, out


def test_a_follower_waits_for_its_next_job_past_the_step_timeout() -> None:
    assert "job taken: [1.0, 1.0]" in _run("idle")


def test_a_follower_ends_on_a_request_it_alone_may_have_failed_out_of_step() -> None:
    """A batched job's per-request failures on a follower: rank 0's stop and the failures every rank
    meets at one point keep it in step; any other (a follower's own out-of-memory, say) ends it, so
    that rank 0's watchdog ends the instance now instead of rank 0 waiting out the step timeout in a
    collective the follower skipped."""
    check_in_step([None, StopFollowing(), CannotResume("state"), BadAdapter("adapter")])
    with pytest.raises(MemoryError):
        check_in_step([None, MemoryError("CPU out of memory on rank 1")])
