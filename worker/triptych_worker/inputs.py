"""Loading a job's incoming tensors out of its receive slot, ahead of the compute thread.

The receiver copies a request's inputs out of the slot the sender wrote (transfer flow step 6).
Done by the thread that computes, that copy sits between two requests; done here, by a loader
thread of its own (and on its own CUDA stream), it overlaps the request computing now, so the next
request's inputs are ready when the current one ends, and its slot is free for the next transfer
sooner. The loader takes jobs in arrival order and stays at most `ahead` jobs ahead of the compute
thread (--disagg-load-ahead; 0: the compute thread loads its own inputs). Only a job that waits
behind others is submitted here (runtime.py): one that computes at once is loaded by its computing
thread, since the loader could not be ahead of it and waking it would only add a thread hop to
the request's path. A job the compute thread wants before the loader reached it (a batch assembled
out of order) is loaded there at once; a cancelled job's inputs are dropped.

Where the stage allows (`in_place`: the pipeline reads its inputs without writing them, on the CPU),
there is no copy at all: the compute thread takes the job's inputs as views on its slot
(view_tensors), holds the slot in the pool (TransferPool.hold: a cancel or a head change frees it
only once released) and gives it back with release() when the job's stages are done and its outputs
staged. A continuation (a suspended request resuming) is copied all the same: the scheduler state it
restores may outlive the stage. Holding the slot for the whole stage means it takes the next
transfer only then; see docs/transfer.md "Inputs in place".
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from triptych_worker.resume import RESUME
from triptych_worker.transfer import TransferPool, load_tensors, view_tensors

if TYPE_CHECKING:
    from triptych_worker.heads import HeadLinks
    from triptych_worker.job_groups import Job
    from triptych_worker.transfer import Allocation

log = logging.getLogger(__name__)

PRUNE_S = 0.1  # how often a loader waiting for the compute thread looks for cancelled jobs to drop


class SlotGone(Exception):
    """The job's slot was freed (its request cancelled) before its inputs could be viewed."""


@dataclass
class Inputs:
    """A job's input tensors. `held`: the slot they are views on, held until release() (None: they
    are copies, and the slot was given back when they were made)."""

    tensors: dict[str, Any]
    held: Allocation | None = None


@dataclass
class _Load:
    """One job's inputs on their way out of its slot."""

    job: Job
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    tensors: Inputs | None = None
    error: BaseException | None = None


