"""Running a worker's jobs (either thread): load inputs, run the role's stages, stage or return outputs.

A group of compatible jobs runs as one batched forward where the pipeline can; whatever goes wrong
fails only its own request (`_fails_alone`); a cancelled request stops at its next step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from triptych.contract import ParamError
from triptych.log_format import about
from triptych.lora import BadAdapter
from triptych.protocol import Failed, Progress, Result, TransferStaged, tensors_to_frames
from triptych.reference import BadReference
from triptych.tracing import Attributes
from triptych_worker import slots
from triptych_worker.heads import HeadLinks
from triptych_worker.inputs import Inputs, SlotGone
from triptych_worker.job_groups import Job
from triptych_worker.preview import should_preview
from triptych_worker.resume import RESUME, check_continuation
from triptych_worker.stages import PIXELS, StageBatch
from triptych_worker.transfer import InPlaceTensors, PayloadTooLarge, StagedTensors, stage_in_place, stage_tensors

if TYPE_CHECKING:
    from triptych_worker.runtime import Worker

log = logging.getLogger(__name__)

STAGING_RETRY_S = 0.01


class RequestCancelled(Exception):
    """Raised inside a running request the head cancelled, to stop its stages early."""


def compute(worker: Worker, link: HeadLinks, jobs: list[Job]) -> None:
    """Run a group of compatible jobs as one batch (a single job alone); a failure or a cancel
    fails only its own request, the others carry on."""
    started, started_ns = time.perf_counter(), time.time_ns()
    if len(jobs) > 1:
        log.info("running %d requests as one batch: %s", len(jobs), ", ".join(job.request_id for job in jobs))
    prepared: list[tuple[Job, StageBatch]] = []
    inputs: dict[str, Inputs] = {}  # the jobs' inputs; those in place hold their slots until released below
    settled_ids: set[str] = set()  # the jobs whose slot bookkeeping is done (each once: see _settle)
    try:
        for job in jobs:
            with _fails_alone(worker, link, job):
                if worker._is_cancelled(job.request_id):
                    worker.pool.free_owner(job.request_id)
                    continue
                prepared.append((job, _prepare(worker, link, job, inputs)))
        together = len(prepared) if _batches_forward(worker, len(prepared)) else 1
        # Reported together once all are staged, so that the head sees the batch arrive as one.
        reports: list[tuple[Result | TransferStaged, list[Any]]] = []
        traced: list[tuple[Job, float]] = []  # each job's stage seconds, for its span
        left: set[str] = set()  # the jobs that left their group at a step boundary, reported then

        def report_staged() -> bool:
            """The pool is full with members still to stage: those staged go to the head now, whose
            pushes make the room (held back, they would wait for that room themselves)."""
            if not reports:
                return False
            early = {msg.request_id for msg, _ in reports}
            _settle(worker, early)  # as below, before the head hears
            settled_ids.update(early)
            for msg, frames in reports:
                link.send(msg, frames)
            reports.clear()
            return True

        def leave(job: Job, batch: StageBatch) -> None:
            """`job` stopped at a step boundary (asked to hand off) while its group runs on: its state is
            staged and reported now, and its input slot freed, as a job alone's would be at its end."""
            left.add(job.request_id)
            batch.hand_off = lambda: (
                True
            )  # run again (its group's forward failed, each then runs alone): it stops at once
            with _fails_alone(worker, link, job):
                report = _deliver(worker, link, job, batch, started, together, False, inputs, report_staged)
                if (held := inputs.pop(job.request_id, None)) is not None:
                    worker.inputs.release(held, link)
                _settle(worker, {job.request_id})
                settled_ids.add(job.request_id)
                if report is not None:
                    link.send(*report)
                    traced.append((job, report[0].seconds))

        if together > 1:
            for job, batch in prepared:
                batch.leave = functools.partial(leave, job, batch)
        with about(jobs[0].request_id if len(jobs) == 1 else None):  # a batch's lines are no one request's
            outcomes, own_seconds = _run_stages(worker, [batch for _, batch in prepared])
        ran = [
            (job, batch)
            for (job, batch), error in zip(prepared, outcomes, strict=True)
            if error is None and job.request_id not in left
        ]

        for i, ((job, batch), error) in enumerate(zip(prepared, outcomes, strict=True)):
            if job.request_id in left:
                continue
            with _fails_alone(worker, link, job):
                if error is not None:
                    raise error
                leader = together == 1 or job is ran[0][0]
                # Run one at a time, a request's time is its own stages' (and its staging), not the group's.
                since = time.perf_counter() - own_seconds[i] if own_seconds and len(prepared) > 1 else started
                report = _deliver(worker, link, job, batch, since, together, leader, inputs, report_staged)
                if report is not None:
                    reports.append(report)
                    traced.append((job, report[0].seconds))
        # The stages are done and their outputs staged (copies): the input slots are free to take
        # the next transfers, before the head hears of it.
        _release_inputs(worker, link, inputs)
        rest = {job.request_id for job in jobs} - settled_ids
        _settle(worker, rest)  # before the head hears: work it sends next finds the slots free
        settled_ids.update(rest)
        for msg, frames in reports:
            link.send(msg, frames)
        if worker.tracing is not None:  # after the reports: off the request's path
            for job, seconds in traced:
                _trace_stages(worker, job, started_ns, seconds, together)
    finally:
        _release_inputs(worker, link, inputs)  # on a bug too: no slot stays held
        _settle(worker, {job.request_id for job in jobs} - settled_ids)


