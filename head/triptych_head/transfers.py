"""What each worker message of a request's flow means to the head (docs/design.md, "Transfer flow").

One function per message type, each given the request's record and the instance that sent it:
a staged output goes to the next role's queue, an allocated slot gets the sender's push, a
pushed write readies the receiver, pixels go back to the client, a failure is retried or ends
the request. Messages that no longer match the request's state are stale and ignored (or the
worker is told to drop what it holds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from triptych.protocol import (
    CancelWork,
    Failed,
    HeaderTooLarge,
    Progress,
    RequestResult,
    Result,
    TransferAllocated,
    TransferPush,
    TransferPushed,
    TransferRefused,
    TransferStaged,
    WorkRefused,
)
from triptych_head import migration, preemption
from triptych_head.instances import StandingSlot, WorkerInstance
from triptych_head.state import ROLE_STATES, RequestRecord, RequestState, StagedPayload
from triptych_head.timeline import DEVICE_SECONDS, server_timing

if TYPE_CHECKING:
    from triptych_head.core import HeadCore

log = logging.getLogger(__name__)


def on_progress(core: HeadCore, rec: RequestRecord, inst: WorkerInstance, msg: Progress, frames: list[Any]) -> None:
    if rec.instance == inst.url:
        rec.step, rec.total_steps = msg.step, msg.total
        core.event(rec, msg.step, msg.total, msg.preview)


def on_staged(core: HeadCore, rec: RequestRecord, inst: WorkerInstance, msg: TransferStaged, frames: list[Any]) -> None:
    _, running, done = ROLE_STATES[rec.role]
    if rec.state is not running or rec.instance != inst.url:
        core.membership.send(inst.url, CancelWork(rec.wire_id, inst.url, core.head_id))
        return
    seconds = _worker_seconds(core, rec, msg.seconds)
    _count_devices(rec, inst, seconds, msg.batch_size)
    if msg.continues_at is not None:  # stopped at a step boundary: another denoiser runs the rest
        _continuation(core, rec, inst, msg)
        return
    if rec.hop + 1 >= len(rec.route):
        raise RuntimeError(f"{inst.role.value} staged a transfer but is the last role of the route")
    stage = _time_stage(core, rec, seconds, msg.batch_size)
    if core.batch_metrics is not None:
        core.batch_metrics.observe_ran(inst.role.value, msg.batch_size, msg.batch_leader)
    rec.move(done)
    rec.staged = StagedPayload(inst.url, msg.nbytes, msg.manifest, msg.meta, staged_at=core.clock())
    rec.instance = None
    rec.hop += 1
    rec.hop_resumed = False
    core.dispatcher.enter_hop(rec)
    core.metrics.observe_stage(*stage)  # after the push went out: off the request's path


def _continuation(core: HeadCore, rec: RequestRecord, inst: WorkerInstance, msg: TransferStaged) -> None:
    """`rec` left `inst` at a step boundary: suspended for a higher priority (a migration only if it
    resumes elsewhere), or moving to another denoiser; either way back to waiting at the same hop."""
    reason = migration.left(core, rec, inst, msg)
    if reason == preemption.PREEMPT:
        preemption.suspended(core, rec, inst, msg.nbytes)
    else:
        migration.migrated(core, rec, reason, msg.nbytes)
    core.dispatcher.enter_hop(rec, ahead=True)


def on_allocated(
    core: HeadCore, rec: RequestRecord, inst: WorkerInstance, msg: TransferAllocated, frames: list[Any]
) -> None:
    if rec.instance == inst.url and rec.staged is None:
        # The second answer of a receiver asked twice (below), read after the push into that slot
        # landed: the request runs there now, on that input. A CancelWork would end its work.
        log.debug("request %s: %s allocated again after its input arrived", rec.wire_id, inst.url)
        return
    if not (rec.receiver_reserved and rec.instance == inst.url and rec.staged):
        core.membership.send(inst.url, CancelWork(rec.wire_id, inst.url, core.head_id))
        return
    if msg.session != inst.session:
        # A sender writes only to the transfer session its receiver heartbeats, never to one a
        # message names (a restarted process behind the same address: its next heartbeat tells).
        reason = f"{inst.role.value} {inst.url} offered a slot in transfer session {msg.session!r}, not its own"
        core.instance_lost(inst, "session_mismatch", reason)
        return
    if rec.push_in_flight:
        # Asked twice (declared lost, it was only slow, and was picked again): it answers with the slot
        # it already holds, which the push under way writes into. A second push would find nothing
        # staged, and its failure would free that slot under the first write.
        log.debug("request %s: %s allocated again while its push is under way", rec.wire_id, inst.url)
        return
    if msg.standing:
        inst.standing[msg.addr] = StandingSlot(rec.staged.nbytes, holder=rec.wire_id)
        rec.slot_addr = msg.addr
    # The receiver allocated the staged size (transfer_alloc): the sender writes no more than that.
    push = TransferPush(rec.wire_id, rec.staged.sender, msg.session, msg.addr, core.head_id, rec.staged.nbytes)
    if not core.membership.send(rec.staged.sender, push):
        core.sender_unreachable(rec)
        return
    rec.push_in_flight = True


def on_refused(
    core: HeadCore, rec: RequestRecord, inst: WorkerInstance, msg: TransferRefused, frames: list[Any]
) -> None:
    if not (rec.receiver_reserved and rec.instance == inst.url):
        return
    if msg.fatal:
        core.finish(rec, RequestState.FAILED, f"{inst.role.value} {inst.url}: {msg.reason}", status_code=413)
        return
    # Back-pressure: the sender keeps holding the tensors until this or another receiver has room.
    inst.inflight.discard(rec.wire_id)
    inst.refused_bytes = rec.staged.nbytes if rec.staged else 0
    rec.instance = None
    core.dispatcher.requeue(rec)


def on_work_refused(
    core: HeadCore, rec: RequestRecord, inst: WorkerInstance, msg: WorkRefused, frames: list[Any]
) -> None:
    """A worker serving several heads had no scheduling slot free for this Work (another head's
    requests hold them): it counts as full until its next heartbeat, and the request waits again at
    the front of its queue for any instance with room."""
    if rec.instance != inst.url or rec.staged is not None or rec.state is not ROLE_STATES[rec.role][1]:
        return
    inst.inflight.discard(rec.wire_id)
    inst.others_busy = max(inst.others_busy, inst.capacity - len(inst.inflight))
    core.metrics.refused_work.labels(inst.role.value).inc()
    rec.instance = None
    rec.move(ROLE_STATES[rec.role][0])
    core.dispatcher.requeue(rec)


def on_pushed(core: HeadCore, rec: RequestRecord, inst: WorkerInstance, msg: TransferPushed, frames: list[Any]) -> None:
    staged = rec.staged
    if staged is None or staged.sender != inst.url or rec.instance is None:
        return
    inst.inflight.discard(rec.wire_id)  # transfer flow step 5: the sender's scheduling slot is free again
    rec.push_in_flight = False
    rec.staged = None
    # at the level it was given its receiver at (queues.py)
    ready = rec.transfer_ready(staged, rec.instance, rec.slot_addr, core.head_id, rec.held_level)
    started = core.clock()  # before the send, so the hop's time contains all the receiver's work
    try:
        sent = core.membership.send(rec.instance, ready)
    except HeaderTooLarge as exc:  # the receiver would drop it unread: the request fails now, not at its timeout
        core.message_too_large(rec, exc, staged)
        return
    if staged.continues_at is not None and rec.suspended_at is None:
        core.metrics.migration_seconds.observe(started - staged.staged_at)
    # After the send (the receiver need not wait for it), but ending where the next hop begins: the
    # send itself can take milliseconds (the loop's thread losing the GIL to the API's), and the two
    # parts must not overlap (their sum is at most the total; timeline.py).
    dest = _record_transfer(core, rec, inst, staged, msg, ended=started)
    if not sent:
        core.unreachable(rec.instance, f"{dest} {rec.instance} became unreachable before its input was ready", rec)
        return
    rec.move(ROLE_STATES[rec.role][1])
    rec.hop_resumed = staged.continues_at is not None
    preemption.resumed(core, rec, moved_bytes=msg.nbytes)  # a suspended request moved to another denoiser
    rec.hop_started = started
    core.event(rec)


def on_result(core: HeadCore, rec: RequestRecord, inst: WorkerInstance, msg: Result, frames: list[Any]) -> None:
    """Pixels from the route's last hop: the decoder, or a full-pipeline worker."""
    if not rec.last_hop or rec.state is not ROLE_STATES[rec.role][1] or rec.instance != inst.url:
        return
    seconds = _worker_seconds(core, rec, msg.seconds)
    stage = _time_stage(core, rec, seconds, msg.batch_size)
    _count_devices(rec, inst, seconds, msg.batch_size)
    rec.timings[DEVICE_SECONDS] = rec.device_seconds
    if core.batch_metrics is not None:
        core.batch_metrics.observe_ran(inst.role.value, msg.batch_size, msg.batch_leader)
    total = rec.timings["total"] = core.clock() - rec.created
    rec.move(RequestState.DONE)
    timing = server_timing(rec.timeline.durations(), total)
    core.transport.reply(rec.client, RequestResult(rec.request_id, msg.tensors, rec.timings, timing), frames)
    core.metrics.observe_stage(*stage)
    core.finish(rec, RequestState.DONE)