class InputLoader:
    """Copies queued jobs' inputs out of their slots on its own thread; see the module docstring.

    `release(alloc, link)`: called once a job's bytes are copied out (or given up), to give its slot
    back (a standing slot stays) and tell the head about the freed space through the calling thread's
    `link` (the loader's own from `make_link()`). `cancelled(request_id)`: whether the head cancelled
    it. `in_place`: inputs are views on their slot where the job allows (module docstring). All
    methods are thread-safe.
    """

    def __init__(
        self,
        pool: TransferPool,
        device: str | None,
        ahead: int,
        release: Callable[[Allocation, HeadLinks], None],
        cancelled: Callable[[str], bool],
        make_link: Callable[[], HeadLinks],
        in_place: bool = False,
    ) -> None:
        self.pool = pool
        self.in_place = in_place
        self.device = device
        self.ahead = ahead
        self._release = release
        self._cancelled = cancelled
        self._make_link = make_link
        self._cond = threading.Condition()
        self._pending: deque[_Load] = deque()  # submitted, not started, in arrival order
        self._loads: dict[str, _Load] = {}  # every submitted job not yet taken, by request id
        self._ready = 0  # loads done and not yet taken
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.ahead > 0:
            self._thread = threading.Thread(target=self._run, name="input-loader", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def submit(self, job: Job) -> None:
        """Queue `job`'s inputs for loading ahead (no-op without a loader thread or inputs, or for
        inputs used in place: views cost nothing to make)."""
        if self._thread is None or job.incoming is None or self.views(job):
            return
        with self._cond:
            load = _Load(job)
            self._loads[job.request_id] = load
            self._pending.append(load)
            self._cond.notify_all()

    def views(self, job: Job) -> bool:
        """Whether `job`'s inputs are used in place (views on its slot) rather than copied out."""
        return self.in_place and job.incoming is not None and RESUME not in job.incoming[2]

    def take(self, job: Job, link: HeadLinks) -> Inputs:
        """`job`'s input tensors: views on its slot, held until release(); or copies (the slot given
        back) loaded ahead, waited for, or loaded now (by the calling thread, which reports freed
        space through its `link`)."""
        assert job.incoming is not None, "only a job with incoming tensors has inputs to take"
        if self.views(job):
            return self._view(job, link)
        with self._cond:
            load = self._loads.get(job.request_id)
            if load is not None and load.job is not job:
                load = None  # a stale entry of an earlier attempt
            if load is not None:
                del self._loads[job.request_id]
                if not load.started:  # not reached yet: load it here, now
                    self._pending.remove(load)
                    load = None
                elif load.done.is_set():
                    self._ready -= 1
                    self._cond.notify_all()
        if load is None:
            return self._load(job, link, stream=None)
        load.done.wait()
        if load.error is not None:
            raise load.error
        assert load.tensors is not None
        return load.tensors

    def release(self, inputs: Inputs, link: HeadLinks) -> None:
        """The stages that used `inputs` are done (and their outputs staged): give a held slot back
        (a free that came meanwhile, a cancel, takes effect now). No-op for copies."""
        if inputs.held is not None:
            self.pool.unhold(inputs.held)
            self._release(inputs.held, link)

    def detach(self, inputs: Inputs, tensors: dict[str, Any], link: HeadLinks) -> dict[str, Any]:
        """`tensors` with every one that views `inputs`' held slot replaced by a copy, and the slot
        released: for outputs that must outlive it (their staging waits for the room it takes)."""
        out = dict(tensors)
        if inputs.held is not None:
            start, end = inputs.held.addr, inputs.held.addr + inputs.held.nbytes
            for name, tensor in tensors.items():
                if start <= _address(tensor) < end:
                    out[name] = tensor.copy() if isinstance(tensor, np.ndarray) else tensor.clone()
        self.release(inputs, link)
        return out

    def _view(self, job: Job, link: HeadLinks) -> Inputs:
        assert job.incoming is not None
        alloc, manifest, _meta = job.incoming
        if not self.pool.hold(alloc):
            raise SlotGone(f"request {job.request_id}: its receive slot was freed before its inputs were used")
        inputs = Inputs({}, held=alloc)
        try:
            inputs.tensors = view_tensors(self.pool, alloc, manifest, torch_tensors=self.device is not None)
        except BaseException:
            self.release(inputs, link)
            raise
        return inputs

    # --- the loader thread -------------------------------------------------------------------

    def _run(self) -> None:
        link = self._make_link()
        try:
            stream = self._make_stream()
            while True:
                load = self._next()
                if load is None:
                    return
                try:
                    load.tensors = self._load(load.job, link, stream)
                except BaseException as exc:  # the compute thread fails the request with it
                    load.error = exc
                with self._cond:
                    if self._loads.get(load.job.request_id) is load:
                        self._ready += 1
                    load.done.set()
                    self._cond.notify_all()
        except BaseException:
            log.exception("the input loader failed; inputs are loaded by the compute thread from now on")
            with self._cond:
                self._thread = None
                for load in self._pending:
                    self._loads.pop(load.job.request_id, None)
                self._pending.clear()
        finally:
            link.close()

    def _next(self) -> _Load | None:
        """The next job to load, once the loader is fewer than `ahead` loads ahead (None: stopped)."""
        with self._cond:
            while not self._stopped:
                self._drop_cancelled()
                if self._pending and self._ready < self.ahead:
                    load = self._pending.popleft()
                    load.started = True
                    return load
                self._cond.wait(PRUNE_S)
            return None

    def _drop_cancelled(self) -> None:
        """Forget cancelled jobs (caller holds the lock): a loaded one no longer counts as ahead,
        a pending one is never loaded (the cancel freed its slot)."""
        for request_id, load in list(self._loads.items()):
            if not self._cancelled(request_id):
                continue
            del self._loads[request_id]
            if not load.started:
                self._pending.remove(load)
            elif load.done.is_set():
                self._ready -= 1

    def _load(self, job: Job, link: HeadLinks, stream: Any) -> Inputs:
        """Copy the job's tensors out of its slot (on `stream`, a CUDA stream, or None: the calling
        thread's current stream), then give the slot back."""
        assert job.incoming is not None
        alloc, manifest, _meta = job.incoming
        try:
            if stream is None:
                return Inputs(load_tensors(self.pool, alloc, manifest, self.device))
            return Inputs(self._load_on_stream(alloc, manifest, stream))
        finally:
            self._release(alloc, link)

    def _make_stream(self) -> Any:
        """A CUDA stream of the loader's own, so its copies overlap the compute stream's kernels."""
        if self.device is None or not str(self.device).startswith("cuda"):
            return None
        import torch

        return torch.cuda.Stream(torch.device(self.device))

    def _load_on_stream(self, alloc: Allocation, manifest: list[Any], stream: Any) -> dict[str, Any]:
        import torch

        target = torch.device(self.device)  # type: ignore[arg-type]
        with torch.cuda.stream(stream):
            tensors = load_tensors(self.pool, alloc, manifest, target)  # synchronizes the loader's stream
        compute = torch.cuda.default_stream(target)
        for tensor in tensors.values():
            # Allocated on the loader's stream, used and freed on the compute stream: the caching
            # allocator must not hand its memory to the loader again before the compute stream is done.
            tensor.record_stream(compute)
        return tensors


def _address(tensor: Any) -> int:
    """Where a torch tensor's or numpy array's first element sits in memory."""
    return int(tensor.ctypes.data) if isinstance(tensor, np.ndarray) else int(tensor.data_ptr())