def _settle(worker: Worker, request_ids: set[str]) -> None:
    """These requests hold no scheduling slot any more and are asked no hand-off. Done once per job,
    before the head hears of its outputs, never after: what the head sends next (a suspended request
    resuming here, in place) is outstanding again, and stays so."""
    with worker._lock:
        worker._outstanding.difference_update(request_ids)
        worker._handing_off.difference_update(request_ids)


@contextlib.contextmanager
def _fails_alone(worker: Worker, link: HeadLinks, job: Job) -> Iterator[None]:
    """Whatever goes wrong inside fails `job`'s request only, with the status its cause calls for;
    every line logged inside names it (log_format.about)."""
    try:
        with about(job.request_id):
            yield
    except (RequestCancelled, SlotGone):
        worker.pool.free_owner(job.request_id)
        slots.space_freed(worker, link)
    except PayloadTooLarge as exc:
        worker.pool.free_owner(job.request_id)
        link.send(Failed(job.request_id, worker.instance, str(exc), status_code=413))
    except (BadReference, BadAdapter, ParamError) as exc:  # the client's reference image (a URL fetched),
        # LoRA adapter, or a parameter this model cannot serve
        worker.pool.free_owner(job.request_id)
        link.send(Failed(job.request_id, worker.instance, str(exc), status_code=400))
        slots.space_freed(worker, link)
    except Exception as exc:  # any stage error fails only this request
        log.exception("request %s failed", job.request_id, exc_info=exc)
        worker.pool.free_owner(job.request_id)
        link.send(Failed(job.request_id, worker.instance, f"{type(exc).__name__}: {exc}"))
        slots.space_freed(worker, link)


def _batches_forward(worker: Worker, n: int) -> bool:
    """Whether `n` requests run as one batched forward here (simulated stages run them one at a
    time; a multi-device worker's ranks batch, parallel/ranks.py)."""
    return n > 1 and hasattr(worker.pipeline, "run_many")


def _run_stages(worker: Worker, batches: list[StageBatch]) -> tuple[list[Exception | None], list[float]]:
    """This role's stages over the batches: one batched forward when the pipeline can. Per request,
    the exception it failed with or None; and, run one at a time (simulated stages), its own seconds."""
    if _batches_forward(worker, len(batches)):
        return list(worker.pipeline.run_many(batches)), []  # type: ignore[union-attr]
    outcomes: list[Exception | None] = []
    seconds: list[float] = []
    for batch in batches:
        started = time.perf_counter()
        try:
            worker.pipeline.run(batch)
        except Exception as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)
        seconds.append(time.perf_counter() - started)
    return outcomes, seconds


def _release_inputs(worker: Worker, link: HeadLinks, inputs: dict[str, Inputs]) -> None:
    """Give back the slots that inputs used in place hold (each once)."""
    while inputs:
        worker.inputs.release(inputs.popitem()[1], link)


def _prepare(worker: Worker, link: HeadLinks, job: Job, inputs: dict[str, Inputs]) -> StageBatch:
    """The job's StageBatch: its incoming tensors, views on its slot (held until the group's stages
    are done) or copies (its slot freed; usually loaded ahead, by the worker's input loader), added
    to `inputs`; and its progress reporting."""
    batch = StageBatch(params=job.params)
    held = False
    if job.incoming is not None:
        taken = worker.inputs.take(job, link)
        inputs[job.request_id] = taken
        batch.tensors = dict(taken.tensors)
        batch.meta = dict(job.incoming[2])
        held = taken.held is not None
        check_continuation(batch.meta)
    # The head checks parameters before it dispatches; a head that did not must not make this worker
    # allocate or compute for hours what its model cannot serve (every role, not only the first).
    validate = getattr(worker.pipeline, "validate", None)
    if validate is not None:
        validate(job.params)

    def progress(step: int, total: int, latents: Any = None) -> None:
        if worker._is_cancelled(job.request_id):
            raise RequestCancelled(job.request_id)
        if job.progress:
            preview = _preview(worker, job, step, latents)
            # inputs_held: the head must not give its standing slot to another transfer yet.
            link.send(Progress(job.request_id, worker.instance, step, total, preview, inputs_held=held))

    batch.on_progress = progress
    if worker.hands_off:
        batch.hand_off = lambda: worker.handing_off(job.request_id)
    return batch


