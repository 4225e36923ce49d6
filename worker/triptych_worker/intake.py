"""What a worker takes on from a head: a first role's Work (refused when it is a duplicate, or when
this worker, serving several heads, has no scheduling slot for it), and any request the head hands
it again after cancelling it here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from triptych.protocol import Failed, Work, WorkRefused
from triptych_worker.heads import HeadLinks
from triptych_worker.job_groups import Job

if TYPE_CHECKING:
    from triptych_worker.runtime import Worker

STILL_STOPPING = "an earlier run of this request, cancelled here, is still stopping"


def take_work(worker: Worker, link: HeadLinks, items: Sequence[Work], head_id: str) -> None:
    """Queue a first role's work (a group of it runs as one batch), refusing each request this
    worker has no slot for when it serves several heads."""
    accepted: list[Work] = []
    for work in items:
        if not handed_again(worker, work.request_id):
            link.send(WorkRefused(work.request_id, worker.instance, STILL_STOPPING))
            continue
        if held := holds(worker, work.request_id):  # the same Work twice, or twice in one batch
            # A second run would overwrite the first one's staged outputs (never freed then).
            link.send(Failed(work.request_id, worker.instance, f"work for request {work.request_id}: {held}"))
            continue
        worker.heads.own(work.request_id, head_id)
        if worker._full():
            link.send(WorkRefused(work.request_id, worker.instance, "every scheduling slot is taken"))
            continue
        accepted.append(work)
        with worker._lock:
            worker._outstanding.add(work.request_id)  # counted at once: the next Work sees it
        worker._note_held()
    group = accepted[0].request_id if len(accepted) > 1 else ""
    worker._enqueue(*(
        Job(w.request_id, w.params, None, w.progress, w.preview_every, group, len(accepted) if group else 1,
            traceparent=w.traceparent, priority=w.priority)
        for w in accepted
    ))  # fmt: skip


def holds(worker: Worker, request_id: str) -> str:
    """What this worker already holds for `request_id` ("": nothing): a Work for it is a duplicate."""
    with worker._lock:
        if request_id in worker._outstanding:
            return "this worker already holds it (queued, running or with a receive slot)"
        if request_id in worker._staged:
            return "this worker already holds its staged outputs"
    if any(push.request_id == request_id for push in worker._pushes):  # leader only, as is every Work
        return "this worker is still pushing its outputs"
    return ""


def handed_again(worker: Worker, request_id: str) -> bool:
    """The head hands `request_id` to this worker: a cancel of it the head sent before is over (one
    head's messages arrive in order), as when the head gave up on this worker, cancelled the slot it
    answered late, and dispatched the same hop here again once the worker was back. False while a
    run of it from before that cancel is still queued or computing here (two runs would share one
    id): the caller refuses it, and the head tries again."""
    with worker._lock:
        if request_id not in worker._cancelled:
            return True
        if request_id in worker._computing_ids or any(job.request_id == request_id for job in worker._queue):
            return False
        del worker._cancelled[request_id]
        return True
