"""DiffusionServer: routes every request through the worker pools; moves control, never tensors.

One thread owns every socket. A request enters on the frontend ROUTER (Submit), waits in its
role's queue until the dispatch policy finds an instance, and moves hop by hop through the
transfer flow (spec, "Transfer Flow"):

    sender --TransferStaged--> head --TransferAlloc--> receiver --TransferAllocated--> head
    head --TransferPush--> sender --(Mooncake write)--> sender --TransferPushed--> head
    head --TransferReady--> receiver ... decoder --Result(pixels)--> head --> API client

Every state change goes through RequestRecord.move (state.py); every way a request ends goes
through `_finish`, which releases the slots and buffers it held on any worker. A request whose
worker is lost (no heartbeat, disconnected) is retried, bounded by --disagg-max-retries: the hop
again with another receiver while its sender still holds the outputs, else the whole route as a
new attempt (`wire_id`), so that no late message of the lost attempt can touch the new one.
Workers that drain (SIGTERM) or leave discovery get no new work and finish what they hold. A client that
submits with `watch` also hears every state change and denoising step (RequestEvent); the
others hear only how their request ends, and their denoisers send no per-step progress.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from triptych.config import ServeArgs
from triptych.params import GenerationParams
from triptych.ports import frontend_port, result_port, tcp_url
from triptych.protocol import (
    Cancel,
    CancelWork,
    Failed,
    Heartbeat,
    Progress,
    ProtocolError,
    RequestEvent,
    RequestResult,
    Result,
    Submit,
    TransferAlloc,
    TransferAllocated,
    TransferPush,
    TransferPushed,
    TransferReady,
    TransferRefused,
    TransferStaged,
    Work,
    WorkBatch,
    decode,
    encode,
)
from triptych.roles import WORKER_ROLES, Role, is_full_pipeline, route_for
from triptych.security import ControlPlane, control_plane
from triptych.sockets import has_queued_message
from triptych_head.admission import AdmissionControl, retry_after_seconds
from triptych_head.batcher import BatchingMetrics, Group, GroupBatcher
from triptych_head.discovery import WorkerDirectory
from triptych_head.dispatch import make_policy
from triptych_head.instances import StandingSlot, WorkerInstance
from triptych_head.metrics import HeadMetrics
from triptych_head.pipeline_view import build_view
from triptych_head.registry import WorkerRegistry
from triptych_head.state import ROLE_STATES, RequestRecord, RequestState, StagedPayload
from triptych_head.workload import WorkEstimator

log = logging.getLogger(__name__)

PING_INTERVAL_S = 0.5
SHUTDOWN_LINGER_MS = 1000  # how long the last messages to workers may take to leave after a drain
POLL_MS = 50
DRAIN_LIMIT = 1000  # messages taken from one socket per loop turn, so no socket starves the others
REJECTED = "REJECTED"
SHUTTING_DOWN = "the head is shutting down and takes no new requests; retry shortly (another head takes over)"

Validator = Callable[[GenerationParams], None]


@dataclass(frozen=True)
class HeldSlot:
    """A receive slot of an ended request whose sender may still be writing into it."""

    sender: str
    receiver: str
    until: float
    standing_addr: int = 0


def deployed_roles(args: ServeArgs) -> frozenset[Role]:
    """The worker roles this head routes through: those its URL flags list."""
    return frozenset(role for role in WORKER_ROLES if args.urls_for(role))


def request_route(roles: frozenset[Role], params: GenerationParams) -> list[Role]:
    """The roles one request visits, in order (an edit's reference image adds the image encoder)."""
    return route_for(roles, has_reference=params.has_reference)


class DiffusionServer:
    def __init__(
        self,
        args: ServeArgs,
        metrics: HeadMetrics | None = None,
        validate: Validator | None = None,
        ctx: zmq.Context | None = None,
    ):
        self.args = args
        self.metrics = metrics or HeadMetrics()
        self._validate = validate
        self._ctx = ctx or zmq.Context.instance()
        self._ctx.setsockopt(zmq.IPV6, 1)  # workers may have IPv6 pod IPs; IPv4 keeps working
        # Before any socket: with keys, result sockets let in only the pipeline's workers, and the
        # head reaches workers' work sockets as the only client they accept.
        self.security: ControlPlane = control_plane(args, self._ctx, "head")
        self._roles = deployed_roles(args)
        # Only --denoiser-urls: each request goes whole to one worker, which returns its pixels; no tensor
        # moves between workers, so the head sends no transfer_* message (triptych.roles.FULL_PIPELINE_ROLE).
        self.full_pipeline = is_full_pipeline(self._roles)
        self.topology = "full_pipeline" if self.full_pipeline else "disaggregated"
        directories = {
            role: WorkerDirectory(args.urls_for(role), args.disagg_discovery_interval)
            for role in WORKER_ROLES
            if role in self._roles
        }
        self.registry = WorkerRegistry(
            self._ctx, directories, args.disagg_heartbeat_timeout, self.metrics, self.security
        )
        self.requests: dict[str, RequestRecord] = {}  # by the client's request id
        self._attempts: dict[str, RequestRecord] = {}  # the same records by the id workers know (wire_id)
        self.workload = WorkEstimator()
        self.admission = AdmissionControl(args.max_queued_requests, self.metrics)  # the API admits against it
        self._typical_seconds: dict[Role, float] = {}  # device-seconds of a request per role, for Retry-After
        self._last_params: GenerationParams | None = None  # the latest request's, for the estimate when idle
        self._no_instance_since: dict[Role, float] = {}  # roles with no ready instance, since when
        self._held_slots: dict[str, HeldSlot] = {}  # receive slots of ended requests, freed once their write is over
        self._queues: dict[Role, deque[str]] = {role: deque() for role in directories}
        self.pipeline_view: dict[str, Any] = {"roles": {}, "requests": []}  # replaced whole at each tick
        # One per role: a round-robin cursor shared by roles of different sizes would keep landing on
        # the same instance of one of them (one encoder and two denoisers: always the second denoiser).
        self._policies = {role: make_policy(args.disagg_dispatch_policy) for role in directories}
        self._batch_metrics = BatchingMetrics(self.metrics.registry) if args.enable_batching_metrics else None
        self._batcher: GroupBatcher | None = None
        if args.batching_mode == "dynamic":
            self._batcher = GroupBatcher(args.batching_max_size, args.batching_delay_ms / 1000, self._batch_metrics)
        self._stop = threading.Event()
        self._drain_deadline: float | None = None  # set by drain() from another thread; read by the loop
        self._drain_seconds = 0.0
        self._sockets: list[tuple[zmq.Socket, Role | None]] = []
        self.frontend_endpoint = f"tcp://127.0.0.1:{frontend_port(args.scheduler_port)}"
        self.frontend = self._bind(zmq.ROUTER, self.frontend_endpoint, None)  # in-process API clients only
        for role in directories:
            self._bind(zmq.PULL, tcp_url(args.host, result_port(args.scheduler_port, role)), role)
        log.info(
            "result sockets on %s ports %s, control plane %s", args.host,
            ",".join(str(result_port(args.scheduler_port, role)) for role in directories),
            "authenticated (CURVE)" if self.security.authenticated else "UNAUTHENTICATED",
        )  # fmt: skip

    def _bind(self, kind: int, endpoint: str, role: Role | None) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if role is not None:
            self.security.server(sock)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            for other, _ in self._sockets:
                other.close()
            self.security.close()
            raise OSError(f"cannot bind {endpoint}: {exc} (is another head using --scheduler-port?)") from None
        self._sockets.append((sock, role))
        return sock

    # --- loop -------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until stop(); call from the thread that owns this server."""
        poller = zmq.Poller()
        for sock, _ in self._sockets:
            poller.register(sock, zmq.POLLIN)
        next_tick = 0.0
        # A group waiting for --batching-delay-ms leaves on time, not at the next idle wake-up.
        delay_ms = self._batcher.delay_s * 1000 if self._batcher is not None else 0.0
        poll_ms = min(POLL_MS, max(1, int(delay_ms))) if delay_ms > 0 else POLL_MS
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(poll_ms))
                for sock, role in self._sockets:
                    if sock in ready:
                        self._drain(sock, role)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + PING_INTERVAL_S
                    try:
                        self._tick(now)
                    except Exception:  # e.g. an unusable address from discovery: log it, keep serving
                        log.exception("periodic upkeep failed")
                self._dispatch_all()
                if self._drain_deadline is not None and self._drained(time.monotonic(), self._drain_deadline):
                    break
        finally:
            # Lingering lets the CancelWork messages of a drain reach the workers before the sockets go.
            self.registry.close(linger_ms=SHUTDOWN_LINGER_MS if self._drain_deadline is not None else 0)
            for sock, _ in self._sockets:
                sock.close(linger=0)
            self.security.close()

    def stop(self) -> None:
        self._stop.set()

    def drain(self, seconds: float) -> None:
        """Stop taking requests; in-flight ones have `seconds` to finish, then fail (503) and free
        their worker slots; run() returns once nothing is held on any worker. Thread-safe; a second
        call can only bring the deadline forward."""
        deadline = time.monotonic() + max(seconds, 0.0)
        if self._drain_deadline is None:
            self._drain_seconds = seconds  # before the deadline: the loop reads them in that order
            self._drain_deadline = deadline
        else:
            self._drain_deadline = min(self._drain_deadline, deadline)

    def _drained(self, now: float, deadline: float) -> bool:
        """While draining: past the deadline fail what is left (releasing its slots); True once
        no request and no receive slot is held any more."""
        if now >= deadline:
            reason = (
                f"the head shut down before this request finished (it had {self._drain_seconds:g}s to drain, "
                "--disagg-drain-timeout); its worker slots were released; retry it"
            )
            for rec in list(self.requests.values()):
                self._finish(rec, RequestState.FAILED, reason, status_code=503)
            for rid in list(self._held_slots):
                self._release_held(rid)  # as at its own timeout: this head is going and would never free it
        return not self.requests and not self._held_slots

    def _drain(self, sock: zmq.Socket, role: Role | None) -> None:
        for _ in range(DRAIN_LIMIT):
            try:
                parts = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                if role is None:
                    self._on_frontend([p.buffer for p in parts])
                else:
                    self._on_worker(role, [p.buffer for p in parts])
            except Exception:  # the loop serves every other request; never let one message end it
                log.exception("unhandled error on the %s socket; message dropped", role.value if role else "frontend")
            if not has_queued_message(sock):
                return

    def _tick(self, now: float) -> None:
        self.registry.sync()
        self.registry.ping_all()
        for inst in self.registry.lost():
            if inst.draining and not self._holds_anything(inst.url):
                log.info("%s %s drained and exited", inst.role.value, inst.url)
                continue
            self._instance_lost(
                inst,
                "heartbeat_lost",
                f"{inst.role.value} {inst.url} stopped responding "
                f"(no heartbeat for {self.registry.heartbeat_timeout:g}s)",
            )
        self._remove_idle_leavers()
        for rec in [r for r in self.requests.values() if now >= r.deadline]:
            self._finish(rec, RequestState.TIMED_OUT, self._timeout_reason(rec), status_code=504)
        self._fail_roles_without_instances(now)
        for rid in [rid for rid, held in self._held_slots.items() if now >= held.until]:
            log.warning("request %s: sender never reported its write; freeing the receive slot anyway", rid)
            self._release_held(rid)
        self.registry.publish_metrics()
        self._publish_load(now)
        self.metrics.active_requests.set(len(self.requests))

    def _holds_anything(self, url: str) -> bool:
        """Whether some request (or a receive slot still being written) involves this worker."""
        return any(url in r.involved_instances() for r in self.requests.values()) or any(
            url in (h.sender, h.receiver) for h in self._held_slots.values()
        )

    def _remove_idle_leavers(self) -> None:
        """Forget the instances discovery dropped once nothing of a request is left on them."""
        for inst in self.registry.leaving():
            if not self._holds_anything(inst.url):
                self.registry.remove(inst)
            elif not self.registry.alive(inst):  # gone before finishing: what it held is retried
                self._instance_lost(inst, "left_discovery", f"{inst.role.value} {inst.url} left the service")
                self.registry.remove(inst)

    def _fail_roles_without_instances(self, now: float) -> None:
        """Fail the requests waiting for a role that has had no ready instance for --disagg-no-instance-wait."""
        wait = self.args.disagg_no_instance_wait
        for role, queue in self._queues.items():
            instances = self.registry.instances(role)
            if any(self.registry.ready(i) for i in instances):
                self._no_instance_since.pop(role, None)
                continue
            since = self._no_instance_since.setdefault(role, now)
            if now - since < wait:
                continue
            alive = [i for i in instances if self.registry.alive(i)]
            reason = (
                f"no {role.value} instance has taken work for {now - since:.0f}s (--disagg-no-instance-wait "
                f"{wait:g}); {len(alive)} of {len(instances)} known {role.value} instances responding, none ready"
            )
            if wrong := sum(1 for i in alive if i.wrong_topology):
                flag = "without" if self.full_pipeline else "with"
                reason += f" ({wrong} started {flag} --disagg-full-pipeline, which this head's URL flags do not match)"
            for rid in list(queue):
                rec = self.requests.get(rid)
                if rec is not None and rec.role is role and rec.instance is None:
                    self._finish(rec, RequestState.FAILED, reason, status_code=503)

    def _publish_load(self, now: float) -> None:
        """Per-role queued, running and estimated pending device-seconds (the autoscaling signal), and
        the admission bound: the ready workers' slots and how long a refused client should wait."""
        queued = dict.fromkeys(self._queues, 0)
        running = dict.fromkeys(self._queues, 0)
        pending = dict.fromkeys(self._queues, 0.0)
        per_request = dict.fromkeys(self._queues, 0.0)  # full estimates, for the Retry-After
        visiting = dict.fromkeys(self._queues, 0)
        for rec in self.requests.values():
            if rec.instance is None:
                queued[rec.role] += 1
            else:
                running[rec.role] += 1
            computing = rec.state is ROLE_STATES[rec.role][1]
            for role in rec.remaining_roles():
                running_for = now - rec.hop_started if computing and role is rec.role else None
                pending[role] += self.workload.remaining(role, rec.params, running_for)
                per_request[role] += self.workload.estimate(role, rec.params)
                visiting[role] += 1
        slots, retry_after = 0, 1
        for role in self._queues:
            self.metrics.role_queued.labels(role.value).set(queued[role])
            self.metrics.role_running.labels(role.value).set(running[role])
            self.metrics.role_pending_work.labels(role.value).set(pending[role])
            self.metrics.role_seconds_per_unit.labels(role.value).set(self.workload.seconds_per_unit(role))
            ready = [i for i in self.registry.instances(role) if self.registry.ready(i)]
            slots += sum(i.capacity for i in ready)
            if visiting[role]:
                self._typical_seconds[role] = per_request[role] / visiting[role]
            elif self._last_params is not None:  # idle: what the latest request would cost, at today's rates
                self._typical_seconds[role] = self.workload.estimate(role, self._last_params)
            retry_after = max(retry_after, retry_after_seconds(self._typical_seconds.get(role, 0.0), len(ready)))
        self.admission.update(slots, retry_after)
        self.pipeline_view = build_view(self.registry.snapshot(), queued, running, self.requests.values())

    def view(self) -> dict[str, Any]:
        """GET /v1/pipeline: the instances as they are now (what /health shows), the queues and the
        requests as of the last tick (at most PING_INTERVAL_S old)."""
        view, instances = self.pipeline_view, self.registry.snapshot()
        tick = view["roles"] or {role: {"queued": 0, "running": 0} for role in instances}  # before the first tick
        roles = {role: {**info, "instances": instances.get(role, [])} for role, info in tick.items()}
        return {**view, "topology": self.topology, "roles": roles}

    def _timeout_reason(self, rec: RequestRecord) -> str:
        role = rec.role.value
        alive = sum(1 for i in self.registry.instances(rec.role) if self.registry.alive(i))
        total = len(self.registry.instances(rec.role))
        return (
            f"request timed out after {self.args.disagg_timeout:g}s (--disagg-timeout) in state {rec.state.value}; "
            f"{alive} of {total} {role} instances responding"
        )

    # --- frontend: API clients --------------------------------------------------------------

    def _on_frontend(self, parts: list[Any]) -> None:
        if len(parts) < 2:
            return
        client, body = bytes(parts[0]), parts[1:]
        try:
            msg, _ = decode(body)
        except ProtocolError as exc:
            self._reply(client, RequestEvent(exc.request_id or "", REJECTED, error=str(exc), status_code=400))
            return
        if isinstance(msg, Submit):
            self._submit(client, msg)
        elif isinstance(msg, Cancel):
            rec = self.requests.get(msg.request_id)
            if rec is not None:
                self._finish(rec, RequestState.CANCELLED, "cancelled by the client", status_code=499)
        else:
            self._reply(
                client, RequestEvent("", REJECTED, error=f"{msg.TYPE} is not a frontend message", status_code=400)
            )

    def _submit(self, client: bytes, msg: Submit) -> None:
        rid = msg.request_id
        if not rid:
            self._reply(client, RequestEvent(rid, REJECTED, error="request_id must be non-empty", status_code=400))
            return
        if self._drain_deadline is not None:
            self._reply(client, RequestEvent(rid, REJECTED, error=SHUTTING_DOWN, status_code=503))
            return
        if rid in self.requests:
            # The original request is untouched: only the duplicate's sender hears about it.
            self._reply(
                client, RequestEvent(rid, REJECTED, error=f"request id {rid!r} is already active", status_code=409)
            )
            return
        try:  # the decoder checked each parameter's type; this checks them against the model
            if self._validate is not None:
                self._validate(msg.params)
        except ValueError as exc:
            self._reply(client, RequestEvent(rid, REJECTED, error=str(exc), status_code=400))
            return
        encodes_images = self.full_pipeline or any(role.runs_affinity(Role.IMAGE_ENCODER) for role in self._roles)
        if msg.params.has_reference and not encodes_images:
            error = "image: this deployment encodes no reference images (its head has no --image-encoder-urls)"
            self._reply(client, RequestEvent(rid, REJECTED, error=error, status_code=400))
            return
        rec = RequestRecord(
            request_id=rid,
            params=msg.params,
            route=request_route(self._roles, msg.params),
            client=client,
            deadline=time.monotonic() + self.args.disagg_timeout,
            watch=msg.watch,
            preview_every=msg.preview_every if msg.watch else 0,
        )
        self.requests[rid] = rec
        self._attempts[rec.wire_id] = rec
        self._enter_hop(rec)
        self._last_params = msg.params

    def _reply(self, client: bytes, msg: Any, frames: list[Any] | None = None) -> None:
        try:
            # Zero-copy only pays for large frames (pixels); small control messages are cheaper copied.
            self.frontend.send_multipart([client, *encode(msg, frames or [])], flags=zmq.NOBLOCK, copy=not frames)
        except zmq.Again:
            log.warning("frontend client %r is not reading; dropped %s", client, msg.TYPE)

    def _event(self, rec: RequestRecord, step: int = 0, total: int = 0, preview: bytes = b"") -> None:
        if not rec.watch:
            return
        event = RequestEvent(rec.request_id, rec.state.value, step=step, total_steps=total, preview=preview)
        self._reply(rec.client, event)

    # --- workers ----------------------------------------------------------------------------

    def _on_worker(self, role: Role, parts: list[Any]) -> None:
        try:
            msg, frames = decode(parts)
        except ProtocolError as exc:
            self.metrics.dropped_messages.inc()
            rec = self._attempts.get(exc.request_id or "")
            if rec is None:
                log.warning("dropped undecodable message on the %s result socket: %s", role.value, exc)
            else:
                self._finish(rec, RequestState.FAILED, f"malformed message from a {role.value}: {exc}")
            return
        inst = self.registry.get(role, getattr(msg, "instance", ""))
        if inst is None:
            self.metrics.dropped_messages.inc()
            log.warning("dropped %s from unknown %s instance %r", msg.TYPE, role.value, getattr(msg, "instance", None))
            return
        if isinstance(msg, Heartbeat):
            if msg.head_id and msg.head_id != self.registry.head_id:
                # It still serves a previous head; once our ping reaches it, it drops that head's work
                # and says so in its next heartbeat. Until then nothing is dispatched to it.
                return
            if msg.draining and not inst.draining:
                log.info("%s %s is draining: no new work goes to it", role.value, inst.url)
            inst.on_heartbeat(
                msg.capacity,
                msg.session,
                msg.pool_bytes,
                msg.free_bytes,
                msg.model,
                msg.standing_bytes,
                msg.draining,
                msg.max_batch,
            )
            self._check_topology(inst, msg)
            return
        rec = self._attempts.get(msg.request_id)
        if rec is None:
            log.debug("late %s for finished request %s from %s", msg.TYPE, msg.request_id, inst.url)
            held = self._held_slots.get(msg.request_id)
            if held and held.sender == inst.url and isinstance(msg, (TransferPushed, Failed)):
                self._release_held(msg.request_id)
            if isinstance(msg, (TransferStaged, TransferAllocated)):
                self.registry.send(inst.url, CancelWork(msg.request_id, inst.url))
            return
        if rec.slot_addr and inst.url == rec.instance and rec.state is ROLE_STATES[rec.role][1]:
            self._free_standing(inst, rec.wire_id, rec.slot_addr)  # it reports, so it has loaded the slot
            rec.slot_addr = 0
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.metrics.dropped_messages.inc()
            log.warning("dropped %s: not a worker message", msg.TYPE)
            return
        try:
            handler(self, rec, inst, msg, frames)
        except Exception as exc:  # a bug or a misbehaving worker fails one request, never the loop
            log.exception("handling %s for %s", msg.TYPE, rec.wire_id)
            if self._attempts.get(rec.wire_id) is rec:
                self._finish(rec, RequestState.FAILED, f"internal error handling {msg.TYPE} from {inst.url}: {exc}")

    def _check_topology(self, inst: WorkerInstance, msg: Heartbeat) -> None:
        """A full-pipeline worker behind a role-pool head, or a role worker behind a full-pipeline head,
        would return the wrong thing: it gets no work, and the head says why once."""
        inst.full_pipeline, inst.encoder_cache = msg.full_pipeline, msg.encoder_cache
        wrong = msg.full_pipeline != self.full_pipeline
        if wrong and not inst.wrong_topology:
            worker = "runs the whole pipeline (--disagg-full-pipeline)" if msg.full_pipeline else "runs its role only"
            head = "lists only --denoiser-urls (a full-pipeline pool)" if self.full_pipeline else "routes through roles"
            log.error("%s %s %s but this head %s: it gets no work", inst.role.value, inst.url, worker, head)
        inst.wrong_topology = wrong

    def _on_progress(self, rec: RequestRecord, inst: WorkerInstance, msg: Progress, frames: list[Any]) -> None:
        if rec.instance == inst.url:
            rec.step, rec.total_steps = msg.step, msg.total
            self._event(rec, msg.step, msg.total, msg.preview)

    def _on_staged(self, rec: RequestRecord, inst: WorkerInstance, msg: TransferStaged, frames: list[Any]) -> None:
        _, running, done = ROLE_STATES[rec.role]
        if rec.state is not running or rec.instance != inst.url:
            self.registry.send(inst.url, CancelWork(rec.wire_id, inst.url))
            return
        if rec.hop + 1 >= len(rec.route):
            raise RuntimeError(f"{inst.role.value} staged a transfer but is the last role of the route")
        stage = self._time_stage(rec, msg.seconds, msg.batch_size)
        if self._batch_metrics is not None:
            self._batch_metrics.observe_ran(inst.role.value, msg.batch_size, msg.batch_leader)
        rec.move(done)
        rec.staged = StagedPayload(sender=inst.url, nbytes=msg.nbytes, manifest=msg.manifest, meta=msg.meta)
        rec.instance = None
        rec.hop += 1
        self._enter_hop(rec)
        self.metrics.observe_stage(*stage)  # after the push went out: off the request's path

    def _on_allocated(
        self, rec: RequestRecord, inst: WorkerInstance, msg: TransferAllocated, frames: list[Any]
    ) -> None:
        if not (rec.receiver_reserved and rec.instance == inst.url and rec.staged):
            self.registry.send(inst.url, CancelWork(rec.wire_id, inst.url))
            return
        if msg.session != inst.session:
            # A sender writes only to the transfer session its receiver heartbeats, never to one a
            # message names (a restarted process behind the same address: its next heartbeat tells).
            reason = f"{inst.role.value} {inst.url} offered a slot in transfer session {msg.session!r}, not its own"
            self._instance_lost(inst, "session_mismatch", reason)
            return
        if msg.kept:
            inst.standing[msg.addr] = StandingSlot(rec.staged.nbytes, holder=rec.wire_id)
            rec.slot_addr = msg.addr
        push = TransferPush(rec.wire_id, rec.staged.sender, dest_session=msg.session, dest_addr=msg.addr)
        if not self.registry.send(rec.staged.sender, push):
            self._sender_unreachable(rec)
            return
        rec.push_in_flight = True

    def _on_refused(self, rec: RequestRecord, inst: WorkerInstance, msg: TransferRefused, frames: list[Any]) -> None:
        if not (rec.receiver_reserved and rec.instance == inst.url):
            return
        if msg.fatal:
            self._finish(rec, RequestState.FAILED, f"{inst.role.value} {inst.url}: {msg.reason}", status_code=413)
            return
        # Back-pressure: the sender keeps holding the tensors until this or another receiver has room.
        inst.inflight.discard(rec.wire_id)
        inst.refused_bytes = rec.staged.nbytes if rec.staged else 0
        rec.instance = None
        self._queues[rec.role].appendleft(rec.request_id)

    def _on_pushed(self, rec: RequestRecord, inst: WorkerInstance, msg: TransferPushed, frames: list[Any]) -> None:
        staged = rec.staged
        if staged is None or staged.sender != inst.url or rec.instance is None:
            return
        inst.inflight.discard(rec.wire_id)  # spec step 5: the sender's scheduling slot is free again
        rec.push_in_flight = False
        rec.staged = None
        ready = TransferReady(
            rec.wire_id,
            rec.instance,
            rec.wire_params(),
            staged.manifest,
            staged.meta,
            rec.slot_addr,
            rec.watch,
            rec.preview_every,
            *rec.batch,
        )
        started = time.monotonic()  # before the send, so the hop's time contains all the receiver's work
        sent = self.registry.send(rec.instance, ready)
        dest = self._record_transfer(rec, inst, staged, msg)  # after the send: the receiver need not wait for it
        if not sent:
            receiver = self.registry.find(rec.instance or "")
            reason = f"{dest} {rec.instance} became unreachable before its input was ready"
            if receiver is None:
                self._finish(rec, RequestState.FAILED, reason, status_code=503)
            else:
                self._instance_lost(receiver, "disconnected", reason)
            return
        rec.move(ROLE_STATES[rec.role][1])
        rec.hop_started = started
        self._event(rec)

    def _record_transfer(
        self, rec: RequestRecord, sender: WorkerInstance, staged: StagedPayload, msg: TransferPushed
    ) -> str:
        """Metrics and timings of a finished hand-off; returns the receiving role's name."""
        receiver = self.registry.find(rec.instance or "")
        dest = receiver.role.value if receiver else "?"
        src = sender.role.value
        self.metrics.transfer_bytes.labels(src, dest).inc(msg.nbytes)
        self.metrics.transfer_seconds.labels(src, dest).observe(msg.seconds)
        handoff = time.monotonic() - staged.staged_at  # reserve a slot, push, write, report
        self.metrics.handoff_seconds.labels(src, dest).observe(handoff)
        rec.timings[f"transfer_{src}_{dest}"] = msg.seconds
        rec.timings[f"handoff_{src}_{dest}"] = handoff
        return dest

    def _on_result(self, rec: RequestRecord, inst: WorkerInstance, msg: Result, frames: list[Any]) -> None:
        """Pixels from the route's last hop: the decoder, or a full-pipeline worker."""
        if not rec.last_hop or rec.state is not ROLE_STATES[rec.role][1] or rec.instance != inst.url:
            return
        stage = self._time_stage(rec, msg.seconds, msg.batch_size)
        if self._batch_metrics is not None:
            self._batch_metrics.observe_ran(inst.role.value, msg.batch_size, msg.batch_leader)
        rec.timings["total"] = time.monotonic() - rec.created
        rec.move(RequestState.DONE)
        self._reply(rec.client, RequestResult(rec.request_id, msg.tensors, rec.timings), frames)
        self.metrics.observe_stage(*stage)
        self._finish(rec, RequestState.DONE)

    def _on_failed(self, rec: RequestRecord, inst: WorkerInstance, msg: Failed, frames: list[Any]) -> None:
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
            receiver = self.registry.find(rec.instance or "")
            if receiver is not None:
                receiver.suspect = True  # until it heartbeats again: retries must not go back to a dead one
                self._retry(rec, receiver, "transfer_failed", reason, outputs_kept=False)
                return
        self._finish(rec, RequestState.FAILED, reason, msg.status_code)

    _handlers: dict[type, Callable[..., None]] = {
        Progress: _on_progress,
        TransferStaged: _on_staged,
        TransferAllocated: _on_allocated,
        TransferRefused: _on_refused,
        TransferPushed: _on_pushed,
        Result: _on_result,
        Failed: _on_failed,
    }

    # --- hops and dispatch ------------------------------------------------------------------

    def _enter_hop(self, rec: RequestRecord, ahead: bool = False) -> None:
        """Queue `rec` for its current role; `ahead`: before the others (a retry was accepted earlier)."""
        rec.move(ROLE_STATES[rec.role][0])
        rec.hop_started = time.monotonic()
        self._event(rec)
        queue = self._queues[rec.role]
        if ahead:
            queue.appendleft(rec.request_id)
        else:
            queue.append(rec.request_id)
        if len(queue) == 1:  # nothing waited ahead of it: dispatched now rather than at the end of the loop turn
            self._dispatch_queue(rec.role)

    def _dispatch_all(self) -> None:
        for role in self._queues:
            self._dispatch_queue(role)

    def _dispatch_queue(self, role: Role) -> None:
        """Dispatch `role`'s queue in order until its first request finds no instance."""
        if self._batcher is not None:
            self._dispatch_groups(role, self._batcher)
            return
        queue = self._queues[role]
        while queue and self._dispatch_one(role, queue[0]):
            queue.popleft()

    def _queued(self, role: Role, rid: str) -> RequestRecord | None:
        """The request behind a queue entry, or None for a stale entry (ended, restarted elsewhere in
        its route, or already dispatched)."""
        rec = self.requests.get(rid)
        if rec is None or rec.state.terminal or rec.role is not role or rec.instance is not None:
            return None
        return rec

    def _dispatch_groups(self, role: Role, batcher: GroupBatcher) -> None:
        """--batching-mode dynamic: send the groups of `role`'s queue that are ready (batcher.py),
        each to one instance; what an instance has no room for stays queued."""
        queue = self._queues[role]
        queued: list[RequestRecord] = []
        gone: set[str] = set()  # stale entries, then the dispatched ones
        for rid in queue:
            rec = self._queued(role, rid)
            if rec is None:
                gone.add(rid)
            else:
                queued.append(rec)
        instances = [i for i in self.registry.instances(role) if self.registry.ready(i)]
        room = max((i.batch_room for i in instances), default=0)
        now = time.monotonic()
        for members in batcher.ready_groups(queued, room, now):
            nbytes = members[0].staged.nbytes if members[0].staged else 0  # compatible: the same for all
            inst = self._policies[role](instances, functools.partial(self._can_take, nbytes=nbytes))
            if inst is None:
                break
            group = Group(inst, members[: inst.batch_room])
            for rec in group.members:
                rec.batch = (group.batch_id, len(group.members)) if len(group.members) > 1 else ("", 1)
                if self._dispatch_one(role, rec.request_id, group):
                    gone.add(rec.request_id)
            if group.work and not self._send_work(inst, group.work):
                break
            batcher.observe_sent(role.value, group, now)
        if gone:
            remaining = [rid for rid in queue if rid not in gone]
            queue.clear()
            queue.extend(remaining)

    def _can_take(self, inst: WorkerInstance, nbytes: int) -> bool:
        return self.registry.ready(inst) and inst.can_take(nbytes)

    def _send_work(self, inst: WorkerInstance, work: list[Work]) -> bool:
        """A group's first-role work as one message (a single request as plain Work)."""
        msg: Work | WorkBatch = work[0] if len(work) == 1 else WorkBatch(inst.url, work)
        if self.registry.send(inst.url, msg):
            return True
        self._instance_lost(inst, "disconnected", f"{inst.role.value} {inst.url} is not connected")
        return False

    def _dispatch_one(self, role: Role, rid: str, group: Group | None = None) -> bool:
        """Give the request at the head of `role`'s queue to an instance; False if none can take it.
        With `group`: to the group's instance, and a first role's Work goes into `group.work`."""
        rec = self._queued(role, rid)
        if rec is None:
            return True
        wire_id = rec.wire_id
        instances = self.registry.instances(role)
        nbytes = rec.staged.nbytes if rec.staged else 0
        if rec.staged:
            known = [i for i in instances if self.registry.alive(i) and i.pool_bytes]
            if known and all(nbytes > i.pool_bytes for i in known):
                largest = max(i.pool_bytes for i in known)
                self._finish(
                    rec,
                    RequestState.FAILED,
                    f"payload of {nbytes} bytes exceeds --disagg-transfer-pool-size of every {role.value} "
                    f"({largest} bytes); raise it on the {role.value} workers",
                    status_code=413,
                )
                return True
        if group is None:
            inst = self._policies[role](instances, functools.partial(self._can_take, nbytes=nbytes))
        else:
            inst = group.instance if self._can_take(group.instance, nbytes) else None
        if inst is None:
            return False
        started = time.monotonic()  # before the send, so the hop's time contains all the instance's work
        waited = started - rec.hop_started
        if rec.staged and inst.session and (addr := inst.free_standing_slot(nbytes)) is not None:
            # Spec step 2, fast path: a preallocated slot fits, so no transfer_alloc round trip.
            sender = rec.staged.sender
            if not self.registry.send(sender, TransferPush(wire_id, sender, dest_session=inst.session, dest_addr=addr)):
                self._sender_unreachable(rec)
                return True
            inst.standing[addr].holder = wire_id
            rec.slot_addr, rec.push_in_flight = addr, True
            sent = True
        elif rec.staged:
            keep = inst.should_keep_slot(nbytes)
            sent = self.registry.send(inst.url, TransferAlloc(wire_id, inst.url, nbytes, keep=keep))
        else:
            work = Work(wire_id, inst.url, rec.wire_params(), progress=rec.watch, preview_every=rec.preview_every)
            if group is not None:
                group.work.append(work)  # sent with the rest of the group (_send_work)
                sent = True
            else:
                sent = self.registry.send(inst.url, work)
        if not sent:  # not connected any more: treat it as gone until it heartbeats again
            self._instance_lost(inst, "disconnected", f"{role.value} {inst.url} is not connected")
            return False
        inst.inflight.add(wire_id)
        inst.dispatched_total += 1
        rec.instance = inst.url
        rec.hop_started = started
        if not rec.staged:
            rec.move(ROLE_STATES[role][1])
            self._event(rec)
        self.metrics.queue_seconds.labels(role.value).observe(waited)
        return True

    def _time_stage(self, rec: RequestRecord, worker_seconds: float, batch_size: int = 1) -> tuple[str, float, float]:
        """Record the hop's time as the head saw it (dispatch to output reported) and as the worker
        spent it (load inputs, run stages, stage outputs), and calibrate the work estimate with the
        latter; returns (role, head-seen seconds, worker seconds) for the metrics, which callers
        observe once the request's next message is out. A request that ran in a batch of B costs
        the device a B-th of the batch's time: that share is its device time and its estimate."""
        role = rec.role.value
        elapsed = time.monotonic() - rec.hop_started
        rec.timings[role] = elapsed
        rec.timings[f"worker_{role}"] = worker_seconds
        share = worker_seconds / max(batch_size, 1)
        self.workload.observe(rec.role, rec.params, share)
        return role, elapsed, share

    # --- lost workers and retries -----------------------------------------------------------

    def _instance_lost(self, inst: WorkerInstance, cause: str, reason: str) -> None:
        """A worker stopped responding or cannot be reached: retry what it held, forget its slots."""
        log.warning("%s", reason)
        inst.last_heartbeat = None
        inst.inflight.clear()
        inst.standing.clear()
        for rec in [r for r in self.requests.values() if inst.url in r.involved_instances()]:
            self._retry(rec, inst, cause, reason)
        for wire_id in [w for w, held in self._held_slots.items() if held.sender == inst.url]:
            self._release_held(wire_id)  # a sender that is gone writes nothing more

    def _sender_unreachable(self, rec: RequestRecord) -> None:
        assert rec.staged is not None
        sender = self.registry.find(rec.staged.sender)
        reason = f"sender {rec.staged.sender} is unreachable; its output is lost"
        if sender is None:
            self._finish(rec, RequestState.FAILED, reason, status_code=503)
        else:
            self._instance_lost(sender, "disconnected", reason)

    def _retry(
        self, rec: RequestRecord, lost: WorkerInstance, cause: str, reason: str, outputs_kept: bool = True
    ) -> None:
        """Carry on without `lost`: the same hop with another receiver while the sender still holds
        the outputs (nothing was written yet, and `outputs_kept`), else the whole route again as a
        new attempt. The seed is in the parameters, so a retried request gives the same pixels."""
        if rec.retries >= self.args.disagg_max_retries:
            self._finish(
                rec,
                RequestState.FAILED,
                f"{reason}; gave up after {rec.retries} retries (--disagg-max-retries)",
                status_code=503,
            )
            return
        rec.retries += 1
        self.metrics.retries.labels(lost.role.value, cause).inc()
        staged = rec.staged
        if outputs_kept and staged is not None and staged.sender != lost.url and not rec.push_in_flight:
            log.info("request %s: %s; its %s outputs wait for another receiver", rec.request_id, reason, staged.sender)
            rec.instance, rec.slot_addr = None, 0
            self._queues[rec.role].appendleft(rec.request_id)
            return
        log.info("request %s: %s; restarting it (retry %d)", rec.request_id, reason, rec.retries)
        self._release(rec)
        del self._attempts[rec.wire_id]
        rec.restart()
        self._attempts[rec.wire_id] = rec
        self._enter_hop(rec, ahead=True)

    # --- endings ----------------------------------------------------------------------------

    def _release_held(self, wire_id: str) -> None:
        held = self._held_slots.pop(wire_id)
        receiver = self.registry.find(held.receiver)
        if receiver is not None and held.standing_addr:
            self._free_standing(receiver, wire_id, held.standing_addr)
        self.registry.send(held.receiver, CancelWork(wire_id, held.receiver))

    @staticmethod
    def _free_standing(inst: WorkerInstance, wire_id: str, addr: int) -> None:
        slot = inst.standing.get(addr)
        if slot is not None and slot.holder == wire_id:
            slot.holder = None

    def _release(self, rec: RequestRecord) -> None:
        """Free everything the current attempt of `rec` holds on any worker (CancelWork)."""
        wire_id = rec.wire_id
        for url in rec.involved_instances():
            inst = self.registry.find(url)
            if inst is not None:
                inst.inflight.discard(wire_id)
            if rec.push_in_flight and rec.staged and url == rec.instance:
                # The sender may be writing into this slot right now: freeing it could hand the
                # bytes of a late write to another request. Free it once the sender reports.
                self._held_slots[wire_id] = HeldSlot(
                    rec.staged.sender, url, time.monotonic() + 2 * self.registry.heartbeat_timeout, rec.slot_addr
                )
                continue
            if url == rec.instance and rec.slot_addr and inst is not None:
                self._free_standing(inst, wire_id, rec.slot_addr)
            self.registry.send(url, CancelWork(wire_id, url))

    def _finish(
        self, rec: RequestRecord, state: RequestState, error: str | None = None, status_code: int = 500
    ) -> None:
        """End a request: release what it holds on every worker, tell its client, forget it."""
        if rec.state is not state:
            rec.move(state)
        if state is RequestState.DONE:
            for url in rec.involved_instances():
                if (inst := self.registry.find(url)) is not None:
                    inst.inflight.discard(rec.wire_id)
        else:
            self._release(rec)
        self.requests.pop(rec.request_id, None)
        self._attempts.pop(rec.wire_id, None)
        self.metrics.requests.labels(state.value).inc()
        if state is RequestState.DONE:
            self.metrics.request_seconds.observe(time.monotonic() - rec.created)
            return
        log.info("request %s %s: %s", rec.request_id, state.value, error)
        self._reply(rec.client, RequestEvent(rec.request_id, state.value, error=error, status_code=status_code))
