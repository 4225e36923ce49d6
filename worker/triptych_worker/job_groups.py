"""A worker's queued jobs and which of them run together as one batch.

The queue is kept in decreasing priority level (as the head dispatched each job), oldest first
within a level. Without batching (--batching-max-size 1) the next job is the first one. With it, the oldest job
that is ready leads a group of up to --batching-max-size jobs: a group the head dispatched together
(same `group` id) once all its members have arrived, or once its oldest member has waited past the
assembly cut-off (a member cancelled or retried elsewhere never arrives); an untagged job with the
queued untagged jobs of the same compatibility key (triptych.batching.batch_key).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from triptych.batching import batch_key
from triptych.params import GenerationParams
from triptych_worker.resume import adapter_sources, step_of

if TYPE_CHECKING:
    from triptych_worker.transfer import Allocation


@dataclass
class Job:
    request_id: str
    params: GenerationParams
    incoming: tuple[Allocation, list[dict[str, Any]], dict[str, Any]] | None = None
    progress: bool = False  # send Progress for every step (the head has a watcher for it)
    preview_every: int = 0  # with progress: a preview PNG of the latents every k steps
    group: str = ""  # the batch the head dispatched it in ("" or group_size 1: none)
    group_size: int = 1
    traceparent: str = ""  # the head's trace of the request (triptych.tracing): its stages get a span there
    priority: int = 1  # its priority level as the head dispatched it: the queue runs higher levels first
    edit: bool = False  # an edit whose reference the head left out of `params` (TransferReady.edit)
    queued_at: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> tuple[Any, ...]:
        # Continuations batch only with continuations of the same step whose earlier steps used the same
        # adapter files (resume.py): a merged batch runs on with its first member's.
        step = None if self.incoming is None else step_of(self.incoming[2])
        files = None if self.incoming is None else _adapter_files(self.incoming[2])
        if self.edit:  # as batch_key keys an edit whose params still carry the reference: its own
            return (self.incoming is None, step, files, "edit", self.request_id)
        return (self.incoming is None, step, files, *batch_key(self.params, self.request_id))


def _adapter_files(meta: dict[str, Any]) -> tuple[tuple[str, str], ...] | str:
    """A continuation's adapter sources as a key ("malformed": refused when it runs, alone or not)."""
    sources = adapter_sources(meta)
    return "malformed" if sources is None else tuple(sorted(sources.items()))


def enqueue(queue: deque[Job], job: Job) -> None:
    """Queue `job` after every job of its priority level or higher, before the lower ones (so that a
    request the head suspended others for runs next on this worker)."""
    i = len(queue)
    while i > 0 and queue[i - 1].priority < job.priority:
        i -= 1
    queue.insert(i, job)


def resize_group(queue: deque[Job], group: str, size: int, owned: Callable[[Job], bool]) -> None:
    """The head lost members of `group` after a TransferReady counted them: its queued members (those
    `owned` by the head that says so) wait for `size` members at most (protocol BatchResized)."""
    for job in queue:
        if job.group == group and owned(job):
            job.group_size = min(job.group_size, size)


def take_group(queue: deque[Job], max_size: int, assembly_cutoff: float) -> list[Job]:
    """Remove and return the next group to run from `queue` ([] when none is ready yet).

    `assembly_cutoff`: a monotonic time; a tagged group whose oldest member arrived before it runs
    with the members it has.
    """
    if not queue:
        return []
    if max_size <= 1:
        return [queue.popleft()]
    for job in queue:
        if job.group and job.group_size > 1:
            # The key too: a member the head grouped wrongly runs apart rather than in a wrong batch.
            members = [j for j in queue if j.group == job.group and j.key == job.key]
            if len(members) < job.group_size and job.queued_at > assembly_cutoff:
                continue  # the rest of its group is on its way
        else:
            members = [j for j in queue if not (j.group and j.group_size > 1) and j.key == job.key]
        chosen = members[:max_size]
        for member in chosen:
            queue.remove(member)
        for rest in members[max_size:]:  # a group larger than this worker's batches: the rest wait for none
            rest.group_size -= len(chosen)
        return chosen
    return []
