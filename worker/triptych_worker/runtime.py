"""The worker process: one role's stages behind a ZMQ work socket and a Mooncake transfer pool
(a full-pipeline worker, --disagg-full-pipeline: every stage, pixels back to the head, no Mooncake).

Two threads share the work as leader and follower. The leader owns the work socket and the
Mooncake writes under way: it receives head messages, answers pings and allocations, starts
pushes and reports each one when its write completes. When work arrives and nothing is
computing, the leader runs it itself and hands the lead to the other thread, so no request waits
on its path for another thread to wake up; work that arrives while a job runs is queued, and
the computing thread runs it next. Whichever thread leads, all of this state is the worker's.

Batching (--batching-max-size N > 1): the computing thread takes up to N compatible queued jobs
(triptych.batching) and runs them as one batched forward per stage (triptych_worker.batching); a
group the head dispatched together (WorkBatch, or TransferReady tagged with a batch id) waits up to
BATCH_ASSEMBLY_S for all its members. Each request still loads, stages and reports its own tensors.

Where the rest lives: the heads it serves and the links to them (heads.py), the receive slots
inputs arrive in (slots.py), running jobs (compute.py), the Mooncake writes under way (pushes.py),
and the drain on SIGTERM (drain.py).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

import zmq

from triptych import startup
from triptych.config import ConfigError, ServeArgs, bind_error
from triptych.families.package import package_fingerprint
from triptych.flag_roles import LORA_WORKERS
from triptych.liveness import HEARTBEAT_INTERVAL_S
from triptych.lora import LoraCatalog
from triptych.ports import tcp_url
from triptych.protocol import (
    HEAD_TO_WORKER,
    BatchResized,
    CancelWork,
    Failed,
    HandOff,
    Heartbeat,
    Ping,
    ProtocolError,
    TransferAlloc,
    TransferPush,
    TransferReady,
    UnknownMessageType,
    Work,
    WorkBatch,
    decode,
)
from triptych.protocol.codec import MAX_HEADER_BYTES
from triptych.roles import Role
from triptych.security import ControlPlane, control_plane
from triptych.sockets import has_queued_message, recv_message, wait_for_message
from triptych.tracing import start_tracing, traces_url
from triptych_worker import compute, drain, heartbeat, intake, pushes, slots, standing
from triptych_worker.drain import Drain
from triptych_worker.heads import HeadBook, HeadLinks
from triptych_worker.inputs import InputLoader
from triptych_worker.job_groups import Job, enqueue, resize_group, take_group
from triptych_worker.preview import LatentPreviewer
from triptych_worker.pushes import Push
from triptych_worker.simulated import SimulatedPipeline
from triptych_worker.transfer import (
    ALIGNMENT,
    Allocation,
    InPlaceTensors,
    MooncakeTransport,
    NoTransport,
    StagedTensors,
    TransferPool,
    check_rdma_device,
    precise_sleeps,
)
from triptych_worker.transfer.listeners import check_local_address, check_mooncake_listeners, confine_mooncake_listeners
from triptych_worker.transfer.start import start_transfer

if TYPE_CHECKING:
    from triptych_worker.parallel.full import FullPipelineRanks
    from triptych_worker.parallel.ranks import ParallelPipeline
    from triptych_worker.pipeline import RolePipeline

    Stages = RolePipeline | SimulatedPipeline | ParallelPipeline | FullPipelineRanks  # what a worker runs

log = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # how long the leader waits for a message when no write is under way
DRAIN_LIMIT = 1000  # messages handled per wake-up before the leader looks at its writes again
THREADS = 2  # one leads while the other computes
CANCELLED_MEMORY = 10_000  # how many cancelled request ids are remembered
# The largest frame a peer may send to the work port: the head sends headers only (codec.MAX_HEADER_BYTES).
WORK_FRAME_BYTES = MAX_HEADER_BYTES + (1 << 16)


BATCH_ASSEMBLY_S = 0.5  # how long a group the head dispatched together waits for its last members


class Worker:
    def __init__(self, args: ServeArgs, pipeline: Stages | None = None):
        self.args = args
        self.role = args.disagg_role
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.ctx.setsockopt(zmq.IPV6, 1)  # pod IPs may be IPv6; IPv4 keeps working
        # Before the model loads: unreadable keys fail in a second, not after minutes.
        self.security: ControlPlane = control_plane(args, self.ctx, "worker")
        if not args.disagg_full_pipeline:
            check_rdma_device(args.disagg_ib_device)  # a NIC this host lacks: Mooncake would use TCP silently
            check_local_address(args.disagg_p2p_hostname)  # Mooncake's engine starts only after the model loads
        # Before the model loads too: an adapter path without weights (--lora, --lora-catalog) refuses the
        # start, rather than fail every request naming it. The head checks names only; a decoder loads none.
        lora_catalog = LoraCatalog.from_flags(args.lora, args.lora_catalog)
        if self.role in LORA_WORKERS and (problem := lora_catalog.check_sources(self.role.value)) is not None:
            raise ConfigError(problem)
        if pipeline is None and args.simulate:
            pipeline = SimulatedPipeline.from_args(args)
        simulated = isinstance(pipeline, SimulatedPipeline)
        # Simulated stages hold numpy arrays, so the worker never imports torch (None: numpy inputs).
        self.device: str | None = None if simulated else args.resolved_device
        # What its model computes in (--dtype), as its heartbeats say; "" when it loads no model.
        self.dtype = "" if self.device is None else args.compute_dtype(self.device)
        if pipeline is None and args.num_gpus > 1 and args.disagg_full_pipeline:
            from triptych_worker.parallel.full import start_full_pipeline_ranks

            # Encode and decode on rank 0, denoise on every rank; rank 0 resolves adapters with the checked catalogue.
            pipeline = start_full_pipeline_ranks(args, lora_catalog)
        elif pipeline is None and args.num_gpus > 1:
            from triptych_worker.parallel.ranks import start_ranks

            # Rank 0 of N; the other ranks follow it (one instance to the head) and load the adapters it names.
            pipeline = start_ranks(args, lora_catalog)
        if pipeline is None:
            from triptych_worker.cpu_threads import fit_torch_threads
            from triptych_worker.pipeline import load_role_pipeline

            fit_torch_threads()  # before the model loads: torch's CPU threads within the pod's CPU limit
            pipeline = load_role_pipeline(
                args.model_path,
                args.stage_role,
                args.resolved_device,
                encoder_cache_bytes=args.encoder_cache_bytes,
                lora_catalog=lora_catalog,
                lora_cache_bytes=args.lora_cache_bytes,
                dtype=self.dtype,
            )
            log.info("%s: %s", self.role.value, pipeline.describe())
        self.pipeline = pipeline
        startup.mark("loaded")
        self.model_fingerprint = package_fingerprint(args.model_path)  # the head compares it with its own
        # None without --otlp-endpoint: no span is recorded and the OpenTelemetry SDK is never imported.
        self.tracing = start_tracing(traces_url(args.otlp_endpoint), f"triptych-{self.role.value}")
        make_previewer = getattr(pipeline, "previewer", None)  # only real stages hold latents to preview
        self.previewer: LatentPreviewer | None = make_previewer() if make_previewer is not None else None
        # A full-pipeline worker (--disagg-full-pipeline) runs every stage and returns pixels, like a
        # decoder: no tensor moves to or from another worker, so it starts no Mooncake engine and keeps
        # only a token pool (nothing is ever staged in it or allocated from it).
        self.full_pipeline = args.disagg_full_pipeline
        self.returns_pixels = self.role is Role.DECODER or self.full_pipeline
        self.transport: MooncakeTransport | NoTransport
        if self.full_pipeline:
            self.transport = NoTransport()
            self.pool = TransferPool(ALIGNMENT, role=self.role.value, memory="numpy")
        else:
            self.transport, self.pool = start_transfer(args, "numpy" if simulated else "torch")
            startup.mark("transfer")
        # The heads it serves (--disagg-server-addr: one address, or several / dns:// / file:// for
        # replicated heads) and whose request is whose (heads.py).
        self.heads = HeadBook(args.disagg_server_addr or "", self.role, args.disagg_discovery_interval, time.monotonic)
        self.work_endpoint = tcp_url(args.disagg_p2p_hostname, args.scheduler_port)
        self.instance = ""  # learned from the heads' messages: the URL a head knows us by
        self._leading = threading.Lock()  # held by the leader; the work socket and self._pushes are its
        self._work: zmq.Socket[Any] | None = None
        self._pushes: list[Push] = []  # writes under way (leader only)
        self._next_beat = 0.0
        self._queue: deque[Job] = deque()  # accepted work waiting for the computing thread
        self._computing = False  # a thread is running a job
        self._computing_ids: set[str] = set()  # the requests of the group it runs
        self._crashed: BaseException | None = None
        self._staged: dict[str, StagedTensors | InPlaceTensors] = {}  # outputs waiting for their transfer_push
        self._unfinished_sends: list[InPlaceTensors] = []  # outputs a failed write may still read (pushes.py)
        self._slots: dict[str, Allocation] = {}
        self._standing: dict[int, Allocation] = {}  # standing receive slots the head assigns by address
        self._outstanding: set[str] = set()  # accepted requests whose stages have not finished
        self._owes_heartbeat = False  # a refusal is pending: report freed pool space right away
        self._peak_held = 0  # the most requests held at once (heartbeats report it)
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        # Requests the head asked to hand over to another denoiser at their next step boundary (HandOff).
        self._handing_off: set[str] = set()
        # Only a denoiser that hands on latents can stop between steps and continue elsewhere (resume.py).
        self.hands_off = not self.full_pipeline and bool(getattr(pipeline, "hands_off", False))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._drain_requested = threading.Event()  # set by the SIGTERM handler; the leader starts the drain
        self._drain: Drain | None = None  # leader only
        self._started = time.monotonic()
        # Standing receive slots reserved now, before the first request, for the one head (standing.py).
        self._startup_slot_bytes = 0
        if not self.full_pipeline and self.heads.single:
            self._startup_slot_bytes = standing.slot_size(pipeline, args.model_path, self.role, self.dtype or "float32")
        slots.reserve_standing(self)
        # Copies queued jobs' inputs out of their receive slots while a job computes (inputs.py).
        self.inputs = InputLoader(
            self.pool,
            self.device,
            ahead=args.disagg_load_ahead * args.batching_max_size,
            release=lambda alloc, link: slots.release_slot(self, alloc, link),
            cancelled=self._is_cancelled,
            make_link=lambda: HeadLinks(self.ctx, self.heads, self.security),
            in_place=self._inputs_in_place(),
        )

    def _inputs_in_place(self) -> bool:
        """Inputs as views on their receive slot (no copy) where the stages allow: a pipeline that
        never writes its inputs, on the CPU (a GPU copies them to the device as before)."""
        on_cpu = self.device is None or self.device.split(":")[0] == "cpu"
        return on_cpu and bool(getattr(self.pipeline, "reads_inputs_in_place", False))

    # --- threads ---------------------------------------------------------------------------

    def serve(self) -> None:
        """Serve until stop() (or Ctrl-C); raises if a worker thread died of a bug."""
        self._work = self.ctx.socket(zmq.PULL)
        self._work.setsockopt(zmq.LINGER, 0)
        # With keys only the head's key may connect and send; any peer's frame is at most a header.
        self.security.server(self._work, max_message_bytes=WORK_FRAME_BYTES)
        self._work.setsockopt(zmq.RCVTIMEO, IDLE_POLL_MS)  # a blocking receive returns to look at stop and heartbeats
        try:
            self._work.bind(self.work_endpoint)
        except zmq.ZMQError as exc:
            self._work.close()
            raise bind_error(
                exc,
                self.work_endpoint,
                ("--disagg-p2p-hostname", self.args.disagg_p2p_hostname),
                ("--scheduler-port", self.args.scheduler_port),
                "this worker's work port; is another process using it?",
            ) from None
        threads = [threading.Thread(target=self._thread_main, name=f"worker-{i}", daemon=True) for i in range(THREADS)]
        for t in threads:
            t.start()
        self.inputs.start()
        startup.mark("listening")
        log.info(
            "%s ready: work %s, results to %s, %s, control plane %s",
            self.role.value, self.work_endpoint, ", ".join(self.heads.endpoints()) or "(no head found yet)",
            "full pipeline (no transfers, no Mooncake)" if self.full_pipeline else
            f"transfer session {self.transport.session_id}, pool {self.pool.pool_bytes} bytes",
            "authenticated (CURVE)" if self.security.authenticated else "UNAUTHENTICATED",
        )  # fmt: skip
        try:
            while not self._stop.wait(0.5):  # the threads do the work; this one waits for stop or a signal
                pass
        finally:
            self._stop.set()
            for t in threads:
                t.join(timeout=5)
            self.inputs.stop()
            self._work.close()
            self.heads.close()
            self.transport.close()
            self.security.close()
        if self._crashed is not None:
            raise RuntimeError("a worker thread failed; see the log above") from self._crashed

    def _thread_main(self) -> None:
        link = HeadLinks(self.ctx, self.heads, self.security)
        try:
            while not self._stop.is_set():
                with self._leading:
                    jobs = self._lead(link)
                while jobs:  # the other thread leads meanwhile
                    compute.compute(self, link, jobs)
                    jobs = self._next_jobs()
        except BaseException as exc:  # a bug: stop the worker so that it is restarted, not left half-working
            log.exception("worker thread failed; stopping")
            self._crashed = exc
            self._stop.set()
        finally:
            link.close()

    def _lead(self, link: HeadLinks) -> list[Job]:
        """Serve the work socket and the writes under way until there are jobs for this thread."""
        work = self._work
        assert work is not None, "serve() binds the work socket"
        while not self._stop.is_set():
            if jobs := self._take_jobs():
                return jobs
            received = 0
            while received < DRAIN_LIMIT and (parts := self._receive(work)) is not None:
                received += 1
                self._on_message(link, parts)
                if self._queue and not self._computing:  # a hint; _take_job decides under the lock
                    break  # run it now; the messages behind it are the next leader's
                if not has_queued_message(work):
                    break
            pushes.check_pushes(self, link)
            if self._pushes and not received:
                # Sleep until the youngest write's next poll (it is polled most often; at once in its
                # first 50 us), or until a head message arrives: the transport's threads get the core.
                wait_for_message(work, min(p.write.poll_interval() for p in self._pushes))
            if self._drain_requested.is_set() and self._drain is None:
                drain.start_drain(self)
            if self.instance and time.monotonic() >= self._next_beat:
                self._next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
                link.broadcast(self._heartbeat)
                if not self.heads.single:  # a head silent this long is gone: release what it held here
                    for head in self.heads.silent_heads(self.args.disagg_heartbeat_timeout):
                        self._release_head(head, f"head {head} stopped pinging")
            if self._drain is not None and drain.drain_over(self, time.monotonic()):
                self._stop.set()
        return []

    def _receive(self, work: zmq.Socket[Any]) -> list[Any] | None:
        """The next head message, waiting up to IDLE_POLL_MS for one unless writes are under way
        (then only one already queued: the leader asks at every poll of its writes, and asking
        costs less than the zmq.Again an empty non-blocking receive raises)."""
        if self._pushes and not has_queued_message(work):
            return None
        try:
            return recv_message(work, zmq.NOBLOCK if self._pushes else 0)
        except zmq.Again:
            return None

    def _take_jobs(self) -> list[Job]:
        """The next group of queued jobs (one job without batching), claimed for this thread, if no
        thread is computing."""
        with self._lock:
            if self._computing:
                return []
            jobs = self._group()
            self._computing, self._computing_ids = bool(jobs), {job.request_id for job in jobs}
            return jobs

    def _next_jobs(self) -> list[Job]:
        """After a group: the next one for the same thread, or [] when none is ready to compute."""
        with self._lock:
            jobs = self._group()
            self._computing, self._computing_ids = bool(jobs), {job.request_id for job in jobs}
            return jobs

    def _group(self) -> list[Job]:
        """Take the next ready group out of the queue (caller holds the lock)."""
        return take_group(self._queue, self.args.batching_max_size, time.monotonic() - BATCH_ASSEMBLY_S)

    def _enqueue(self, *jobs: Job) -> None:
        with self._lock:
            for job in jobs:
                self._outstanding.add(job.request_id)
                enqueue(self._queue, job)

    def stop(self) -> None:
        self._stop.set()

    # --- drain (leader) ---------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Finish what is held, take what the head still sends, then stop (safe from a signal handler)."""
        self._drain_requested.set()

    @property
    def draining(self) -> bool:
        return self._drain_requested.is_set()

    # --- head messages (leader) -------------------------------------------------------------

    def _heartbeat(self, endpoint: str = "", head_id: str = "") -> Heartbeat:
        """This worker's state for the head at `endpoint` (`head_id` there, "" when not known yet)."""
        return heartbeat.state(self, endpoint, head_id)

    def _held_requests(self) -> set[str]:
        """The requests holding one of this worker's scheduling slots (the head's view of its load). A
        suspended request's state kept here holds none: nothing computes it, and the head gave its
        slot to the request it made room for (StagedTensors.continuation)."""
        with self._lock:
            staged = {rid for rid, out in self._staged.items() if not getattr(out, "continuation", False)}
            held = self._outstanding | staged | set(self._slots)
        return held | {push.request_id for push in self._pushes}

    def _note_held(self) -> None:
        """Keep the peak of held requests (heartbeats report it: the capacity check, seen from here)."""
        self._peak_held = max(self._peak_held, len(self._held_requests()))

    def _full(self) -> bool:
        """A worker serving several heads refuses work beyond its capacity: it, not any one head, knows it."""
        capacity = self.args.worker_capacity * self.args.batching_max_size
        return not self.heads.single and len(self._held_requests()) >= capacity

    def _on_message(self, link: HeadLinks, parts: list[Any]) -> None:
        try:
            msg, _ = decode(parts)
        except ProtocolError as exc:
            log.warning("dropped undecodable message from the head: %s", exc)
            if exc.request_id and not isinstance(exc, UnknownMessageType):
                link.send(Failed(exc.request_id, self.instance, f"malformed message: {exc}"))
            return
        if not isinstance(msg, HEAD_TO_WORKER):
            log.warning("dropped %s: not a head-to-worker message", msg.TYPE)
            return
        self.instance = msg.instance
        try:
            self._handle(link, msg)
        except Exception as exc:  # a message this worker cannot act on fails its request, never the worker
            log.exception("handling %s failed", msg.TYPE)
            if request_id := getattr(msg, "request_id", None):
                link.send(Failed(request_id, self.instance, f"{msg.TYPE} could not be handled: {exc}"))

    def _handle(self, link: HeadLinks, msg: Any) -> None:
        if isinstance(msg, Ping):
            self._on_ping(link, msg)
            return
        if isinstance(msg, BatchResized):  # about a group, not one request: its members are filtered by owner
            self._resize_group(msg)
            return
        if self._foreign(msg):
            log.warning("dropped %s for %s: another head owns that request here", msg.TYPE, msg.request_id)
            return
        if isinstance(msg, Work):
            intake.take_work(self, link, [msg], msg.head_id)
        elif isinstance(msg, WorkBatch) and msg.items:
            intake.take_work(self, link, msg.items, msg.head_id)
        elif isinstance(msg, TransferAlloc):
            if intake.handed_again(self, msg.request_id):
                slots.allocate(self, link, msg)
            else:
                slots.refuse(self, link, msg.request_id, intake.STILL_STOPPING)
        elif isinstance(msg, TransferPush):
            pushes.start_push(self, link, msg)
        elif isinstance(msg, TransferReady):
            if intake.handed_again(self, msg.request_id):
                slots.ready(self, link, msg)
            else:
                link.send(Failed(msg.request_id, self.instance, f"transfer_ready for {intake.STILL_STOPPING}"))
        elif isinstance(msg, CancelWork):
            self._cancel(msg.request_id)
            slots.space_freed(self, link)
        elif isinstance(msg, HandOff):
            self._hand_off(msg.request_id)

    def _on_ping(self, link: HeadLinks, msg: Ping) -> None:
        replaced = self.heads.on_ping(msg.head_id, msg.via, msg.instance)
        if replaced is not None:
            # A new head knows nothing of what this worker holds for the one it replaced: release it
            # and tell the new head which requests were dropped (the first head inherits nothing).
            endpoint = self.heads.endpoint_of(msg.head_id)
            for request_id in self._release_head(replaced, f"head {msg.head_id} replaced {replaced}"):
                reason = f"dropped: head {msg.head_id} replaced the head it came from"
                link.send_to(endpoint, Failed(request_id, msg.instance, reason))
        if msg.drain_acknowledged and self.draining:
            drain.acknowledge_drain(self, msg.head_id)
        if self._drain is not None:  # acknowledged by every live head (a new one has not seen the drain)
            self._drain.acknowledged = self.heads.all_acknowledged(self.args.disagg_heartbeat_timeout)
        endpoint = self.heads.endpoint_of(msg.head_id)
        if endpoint is None:
            link.broadcast(self._heartbeat)  # which endpoint is this head's: its next ping says (via)
        else:
            link.send_to(endpoint, self._heartbeat(endpoint, msg.head_id))
        startup.done("registered")  # the first heartbeat: a head can dispatch to this worker from now on

    def _resize_group(self, msg: BatchResized) -> None:
        def owned(job: Job) -> bool:
            return self.heads.single or self.heads.owner(job.request_id) == msg.head_id

        with self._lock:
            resize_group(self._queue, msg.batch_id, msg.batch_size, owned)

    def _foreign(self, msg: Any) -> bool:
        """A message about a request another head owns here (a worker serving several heads)."""
        if self.heads.single or isinstance(msg, (Work, WorkBatch)):
            return False
        owner = self.heads.owner(msg.request_id)
        return bool(owner) and owner != msg.head_id

    def _release_head(self, head_id: str, why: str) -> list[str]:
        """Give back to the pool everything held for `head_id` (a head that was replaced or went
        silent): its standing slots (a worker serving one head), reserved slots, staged outputs and
        queued work; running work stops at its next step. Returns the requests dropped."""
        single = self.heads.single
        theirs = set() if single else self.heads.requests_of(head_id)  # before the worker's lock: never nested
        with self._lock:
            held = self._outstanding | set(self._staged) | set(self._slots)
            mine = held if single else held & theirs
            dropped_slots = list(self._standing.values()) if single else []
            if single:
                self._standing = {}
            self._queue = deque(job for job in self._queue if job.request_id not in mine)
        writing = {push.request_id for push in self._pushes}  # their staged bytes come back when the write ends
        for alloc in dropped_slots:
            self.pool.free(alloc)
        for request_id in mine:
            self._cancel(request_id, free=request_id not in writing)
        if single:
            slots.reserve_standing(self)  # the new head's, reported in the heartbeat that answers its ping
        if dropped_slots or mine:
            log.info("%s: dropped %d standing receive slots and %d requests", why, len(dropped_slots), len(mine))
        return sorted(mine)

    def _cancel(self, request_id: str, free: bool = True) -> None:
        with self._lock:
            self._cancelled[request_id] = None
            while len(self._cancelled) > CANCELLED_MEMORY:
                self._cancelled.popitem(last=False)
            staged = self._staged.pop(request_id, None)
            self._slots.pop(request_id, None)
            self._outstanding.discard(request_id)
            self._handing_off.discard(request_id)  # a queued one never reaches compute's _settle
        if staged is not None:
            self.free_staged(staged)
        if free:
            self.pool.free_owner(request_id)

    def free_staged(self, staged: StagedTensors | InPlaceTensors) -> None:
        """Give back what staged outputs hold: their pool bytes, or their tensors' registration."""
        if isinstance(staged, InPlaceTensors):
            staged.release()
        else:
            self.pool.free(staged.allocation)

    def _hand_off(self, request_id: str) -> None:
        """The head asks for the request's state at its next step boundary (docs/design.md "Migration");
        a worker that cannot stop between steps finishes it as if never asked."""
        with self._lock:
            if self.hands_off and request_id in self._outstanding:
                self._handing_off.add(request_id)

    def handing_off(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._handing_off

    def _is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled


def run_worker(args: ServeArgs, pipeline: Stages | None = None) -> int:
    """Serve until drained (SIGTERM, exit 0), interrupted (Ctrl-C) or stopped; the worker entry point.

    First re-executes the process under the bind shim unless it runs under it already, so that
    Mooncake listens on --disagg-p2p-hostname only (triptych_worker.transfer.listeners).
    """
    if not args.disagg_full_pipeline:  # a full-pipeline worker starts no Mooncake engine
        confine_mooncake_listeners(args)
    precise_sleeps()  # before any thread starts: the polls of writes and sockets wake when they asked
    worker = Worker(args, pipeline)
    try:
        if not args.disagg_full_pipeline:
            check_mooncake_listeners(args)
    except ConfigError:
        worker.transport.close()
        raise
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: worker.begin_drain())
    try:
        worker.serve()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if worker.tracing is not None:
            worker.tracing.shutdown()  # the spans still buffered
    return 0
