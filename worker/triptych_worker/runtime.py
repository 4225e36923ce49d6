"""The worker process: one role's stages behind a ZMQ work socket and a Mooncake transfer pool.

Threads, each with one job and its own socket to the head:
- control (the caller of `serve`): receives head messages, answers pings and allocations;
- compute: runs the stages of one request at a time, stages outputs into the pool;
- transfer: pushes staged outputs to receivers through Mooncake.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from triptych.config import ServeArgs
from triptych.params import GenerationParams
from triptych.ports import result_endpoint, tcp_url
from triptych.protocol import (
    CancelWork,
    Failed,
    Heartbeat,
    Ping,
    Progress,
    ProtocolError,
    Result,
    TransferAlloc,
    TransferAllocated,
    TransferPush,
    TransferPushed,
    TransferReady,
    TransferRefused,
    TransferStaged,
    Work,
    decode,
    encode,
    tensors_to_frames,
)
from triptych.roles import Role
from triptych_worker.stages import PIXELS, StageBatch
from triptych_worker.transfer import (
    Allocation,
    MooncakeTransport,
    PayloadTooLarge,
    TransferError,
    TransferPool,
    TransferStalled,
    load_tensors,
    stage_tensors,
)

if TYPE_CHECKING:
    from triptych_worker.pipeline import RolePipeline

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
STAGING_RETRY_S = 0.01
CANCELLED_MEMORY = 10_000  # how many cancelled request ids are remembered


STANDING = "standing-slot"  # pool owner of preallocated receive slots


class RequestCancelled(Exception):
    """Raised inside a running request the head cancelled, to stop its stages early."""


@dataclass
class Job:
    request_id: str
    params: dict[str, Any]
    incoming: tuple[Allocation, list[dict[str, Any]], dict[str, Any]] | None = None
    progress: bool = False  # send Progress for every step (the head has a watcher for it)


class HeadLink:
    """A thread's own PUSH socket to the head's result port for this role."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(endpoint)

    def send(self, msg: Any, frames: Sequence[Any] = ()) -> None:
        self._sock.send_multipart(encode(msg, frames), copy=not frames)  # zero-copy only for pixel frames

    def close(self) -> None:
        self._sock.close()


