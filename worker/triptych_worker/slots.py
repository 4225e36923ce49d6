"""Receive slots: the pool space a request's inputs arrive in. A receiver allocates one per
TransferAlloc (or holds standing ones the head assigns by address), refuses when it has no room
(back-pressure: the head retries after the heartbeat that reports freed space), queues the job when
TransferReady says the inputs are there, and frees the slot once the inputs are copied out or the
stages that used them in place are done."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from triptych.protocol import Failed, TransferAlloc, TransferAllocated, TransferReady, TransferRefused
from triptych.roles import Role
from triptych_worker import standing
from triptych_worker.heads import HeadLinks
from triptych_worker.job_groups import Job
from triptych_worker.transfer import Allocation, PayloadTooLarge, StagedTensors

if TYPE_CHECKING:
    from triptych_worker.runtime import Worker

log = logging.getLogger(__name__)

STANDING = "standing-slot"  # pool owner of standing receive slots


def allocate(worker: Worker, link: HeadLinks, msg: TransferAlloc) -> None:
    """A slot for a request's inputs (TransferAllocated: where to write them), or a refusal."""
    worker.heads.own(msg.request_id, msg.head_id)
    with worker._lock:
        held = worker._slots.get(msg.request_id)
        held_standing = held is not None and worker._standing.get(held.addr) is held
    if held is not None:  # asked again (a retried hop): the slot it holds, never a second one left to leak
        if held.nbytes < msg.nbytes:
            error = (f"transfer_alloc of {msg.nbytes} bytes for request {msg.request_id}, which already holds "
                     f"a {held.nbytes}-byte receive slot here")  # fmt: skip
            link.send(Failed(msg.request_id, worker.instance, error))
            return
        session = worker.transport.session_id
        link.send(TransferAllocated(msg.request_id, worker.instance, session, held.addr, held_standing))
        return
    if worker._full():
        refuse(worker, link, msg.request_id, "every scheduling slot is taken")
        return
    if _must_keep_room_for_outputs(worker, msg.nbytes):
        refuse(worker, link, msg.request_id, "keeping room to stage accepted work")
        return
    # Standing slots only for a worker serving one head: the head assigns them without asking, and
    # two heads could assign one slot, or fill more slots than the worker has.
    standing_slot = msg.standing and worker.heads.single
    try:
        # A standing slot belongs to the worker, not the request: cancelling the request keeps it.
        alloc = worker.pool.allocate(msg.nbytes, owner=STANDING if standing_slot else msg.request_id)
    except PayloadTooLarge as exc:
        link.send(TransferRefused(msg.request_id, worker.instance, str(exc), fatal=True))
        return
    if alloc is None:
        refuse(worker, link, msg.request_id, "transfer pool full")
        return
    with worker._lock:
        worker._slots[msg.request_id] = alloc
        worker._outstanding.add(msg.request_id)
        if standing_slot:
            worker._standing[alloc.addr] = alloc
    worker._note_held()
    link.send(
        TransferAllocated(msg.request_id, worker.instance, worker.transport.session_id, alloc.addr, standing_slot)
    )


def refuse(worker: Worker, link: HeadLinks, request_id: str, reason: str) -> None:
    """Back-pressure: no slot now; the head retries after the heartbeat that reports freed space."""
    with worker._lock:
        worker._owes_heartbeat = True
    link.send(TransferRefused(request_id, worker.instance, reason, fatal=False))
    link.broadcast(worker._heartbeat)


def space_freed(worker: Worker, link: HeadLinks) -> None:
    """Tell the head at once that pool space came back, if it is waiting for that (after a refusal)."""
    with worker._lock:
        owed, worker._owes_heartbeat = worker._owes_heartbeat, False
    if owed:
        link.broadcast(worker._heartbeat)


def _must_keep_room_for_outputs(worker: Worker, nbytes: int) -> bool:
    """Refuse an input slot that would leave no room to stage the outputs of work already accepted.

    Otherwise a tight pool deadlocks: the running request cannot stage its output while the
    space it needs holds the input of the request queued behind it. Outputs are assumed no
    larger than inputs (latents in, latents out); the decoder's outputs bypass the pool.
    """
    if worker.role is Role.DECODER or nbytes > worker.pool.pool_bytes:
        return False  # too large ever is reported by allocate() as fatal
    with worker._lock:
        busy = bool(worker._outstanding)
    return busy and worker.pool.free_bytes - nbytes < nbytes