def on_failed(core: HeadCore, rec: RequestRecord, inst: WorkerInstance, msg: Failed, frames: list[Any]) -> None:
    if inst.url not in rec.involved_instances():
        return
    inst.inflight.discard(rec.wire_id)
    reason = f"{inst.role.value} {inst.url}: {msg.error}"
    if rec.staged and rec.staged.sender == inst.url and not msg.write_pending:
        rec.push_in_flight = False  # the sender reported: no write of this request is under way
    if rec.staged and rec.staged.sender == inst.url and rec.receiver_reserved:
        # A failed push is as likely the receiver's fault (it may have died) as the sender's: name
        # both, and retry the request; the sender has freed its outputs, so from the start.
        reason = f"transfer to {rec.role.value} {rec.instance} failed: {reason}"
        receiver = core.membership.find(rec.instance or "")
        if receiver is not None:
            receiver.suspect = True  # until it heartbeats again: retries must not go back to a dead one
            core.retry(rec, receiver, "transfer_failed", reason, outputs_kept=False)
            return
    core.finish(rec, RequestState.FAILED, reason, msg.status_code)


HANDLERS: dict[type, Callable[..., None]] = {
    Progress: on_progress,
    TransferStaged: on_staged,
    TransferAllocated: on_allocated,
    TransferRefused: on_refused,
    WorkRefused: on_work_refused,
    TransferPushed: on_pushed,
    Result: on_result,
    Failed: on_failed,
}