def _trace_stages(worker: Worker, job: Job, started_ns: int, seconds: float, batch_size: int) -> None:
    """The span of the job's stages (as reported to the head) in the head's trace of the request."""
    if worker.tracing is None or not job.traceparent:  # the head does not trace this request
        return
    attributes: Attributes = {"triptych.request_id": job.request_id, "triptych.batch_size": batch_size}
    try:
        end_ns = started_ns + round(seconds * 1e9)
        worker.tracing.record(job.traceparent, worker.role.value, started_ns, end_ns, attributes)
    except Exception:  # tracing is an observer: it never fails a request
        log.exception("tracing request %s", job.request_id)


def _deliver(
    worker: Worker,
    link: HeadLinks,
    job: Job,
    batch: StageBatch,
    started: float,
    batch_size: int,
    leader: bool,
    inputs: dict[str, Inputs],
    pool_full: Callable[[], bool] = lambda: False,
) -> tuple[Result | TransferStaged, list[Any]] | None:
    """The job's outputs, ready to go on: pixels for the head (decoder), else staged for the next
    role; the report to send the head (None: cancelled meanwhile, nothing to report)."""
    if worker._is_cancelled(job.request_id):  # cancelled while its batch ran on: discarded
        raise RequestCancelled(job.request_id)
    if worker.returns_pixels:
        specs, frames = tensors_to_frames({PIXELS: batch.tensors[PIXELS]})
        seconds = time.perf_counter() - started
        return Result(job.request_id, worker.instance, specs, seconds, batch_size, leader), frames
    resume = batch.meta.get(RESUME)  # stopped at a step boundary: another denoiser continues it
    # Outputs go from their own memory where they can (in_place.py); a continuation always goes into
    # the pool, where it can also resume on this worker (TransferReady in_place uses it as the slot).
    staged: StagedTensors | InPlaceTensors | None = None
    if resume is None:
        staged = stage_in_place(worker.transport, batch.tensors, worker.pool.pool_bytes)
    if staged is None:
        staged = _stage(worker, link, job.request_id, batch, inputs, pool_full)
    if staged is None:
        return None  # cancelled while waiting for room
    if resume is not None and isinstance(staged, StagedTensors):
        staged = dataclasses.replace(staged, continuation=True)
    with worker._lock:
        cancelled = job.request_id in worker._cancelled
        if not cancelled:
            worker._staged[job.request_id] = staged
    if cancelled:
        worker.free_staged(staged)
        return None
    seconds = time.perf_counter() - started
    continues_at = None if resume is None else int(resume["step"])
    return TransferStaged(
        job.request_id, worker.instance, staged.nbytes, staged.manifest, batch.meta, seconds, batch_size, leader,
        continues_at,
    ), []  # fmt: skip


def _preview(worker: Worker, job: Job, step: int, latents: Any) -> bytes:
    """The step's preview PNG when the request asked for one now (b"" otherwise, or when it fails:
    a preview is never worth failing the request for)."""
    if worker.previewer is None or not should_preview(step, job.preview_every, latents):
        return b""
    try:
        return worker.previewer.png(latents, job.params)
    except Exception:
        log.exception("request %s: preview at step %d failed", job.request_id, step)
        return b""


def _stage(
    worker: Worker,
    link: HeadLinks,
    request_id: str,
    batch: StageBatch,
    inputs: dict[str, Inputs],
    pool_full: Callable[[], bool] = lambda: False,
) -> StagedTensors | None:
    """Copy outputs into the pool, waiting while it is full (back-pressure on this sender).

    A full pool while this job still holds its input slot (inputs in place) may be full of that
    very slot: the outputs that still view it are copied out and the slot is given back first, so
    a pool that held input and output one after the other never waits on itself. Nor on the outputs
    of its own batch: `pool_full` reports those staged so far (True if it did), so they can leave.
    """
    while True:
        staged = stage_tensors(worker.pool, batch.tensors, owner=request_id)
        if staged is not None:
            return staged
        held = inputs.get(request_id)
        if held is not None and held.held is not None:
            batch.tensors = worker.inputs.detach(inputs.pop(request_id), batch.tensors, link)
            continue
        if pool_full():
            continue
        if worker._is_cancelled(request_id) or worker._stop.is_set():
            return None
        time.sleep(STAGING_RETRY_S)
