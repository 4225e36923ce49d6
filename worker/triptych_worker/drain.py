"""A worker's drain (SIGTERM): it says so in every heartbeat, keeps serving what the heads still
send, and stops once every live head has acknowledged it and nothing is held, or the heads are
gone, or --disagg-drain-timeout is up."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from triptych_worker.runtime import Worker

log = logging.getLogger(__name__)

HEAD_GONE_HEARTBEAT_TIMEOUTS = 3  # a draining worker that holds nothing and hears no ping this long stops
DRAIN_LOG_S = 5.0  # a draining worker logs what it still holds at least this often


@dataclass
class Drain:
    """A drain under way: since when, until when at most, and whether every head has acknowledged it."""

    started: float
    deadline: float
    acknowledged: bool = False
    last_report: str = ""
    last_logged: float = 0.0


def start_drain(worker: Worker) -> None:
    now = time.monotonic()
    worker._drain = Drain(started=now, deadline=now + worker.args.disagg_drain_timeout)
    worker._next_beat = 0.0  # tell the head now, not at the next beat
    log.info(
        "draining (SIGTERM): finishing held work (%s), then exiting; at most %gs (--disagg-drain-timeout)",
        held_summary(worker) or "nothing held", worker.args.disagg_drain_timeout,
    )  # fmt: skip


def acknowledge_drain(worker: Worker, head_id: str) -> None:
    if worker._drain is None:  # the ack overtook the leader's own start of the drain
        start_drain(worker)
    if head_id not in worker.heads.acknowledged():
        worker.heads.acknowledge(head_id)
        log.info("head %s acknowledged the drain: it sends nothing more", head_id)


def held_summary(worker: Worker) -> str:
    """What this worker still holds, in words; empty when nothing."""
    with worker._lock:
        jobs = len(worker._queue) + (1 if worker._computing else 0)
        staged, slots = len(worker._staged), len(worker._slots)
        outstanding = len(worker._outstanding)
    counts = [
        (jobs, "job"),
        (staged, "staged output"),
        (len(worker._pushes), "push"),
        (slots, "reserved slot"),
        # Accepted requests not counted above (e.g. a job between leaving the queue and running).
        (max(0, outstanding - jobs - slots), "other request"),
    ]
    return ", ".join(f"{n} {what}{'s' if n > 1 else ''}" for n, what in counts if n)


def drain_over(worker: Worker, now: float) -> bool:
    """Whether the drain has ended: acknowledged and nothing held, head gone, or out of time."""
    drain = worker._drain
    assert drain is not None
    held = held_summary(worker)
    if held != drain.last_report or now - drain.last_logged >= DRAIN_LOG_S:
        if held:
            log.info("draining: %s left", held)
        drain.last_report, drain.last_logged = held, now
    drain.acknowledged = worker.heads.all_acknowledged(worker.args.disagg_heartbeat_timeout)
    if not held and drain.acknowledged:
        log.info("drained in %.2fs: the head acknowledged and nothing is held; exiting", now - drain.started)
        return True
    head_gone_s = HEAD_GONE_HEARTBEAT_TIMEOUTS * worker.args.disagg_heartbeat_timeout
    if not held and now - (worker.heads.last_ping() or worker._started) >= head_gone_s:
        log.info("drained: nothing held and no ping from the head for %.0fs (head gone); exiting", head_gone_s)
        return True
    if now >= drain.deadline:
        log.warning(
            "drain timed out after %gs (--disagg-drain-timeout); abandoning %s",
            worker.args.disagg_drain_timeout, held or "nothing (waiting for the head's acknowledgement)",
        )  # fmt: skip
        return True
    return False