class Worker:
    def __init__(self, args: ServeArgs, pipeline: RolePipeline | None = None):
        self.args = args
        self.role = args.disagg_role
        self.device = args.resolved_device
        if pipeline is None:
            from triptych_worker.pipeline import load_role_pipeline

            pipeline = load_role_pipeline(args.model_path, self.role, self.device)
        self.pipeline = pipeline
        self.transport = MooncakeTransport(args.disagg_p2p_hostname, args.disagg_ib_device)
        self.pool = TransferPool(args.disagg_transfer_pool_size, role=self.role.value, transport=self.transport)
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.ctx.setsockopt(zmq.IPV6, 1)  # pod IPs may be IPv6; IPv4 keeps working
        self.head_endpoint = result_endpoint(args.disagg_server_addr or "", self.role)
        self.work_endpoint = tcp_url(args.disagg_p2p_hostname, args.scheduler_port)
        self.instance = ""  # learned from the head's first message: the URL the head knows us by
        # SimpleQueue: the C queue wakes its consumer several times faster than queue.Queue,
        # and every request crosses these hand-offs.
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._pushes: queue.SimpleQueue[tuple[str, TransferPush] | None] = queue.SimpleQueue()
        self._staged: dict[str, Allocation] = {}  # outputs waiting for their transfer_push
        self._slots: dict[str, Allocation] = {}
        self._standing: dict[int, Allocation] = {}  # preallocated receive slots the head assigns by address
        self._head_id = ""  # the head whose slot bookkeeping the standing slots belong to
        self._outstanding: set[str] = set()  # accepted requests whose stages have not finished
        self._owes_heartbeat = False  # a refusal is pending: report freed pool space right away
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # --- control thread ---------------------------------------------------------------------

    def serve(self) -> None:
        work = self.ctx.socket(zmq.PULL)
        work.setsockopt(zmq.LINGER, 0)
        work.bind(self.work_endpoint)
        link = HeadLink(self.ctx, self.head_endpoint)
        threads = [
            threading.Thread(target=self._compute_loop, name="compute", daemon=True),
            threading.Thread(target=self._transfer_loop, name="transfer", daemon=True),
        ]
        for t in threads:
            t.start()
        log.info(
            "%s ready: work %s, results to %s, transfer session %s, pool %d bytes",
            self.role.value, self.work_endpoint, self.head_endpoint, self.transport.session_id, self.pool.pool_bytes,
        )  # fmt: skip
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                if work.poll(100):
                    for _ in range(1000):
                        try:
                            parts = work.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(link, [p.buffer for p in parts])
                if self.instance and time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
                    link.send(self._heartbeat())
        finally:
            self._jobs.put(None)
            self._pushes.put(None)
            for t in threads:
                t.join(timeout=5)
            work.close()
            link.close()
            self.transport.close()

    def stop(self) -> None:
        self._stop.set()

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            instance=self.instance,
            role=self.role.value,
            session=self.transport.session_id,
            pool_bytes=self.pool.pool_bytes,
            free_bytes=self.pool.free_bytes,
            capacity=self.args.worker_capacity,
            model=self.args.model_path,
            standing_bytes=self.pool.reserved_bytes(list(self._standing.values())),
        )

    def _on_message(self, link: HeadLink, parts: list[Any]) -> None:
        try:
            msg, _ = decode(parts)
        except ProtocolError as exc:
            log.warning("dropped undecodable message from the head: %s", exc)
            if exc.request_id:
                link.send(Failed(exc.request_id, self.instance, f"malformed message: {exc}"))
            return
        self.instance = msg.instance
        if isinstance(msg, Ping):
            self._follow_head(msg.head_id)
            link.send(self._heartbeat())
        elif isinstance(msg, Work):
            with self._lock:
                self._outstanding.add(msg.request_id)
            self._jobs.put(Job(msg.request_id, msg.params, progress=msg.progress))
        elif isinstance(msg, TransferAlloc):
            self._allocate(link, msg)
        elif isinstance(msg, TransferPush):
            self._pushes.put((msg.request_id, msg))
        elif isinstance(msg, TransferReady):
            self._ready(link, msg)
        elif isinstance(msg, CancelWork):
            self._cancel(msg.request_id)
            self._space_freed(link)
        else:
            log.warning("dropped %s: not a head-to-worker message", msg.TYPE)

    def _allocate(self, link: HeadLink, msg: TransferAlloc) -> None:
        if self._must_keep_room_for_outputs(msg.nbytes):
            self._refuse(link, msg.request_id, "keeping room to stage accepted work")
            return
        try:
            # A kept slot belongs to the worker, not the request: cancelling the request keeps it.
            alloc = self.pool.allocate(msg.nbytes, owner=STANDING if msg.keep else msg.request_id)
        except PayloadTooLarge as exc:
            link.send(TransferRefused(msg.request_id, self.instance, str(exc), fatal=True))
            return
        if alloc is None:
            self._refuse(link, msg.request_id, "transfer pool full")
            return
        with self._lock:
            self._slots[msg.request_id] = alloc
            self._outstanding.add(msg.request_id)
            if msg.keep:
                self._standing[alloc.addr] = alloc
        link.send(TransferAllocated(msg.request_id, self.instance, self.transport.session_id, alloc.addr, msg.keep))

    def _refuse(self, link: HeadLink, request_id: str, reason: str) -> None:
        """Back-pressure: no slot now; the head retries after the heartbeat that reports freed space."""
        with self._lock:
            self._owes_heartbeat = True
        link.send(TransferRefused(request_id, self.instance, reason, fatal=False))
        link.send(self._heartbeat())

    def _space_freed(self, link: HeadLink) -> None:
        """Tell the head at once that pool space came back, if it is waiting for that (after a refusal)."""
        with self._lock:
            owed, self._owes_heartbeat = self._owes_heartbeat, False
        if owed:
            link.send(self._heartbeat())

    def _follow_head(self, head_id: str) -> None:
        """A restarted head knows nothing of the slots the old one kept: give them back to the pool."""
        if head_id == self._head_id:
            return
        with self._lock:
            dropped, self._standing = list(self._standing.values()), {}
        for alloc in dropped:
            self.pool.free(alloc)
        if dropped:
            log.info("head %s replaced %s: dropped %d kept receive slots", head_id, self._head_id, len(dropped))
        self._head_id = head_id

    def _must_keep_room_for_outputs(self, nbytes: int) -> bool:
        """Refuse an input slot that would leave no room to stage the outputs of work already accepted.

        Otherwise a tight pool deadlocks: the running request cannot stage its output while the
        space it needs holds the input of the request queued behind it. Outputs are assumed no
        larger than inputs (latents in, latents out); the decoder's outputs bypass the pool.
        """
        if self.role is Role.DECODER or nbytes > self.pool.pool_bytes:
            return False  # too large ever is reported by allocate() as fatal
        with self._lock:
            busy = bool(self._outstanding)
        return busy and self.pool.free_bytes - nbytes < nbytes

    def _ready(self, link: HeadLink, msg: TransferReady) -> None:
        with self._lock:
            alloc = self._slots.pop(msg.request_id, None)
            if msg.slot_addr:
                alloc = self._standing.get(msg.slot_addr)
                self._outstanding.add(msg.request_id)
        if alloc is None:
            link.send(Failed(msg.request_id, self.instance, "transfer_ready for a slot this worker does not hold"))
            return
        self._jobs.put(Job(msg.request_id, msg.params, (alloc, msg.manifest, msg.meta), msg.progress))

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled[request_id] = None
            while len(self._cancelled) > CANCELLED_MEMORY:
                self._cancelled.popitem(last=False)
            self._staged.pop(request_id, None)
            self._slots.pop(request_id, None)
            self._outstanding.discard(request_id)
        self.pool.free_owner(request_id)

    def _is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled

    # --- compute thread ---------------------------------------------------------------------

    def _compute_loop(self) -> None:
        link = HeadLink(self.ctx, self.head_endpoint)
        try:
            while (job := self._jobs.get()) is not None:
                if self._is_cancelled(job.request_id):
                    self.pool.free_owner(job.request_id)
                    with self._lock:
                        self._outstanding.discard(job.request_id)
                    continue
                try:
                    self._run_job(link, job)
                except RequestCancelled:
                    self.pool.free_owner(job.request_id)
                    self._space_freed(link)
                except PayloadTooLarge as exc:
                    self.pool.free_owner(job.request_id)
                    link.send(Failed(job.request_id, self.instance, str(exc), status_code=413))
                except Exception as exc:  # any stage error fails only this request
                    log.exception("request %s failed", job.request_id)
                    self.pool.free_owner(job.request_id)
                    link.send(Failed(job.request_id, self.instance, f"{type(exc).__name__}: {exc}"))
                    self._space_freed(link)
                finally:
                    with self._lock:
                        self._outstanding.discard(job.request_id)
        finally:
            link.close()

    def _run_job(self, link: HeadLink, job: Job) -> None:
        started = time.perf_counter()
        params = GenerationParams.from_wire(job.params)
        batch = StageBatch(params=params)
        if job.incoming is not None:
            alloc, manifest, meta = job.incoming
            batch.tensors = load_tensors(self.pool, alloc, manifest, self.device)
            batch.meta = dict(meta)
            with self._lock:
                standing = self._standing.get(alloc.addr) is alloc
            if not standing:  # the slot is free as soon as its bytes are copied out
                self.pool.free(alloc)
                self._space_freed(link)

        def progress(step: int, total: int) -> None:
            if self._is_cancelled(job.request_id):
                raise RequestCancelled(job.request_id)
            if job.progress:
                link.send(Progress(job.request_id, self.instance, step, total))

        batch.on_progress = progress
        self.pipeline.run(batch)
        if self.role is Role.DECODER:
            specs, frames = tensors_to_frames({PIXELS: batch.tensors[PIXELS]})
            link.send(Result(job.request_id, self.instance, specs, time.perf_counter() - started), frames)
            return
        staged = self._stage(job.request_id, batch)
        if staged is None:
            return  # cancelled while waiting for room
        allocation, manifest = staged
        with self._lock:
            if job.request_id in self._cancelled:
                self.pool.free(allocation)
                return
            self._staged[job.request_id] = allocation
        link.send(
            TransferStaged(
                job.request_id, self.instance, allocation.nbytes, manifest, batch.meta, time.perf_counter() - started
            )
        )

    def _stage(self, request_id: str, batch: StageBatch) -> tuple[Allocation, list[dict[str, Any]]] | None:
        """Copy outputs into the pool, waiting while it is full (back-pressure on this sender)."""
        while True:
            staged = stage_tensors(self.pool, batch.tensors, owner=request_id)
            if staged is not None:
                return staged.allocation, staged.manifest
            if self._is_cancelled(request_id) or self._stop.is_set():
                return None
            time.sleep(STAGING_RETRY_S)

    # --- transfer thread --------------------------------------------------------------------

    def _transfer_loop(self) -> None:
        link = HeadLink(self.ctx, self.head_endpoint)
        try:
            while (item := self._pushes.get()) is not None:
                request_id, push = item
                with self._lock:
                    staged = self._staged.pop(request_id, None)
                if staged is None:
                    link.send(Failed(request_id, self.instance, "transfer_push for a request with nothing staged"))
                    continue
                started = time.perf_counter()
                try:
                    self.transport.write(push.dest_session, staged.addr, push.dest_addr, staged.nbytes)
                except TransferError as exc:
                    # A stalled write may still land: the head then keeps the receiver's slot out of use.
                    stalled = isinstance(exc, TransferStalled)
                    link.send(Failed(request_id, self.instance, str(exc), write_pending=stalled))
                except Exception as exc:  # a bug fails this request, never the transfer thread
                    log.exception("request %s: push failed", request_id)
                    link.send(Failed(request_id, self.instance, f"{type(exc).__name__}: {exc}"))
                else:
                    link.send(TransferPushed(request_id, self.instance, staged.nbytes, time.perf_counter() - started))
                self.pool.free(staged)
                self._space_freed(link)
        finally:
            link.close()


def run_worker(args: ServeArgs) -> int:
    worker = Worker(args)
    try:
        worker.serve()
    except KeyboardInterrupt:
        pass
    return 0