def _record_transfer(
    core: HeadCore, rec: RequestRecord, sender: WorkerInstance, staged: StagedPayload, msg: TransferPushed, ended: float
) -> str:
    """Metrics and timings of a hand-off that ended at `ended` (the head's clock when it heard of the
    write); returns the receiving role's name."""
    receiver = core.membership.find(rec.instance or "")
    dest = receiver.role.value if receiver else "?"
    src = sender.role.value
    core.metrics.child(core.metrics.transfer_bytes, src, dest).inc(msg.nbytes)
    core.metrics.child(core.metrics.transfer_seconds, src, dest).observe(msg.seconds)
    handoff = ended - staged.staged_at  # reserve a slot, push, write, report
    core.metrics.child(core.metrics.handoff_seconds, src, dest).observe(handoff)
    rec.timings[f"transfer_{src}_{dest}"] = msg.seconds
    rec.timings[f"handoff_{src}_{dest}"] = handoff
    rec.timeline.add(f"transfer-{src}-{dest}", rec.hop_started, ended)  # from the receiver's dispatch
    return dest


def _worker_seconds(core: HeadCore, rec: RequestRecord, reported: float) -> float:
    """The seconds a worker reports for its hop, at most the time since the head dispatched it: no
    stage takes longer than that, and one figure beyond it (a bug, a forged message) would otherwise
    set the work estimate that admission refuses requests by, the device-seconds a key is charged,
    and timings whose parts exceed their total."""
    return min(reported, max(core.clock() - rec.hop_started, 0.0))


def _count_devices(rec: RequestRecord, inst: WorkerInstance, worker_seconds: float, batch_size: int) -> None:
    """Add the hop's device-seconds to the request's: its share of the stage's time (a B-th of a batch's),
    on each of the instance's devices. A hop stopped at a step boundary counts what it ran."""
    rec.device_seconds += worker_seconds / max(batch_size, 1) * inst.devices


def _time_stage(
    core: HeadCore, rec: RequestRecord, worker_seconds: float, batch_size: int = 1
) -> tuple[str, float, float]:
    """Record the hop's time as the head saw it (dispatch to output reported) and as the worker
    spent it (load inputs, run stages, stage outputs), and calibrate the work estimate with the
    latter; returns (role, head-seen seconds, worker seconds) for the metrics, which callers
    observe once the request's next message is out. A request that ran in a batch of B costs
    the device a B-th of the batch's time: that share is its device time and its estimate."""
    role = rec.role.value
    now = core.clock()
    elapsed = now - rec.hop_started
    rec.timings[role] = elapsed
    rec.timeline.add(role, rec.hop_started, now, worker_seconds)
    rec.timings[f"worker_{role}"] = worker_seconds
    share = worker_seconds / max(batch_size, 1)
    if not rec.hop_resumed:  # a resumed loop ran only its last steps: no measure of the request's work
        core.workload.observe(rec.role, rec.params, share)
    return role, elapsed, share