def ready(worker: Worker, link: HeadLinks, msg: TransferReady) -> None:
    """Run the stages on an input in a slot; `in_place`: on the continuation this worker staged
    itself (a suspended request resuming here: its state never left the pool)."""
    worker.heads.own(msg.request_id, msg.head_id)
    allocated = None  # the slot of its own TransferAlloc (standing or not)
    with worker._lock:
        if msg.in_place:  # a continuation is always staged in the pool (compute.py); outputs sent in
            # place are not a slot: they stay staged, for their push or their cancel to release
            staged = worker._staged.get(msg.request_id)
            alloc = staged.allocation if isinstance(staged, StagedTensors) else None
            if alloc is not None:
                del worker._staged[msg.request_id]
                worker._outstanding.add(msg.request_id)
        else:
            allocated = worker._slots.pop(msg.request_id, None)
            alloc = worker._standing.get(msg.slot_addr) if msg.slot_addr else allocated
        problem = _not_runnable(worker, msg, alloc, allocated=allocated is not None)
        # Its own slot, when its inputs came into another (a standing one, after the head lost and found
        # this worker again) or it cannot run: no job will release it, so it is freed here.
        unused = allocated if allocated is not None and (allocated is not alloc or problem) else None
        if unused is not None and worker._standing.get(unused.addr) is unused:
            unused = None  # a standing slot stays the worker's
    if unused is not None:
        worker.pool.free(unused)
        space_freed(worker, link)
    if problem:
        link.send(Failed(msg.request_id, worker.instance, f"transfer_ready for {problem}"))
        return
    assert alloc is not None
    incoming = (alloc, msg.manifest, msg.meta)
    job = Job(
        msg.request_id, msg.params, incoming, msg.progress, msg.preview_every, msg.batch_id, msg.batch_size,
        traceparent=msg.traceparent, priority=msg.priority, edit=msg.edit,
    )  # fmt: skip
    with worker._lock:
        waits = worker._computing or bool(worker._queue)
    if waits:  # the loader copies its inputs while the jobs ahead of it compute
        # Handed to the loader before it is queued: once queued, the computing thread may take it at
        # once, and a load submitted after that would copy a slot already freed and never be taken.
        worker.inputs.submit(job)
    # else it computes now, on this thread, which loads its inputs itself: handing them to the
    # loader would only put a wake-up of another thread (and a wait for it) on the request's path.
    worker._enqueue(job)
    worker._note_held()


def _not_runnable(worker: Worker, msg: TransferReady, alloc: Allocation | None, allocated: bool) -> str:
    """Why `msg` cannot run on `alloc` ("": it can), as what follows "transfer_ready for"; caller holds the
    worker's lock. A duplicate, or a standing slot whose inputs another queued request still waits on,
    would run on bytes not its own. `allocated`: the request held a slot of its own TransferAlloc (it
    counts as outstanding since then, so only without one is outstanding a duplicate)."""
    if alloc is None and msg.in_place:
        return "a continuation this worker has not staged"
    if alloc is None and msg.slot_addr:
        return f"a slot this worker does not hold (slot_addr {msg.slot_addr:#x} is none of its standing slots)"
    if alloc is None:
        return "a slot this worker does not hold"
    if msg.slot_addr and not allocated and msg.request_id in worker._outstanding:
        return f"request {msg.request_id}, which this worker already runs or queues"
    for job in worker._queue:
        if job.incoming is not None and job.incoming[0] is alloc and job.request_id not in worker._cancelled:
            return f"slot_addr {msg.slot_addr:#x}, which still holds the inputs of request {job.request_id}"
    return ""


def reserve_standing(worker: Worker) -> None:
    """Reserve this receiver's start-up standing slots (again, after a head change dropped them)."""
    with worker._lock:
        held = len(worker._standing)
    capacity = worker.args.worker_capacity * worker.args.batching_max_size
    slots = standing.reserve(worker.pool, worker._startup_slot_bytes, capacity, held, owner=STANDING)
    with worker._lock:
        worker._standing.update((alloc.addr, alloc) for alloc in slots)
    if slots:
        log.info("reserved %d standing receive slots of %d bytes", len(slots), worker._startup_slot_bytes)


def release_slot(worker: Worker, alloc: Allocation, link: HeadLinks) -> None:
    """A job's inputs are copied out of `alloc`, or its stages that used them in place are done:
    free it (a standing slot stays, idle) and tell the head at once if it waits for room."""
    with worker._lock:
        is_standing = worker._standing.get(alloc.addr) is alloc
    if not is_standing:
        worker.pool.free(alloc)
        space_freed(worker, link)
