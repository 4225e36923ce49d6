"""The head's decisions: what every message in means and which messages go out, with no socket.

HeadCore takes the frontend's and the workers' messages in (on_frontend, on_worker), is woken
for upkeep (tick) and dispatch, and acts through its Transport (membership.py): the edge
(server.py) wires that to ZMQ sockets, a test records it. Time comes from an injected clock,
so every rule here can be driven step by step without a socket, a thread or a sleep.

A request enters as a Submit, waits in its role's queue until the dispatch policy finds an
instance (queues.py), and moves hop by hop through the transfer flow (transfers.py;
docs/design.md, "Transfer flow"):

    sender --TransferStaged--> head --TransferAlloc--> receiver --TransferAllocated--> head
    head --TransferPush--> sender --(Mooncake write)--> sender --TransferPushed--> head
    head --TransferReady--> receiver ... decoder --Result(pixels)--> head --> API client

Every state change goes through RequestRecord.move (state.py); every way a request ends goes
through `finish`, which releases the slots and buffers it held on any worker. A request whose
worker is lost (no heartbeat, disconnected) is retried, bounded by --disagg-max-retries: the hop
again with another receiver while its sender still holds the outputs, else the whole route as a
new attempt (`wire_id`), so that no late message of the lost attempt can touch the new one.
Workers that drain (SIGTERM) or leave discovery get no new work and finish what they hold. A
client that submits with `watch` also hears every state change and denoising step
(RequestEvent); the others hear only how their request ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from triptych.config import ServeArgs
from triptych.families.package import package_fingerprint
from triptych.params import GenerationParams
from triptych.protocol import (
    Cancel,
    CancelWork,
    Failed,
    HeaderTooLarge,
    Heartbeat,
    Progress,
    ProtocolError,
    RequestEvent,
    Submit,
    TransferAllocated,
    TransferPushed,
    TransferStaged,
    UnknownMessageType,
    decode,
)
from triptych.protocol.messages import HEAD_SHUT_DOWN
from triptych.roles import WORKER_ROLES, Role, is_full_pipeline, route_for
from triptych.step_cache import MODES as STEP_CACHE_MODES
from triptych.tracing import Tracing
from triptych_head import migration, transfers, upkeep
from triptych_head.admission import AdmissionControl
from triptych_head.batcher import BatchingMetrics
from triptych_head.instances import WorkerInstance
from triptych_head.membership import Clock, Membership, Transport
from triptych_head.metrics import HeadMetrics
from triptych_head.queues import Dispatcher
from triptych_head.state import REJECTED, RESERVED_IN_IDS, ROLE_STATES, RequestRecord, RequestState, StagedPayload
from triptych_head.workload import WorkEstimator

log = logging.getLogger(__name__)

SHUTTING_DOWN = "the head is shutting down and takes no new requests; retry shortly (another head takes over)"


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


class HeadCore:
    def __init__(
        self,
        args: ServeArgs,
        transport: Transport,
        metrics: HeadMetrics | None = None,
        clock: Clock = time.monotonic,
        tracing: Tracing | None = None,
    ):
        self.args = args
        self.tracing = tracing  # None: requests are not traced (--otlp-endpoint; triptych.tracing)
        self.metrics = metrics or HeadMetrics()
        self.transport = transport
        self.clock = clock
        self.roles = deployed_roles(args)
        # Only --denoiser-urls: each request goes whole to one worker, which returns its pixels; no tensor
        # moves between workers, so the head sends no transfer_* message (triptych.roles.FULL_PIPELINE_ROLE).
        self.full_pipeline = is_full_pipeline(self.roles)
        self.topology = "full_pipeline" if self.full_pipeline else "disaggregated"
        ordered = [role for role in WORKER_ROLES if role in self.roles]
        self.membership = Membership(ordered, args.disagg_heartbeat_timeout, self.metrics, transport, clock)
        self.head_id = self.membership.head_id  # every message to a worker names it
        self.model_fingerprint = package_fingerprint(args.model_path)  # a worker with another model gets no work
        self.requests: dict[str, RequestRecord] = {}  # by the client's request id
        self.attempts: dict[str, RequestRecord] = {}  # the same records by the id workers know (wire_id)
        self.held_slots: dict[str, HeldSlot] = {}  # receive slots of ended requests, freed once their write is over
        self.workload = WorkEstimator()
        self.admission = AdmissionControl(args.max_queued_requests, self.metrics)  # the API admits against it
        self.batch_metrics = BatchingMetrics(self.metrics.registry) if args.enable_batching_metrics else None
        self.dispatcher = Dispatcher(self, ordered)
        self.load = upkeep.LoadTracker(ordered)
        self.pipeline_view: dict[str, Any] = {"roles": {}, "requests": []}  # replaced whole at each tick
        self.drain_deadline: float | None = None  # set by shut_down(); new requests are refused from then on
        self.drain_seconds = 0.0

    # --- inputs -----------------------------------------------------------------------------

    def on_frontend(self, client: bytes, body: Sequence[Any]) -> None:
        """A message from an API client of this head (Submit or Cancel)."""
        try:
            msg, _ = decode(body)
        except ProtocolError as exc:
            self._reject(client, exc.request_id or "", str(exc), 400)
            return
        self.on_client(client, msg)

    def on_client(self, client: bytes, msg: Any) -> None:
        """A decoded message from an API client: over the frontend socket, or from the head's own API
        (local_channel.py), which hands it over as it built it."""
        if isinstance(msg, Submit):
            self._submit(client, msg)
        elif isinstance(msg, Cancel):
            rec = self.requests.get(msg.request_id)
            if rec is not None:
                self.finish(rec, RequestState.CANCELLED, "cancelled by the client", status_code=499)
        else:
            self._reject(client, "", f"{msg.TYPE} is not a frontend message", 400)

    def on_worker(self, role: Role, parts: Sequence[Any]) -> None:
        """A message on `role`'s result socket: a heartbeat, or a step of one request's flow."""
        try:
            msg, frames = decode(parts)
        except ProtocolError as exc:
            self.metrics.dropped_messages.inc()
            rec = None if isinstance(exc, UnknownMessageType) else self.attempts.get(exc.request_id or "")
            if rec is None:
                log.warning("dropped undecodable message on the %s result socket: %s", role.value, exc)
            else:
                self.finish(rec, RequestState.FAILED, f"malformed message from a {role.value}: {exc}")
            return
        inst = self.membership.get(role, getattr(msg, "instance", ""))
        if inst is None:
            self.metrics.dropped_messages.inc()
            log.warning("dropped %s from unknown %s instance %r", msg.TYPE, role.value, getattr(msg, "instance", None))
            return
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(inst, msg)
            return
        handler = transfers.HANDLERS.get(type(msg))
        if handler is None:  # a message of the head's side, or the frontend's: it changes nothing
            self.metrics.dropped_messages.inc()
            log.warning("dropped %s from %s: not a worker message", msg.TYPE, inst.url)
            return
        rec = self.attempts.get(msg.request_id)
        if rec is None:
            self._on_late(inst, msg)
            return
        if rec.slot_addr and inst.url == rec.instance and rec.state is ROLE_STATES[rec.role][1] and not held(msg):
            free_standing(inst, rec.wire_id, rec.slot_addr)  # it reports, so it has loaded the slot
            rec.slot_addr = 0
        busy = bool(inst.inflight)
        try:
            handler(self, rec, inst, msg, frames)
        except Exception as exc:  # a bug or a misbehaving worker fails one request, never the loop
            log.exception("handling %s for %s", msg.TYPE, rec.wire_id)
            if self.attempts.get(rec.wire_id) is rec:
                self.finish(rec, RequestState.FAILED, f"internal error handling {msg.TYPE} from {inst.url}: {exc}")
        if inst.draining and busy and not inst.inflight:
            self.membership.ping(inst)  # its last request left it: acknowledge the drain now, not at the next tick

    def tick(self, discovered: Mapping[Role, Sequence[str]]) -> None:
        """Periodic upkeep (twice a second): membership as discovery lists it now, pings, lost
        workers, timeouts, load."""
        self.membership.sync(discovered)
        upkeep.tick(self, self.clock())

    def dispatch(self) -> None:
        """Give every queue's waiting requests to instances that can take them now."""
        self.dispatcher.dispatch_all()

    def hand_off(self, request_id: str) -> bool:
        """Ask the denoiser running the request to hand it to another at its next step boundary
        (migration.py); False when it is not denoising now."""
        rec = self.requests.get(request_id)
        return rec is not None and migration.ask_hand_off(self, rec, "asked")

    def shut_down(self, seconds: float) -> None:
        """Stop taking requests; in-flight ones have `seconds` to finish, then fail (503) and free
        their worker slots (see drained). A second call can only bring the deadline forward."""
        deadline = self.clock() + max(seconds, 0.0)
        if self.drain_deadline is None:
            self.drain_seconds = seconds
            self.drain_deadline = deadline
        else:
            self.drain_deadline = min(self.drain_deadline, deadline)

    @property
    def encodes_images(self) -> bool:
        """Some pool of this deployment encodes reference images: a full pipeline, an encoder or an image encoder."""
        return self.full_pipeline or any(role.runs_affinity(Role.IMAGE_ENCODER) for role in self.roles)

    def drain_expired(self) -> bool:
        """Shutting down, and the drain's time is over."""
        return self.drain_deadline is not None and self.clock() >= self.drain_deadline

    def drained(self) -> bool:
        """While shutting down: past the deadline fail what is left (releasing its slots); True once
        no request and no receive slot is held any more."""
        if self.drain_deadline is None:
            return False
        if self.drain_expired():
            reason = (
                f"the head shut down before this request finished (it had {self.drain_seconds:g}s to drain, "
                "--disagg-drain-timeout); its worker slots were released; retry it"
            )
            for rec in list(self.requests.values()):  # clients send them again to another head (its code)
                self.finish(rec, RequestState.FAILED, reason, status_code=503, code=HEAD_SHUT_DOWN)
            for rid in list(self.held_slots):
                self.release_held(rid)  # as at its own timeout: this head is going and would never free it
        return not self.requests and not self.held_slots

    # --- frontend ---------------------------------------------------------------------------

    def _reject(self, client: bytes, rid: str, error: str, status_code: int) -> None:
        self.transport.reply(client, RequestEvent(rid, REJECTED, error=error, status_code=status_code))

    def _submit(self, client: bytes, msg: Submit) -> None:
        rid = msg.request_id
        if not rid:
            self._reject(client, rid, "request_id must be non-empty", 400)
            return
        if self.drain_deadline is not None:
            self._reject(client, rid, SHUTTING_DOWN, 503)
            return
        if RESERVED_IN_IDS in rid:
            error = f"request_id {rid!r:.100} must not contain {RESERVED_IN_IDS!r} (the head's retry ids do)"
            self._reject(client, rid, error, 400)
            return
        if rid in self.requests:
            # The original request is untouched: only the duplicate's sender hears about it.
            self._reject(client, rid, f"request id {rid!r} is already active", 409)
            return
        if msg.params.has_reference and not self.encodes_images:
            error = "image: this deployment encodes no reference images (its head has no --image-encoder-urls)"
            self._reject(client, rid, error, 400)
            return
        now = self.clock()
        rec = RequestRecord(
            request_id=rid,
            params=msg.params,
            route=request_route(self.roles, msg.params),
            client=client,
            deadline=now + self.args.disagg_timeout,
            watch=msg.watch,
            preview_every=msg.preview_every if msg.watch else 0,
            created=now,
            hop_started=now,
            priority=msg.priority,
            held_level=msg.priority,
        )
        if self.tracing is not None:
            self._start_trace(rec)
        self.requests[rid] = rec
        self.attempts[rec.wire_id] = rec
        self.load.last_params = msg.params
        self.dispatcher.enter_hop(rec)

    def _start_trace(self, rec: RequestRecord) -> None:
        """The request's root span; its context goes to the workers with each hop (Work, TransferReady)."""
        assert self.tracing is not None
        try:
            route = ",".join(role.value for role in rec.route)
            attributes = {"triptych.request_id": rec.request_id, "triptych.route": route}
            rec.trace = self.tracing.start_request("request", time.time_ns(), attributes)
            rec.traceparent = self.tracing.traceparent(rec.trace)
        except Exception:  # tracing is an observer: it never fails a request
            log.exception("tracing request %s", rec.request_id)

    def _end_trace(self, rec: RequestRecord, state: RequestState, error: str | None) -> None:
        """A span per part of the request's timeline (each queue, stage and transfer) under its root."""
        assert self.tracing is not None
        try:
            now_ns = time.time_ns()
            spans = rec.timeline.spans(self.clock(), now_ns)
            failure = None if state is RequestState.DONE else f"{state.value}: {error or ''}"
            self.tracing.end_request(rec.trace, spans, now_ns, failure)
        except Exception:
            log.exception("tracing request %s", rec.request_id)
        rec.trace = None

    def event(
        self, rec: RequestRecord, step: int = 0, total: int = 0, preview: bytes = b"", preemption: str = ""
    ) -> None:
        """A watched request's state change or step, to its client; `preemption`: "suspended" or
        "resumed" (preemption.py)."""
        if rec.watch:
            role = rec.role.value if rec.state.hop_role_known else ""
            event = RequestEvent(
                rec.request_id, rec.state.value, step, total, preview=preview, role=role, preemption=preemption
            )
            self.transport.reply(rec.client, event)

    # --- workers ----------------------------------------------------------------------------

    def _on_heartbeat(self, inst: WorkerInstance, msg: Heartbeat) -> None:
        inst.via = msg.via  # even from a heartbeat naming another head: our next ping tells it we are here
        if msg.head_id and msg.head_id != self.membership.head_id:
            # It still serves a previous head; once our ping reaches it, it drops that head's work
            # and says so in its next heartbeat. Until then nothing is dispatched to it.
            return
        restarted = inst.last_heartbeat is not None and bool(inst.session) and msg.session != inst.session
        if restarted and self.holds_anything(inst.url):
            # A new process behind the same address (restarted before the previous one's heartbeats
            # were missed for long enough): what the previous one held went with it. Without this its
            # requests waited for --disagg-timeout, holding the new process's slots all along.
            reason = f"{inst.role.value} {inst.url} restarted (transfer session {inst.session} is now {msg.session})"
            self.instance_lost(inst, "session_mismatch", reason)
        newly_draining = msg.draining and not inst.draining
        if newly_draining:
            log.info("%s %s is draining: no new work goes to it", inst.role.value, inst.url)
        inst.on_heartbeat(
            self.clock(),
            msg.capacity,
            msg.session,
            msg.pool_bytes,
            msg.free_bytes,
            msg.model,
            msg.standing_bytes,
            msg.draining,
            msg.max_batch,
            msg.others_busy,
        )
        inst.adopt_standing(msg.standing_slots)
        inst.held, inst.peak_held = msg.held, msg.peak_held
        inst.open_files, inst.open_files_limit = msg.open_files, msg.open_files_limit
        inst.loras = frozenset(msg.loras)
        inst.devices, inst.dtype = msg.devices, msg.dtype
        if inst.role is Role.DENOISER:  # the denoiser's loads are what its work estimate counts; an encoder's are not
            # No load of its took longer than this head has known its process: a figure beyond that
            # (a bug, a forged heartbeat) would otherwise refuse every request naming an adapter.
            self.workload.observe_lora_load(min(msg.lora_load_s, inst.heard_for(self.clock())))
        self._check_topology(inst, msg)
        self._check_model(inst, msg)
        if newly_draining:
            migration.drain_by_migration(self)  # its running requests move now, not at the next tick

    def _on_late(self, inst: WorkerInstance, msg: Any) -> None:
        """A message of an attempt that ended: free what the worker still holds for it."""
        log.debug("late %s for finished request %s from %s", msg.TYPE, msg.request_id, inst.url)
        held = self.held_slots.get(msg.request_id)
        if held and held.sender == inst.url and isinstance(msg, (TransferPushed, Failed)):
            self.release_held(msg.request_id)
        if isinstance(msg, (TransferStaged, TransferAllocated)):
            self.membership.send(inst.url, CancelWork(msg.request_id, inst.url, self.head_id))

    def _check_topology(self, inst: WorkerInstance, msg: Heartbeat) -> None:
        """A full-pipeline worker behind a role-pool head, or a role worker behind a full-pipeline head,
        would return the wrong thing: it gets no work, and the head says why once."""
        inst.full_pipeline, inst.encoder_cache = msg.full_pipeline, msg.encoder_cache
        # Modes this head knows, once each: each is a labelled series in /metrics, which a name per
        # heartbeat (a bug, a forged message) would grow without end.
        inst.step_cache = tuple({s.mode: s for s in msg.step_cache if s.mode in STEP_CACHE_MODES}.values())
        wrong = msg.full_pipeline != self.full_pipeline
        if wrong and not inst.wrong_topology:
            worker = "runs the whole pipeline (--disagg-full-pipeline)" if msg.full_pipeline else "runs its role only"
            head = "lists only --denoiser-urls (a full-pipeline pool)" if self.full_pipeline else "routes through roles"
            log.error("%s %s %s but this head %s: it gets no work", inst.role.value, inst.url, worker, head)
        inst.wrong_topology = wrong

    def _check_model(self, inst: WorkerInstance, msg: Heartbeat) -> None:
        """A worker that loaded another package would compute another model's tensors: it gets no
        work, and the head says why once (the reference design: the same package on every process)."""
        mine, theirs = self.model_fingerprint, msg.model_fingerprint
        wrong = bool(mine and theirs and mine != theirs)
        if wrong and not inst.wrong_model:
            log.error(
                "%s %s serves model %s (fingerprint %s), not this head's %s (%s): it gets no work; "
                "start it with the same --model-path package", inst.role.value, inst.url, msg.model, theirs,
                self.args.model_path, mine,
            )  # fmt: skip
        inst.wrong_model = wrong

    def holds_anything(self, url: str) -> bool:
        """Whether some request (or a receive slot still being written) involves this worker."""
        return any(url in r.involved_instances() for r in self.requests.values()) or any(
            url in (h.sender, h.receiver) for h in self.held_slots.values()
        )

    # --- lost workers and retries -----------------------------------------------------------

    def instance_lost(self, inst: WorkerInstance, cause: str, reason: str) -> None:
        """A worker stopped responding or cannot be reached: retry what it held, forget its slots."""
        log.warning("%s", reason)
        inst.last_heartbeat = None
        inst.inflight.clear()
        inst.standing.clear()
        for rec, wire_id in [(r, r.wire_id) for r in self.requests.values() if inst.url in r.involved_instances()]:
            # Another worker found lost while an earlier request is retried (its re-dispatch failed) may
            # have retried or ended this one already: only the attempt that still involves `inst` is retried.
            if self.attempts.get(wire_id) is rec and inst.url in rec.involved_instances():
                self.retry(rec, inst, cause, reason)
        for wire_id in [w for w, held in self.held_slots.items() if held.sender == inst.url]:
            self.release_held(wire_id)  # a sender that is gone writes nothing more

    def unreachable(self, url: str | None, reason: str, rec: RequestRecord) -> None:
        """A send to `url` failed: that worker is lost (what it held is retried); one that is no
        longer known fails `rec` alone."""
        inst = self.membership.find(url or "")
        if inst is None:
            self.finish(rec, RequestState.FAILED, reason, status_code=503)
        else:
            self.instance_lost(inst, "disconnected", reason)

    def sender_unreachable(self, rec: RequestRecord) -> None:
        assert rec.staged is not None
        self.unreachable(rec.staged.sender, f"sender {rec.staged.sender} is unreachable; its output is lost", rec)

    def retry(
        self, rec: RequestRecord, lost: WorkerInstance, cause: str, reason: str, outputs_kept: bool = True
    ) -> None:
        """Carry on without `lost`: the same hop with another receiver while the sender still holds
        the outputs (nothing was written yet, and `outputs_kept`), else the whole route again as a
        new attempt. The seed is in the parameters, so a retried request gives the same pixels."""
        if rec.retries >= self.args.disagg_max_retries:
            self.finish(
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
            self.dispatcher.requeue(rec)
            return
        log.info("request %s: %s; restarting it (retry %d)", rec.request_id, reason, rec.retries)
        self.dispatcher.leave_group(rec)
        self._release(rec)
        del self.attempts[rec.wire_id]
        rec.restart()
        self.attempts[rec.wire_id] = rec
        self.dispatcher.enter_hop(rec, ahead=True)

    # --- endings ----------------------------------------------------------------------------

    def release_held(self, wire_id: str) -> None:
        held = self.held_slots.pop(wire_id)
        receiver = self.membership.find(held.receiver)
        if receiver is not None and held.standing_addr:
            free_standing(receiver, wire_id, held.standing_addr)
        self.membership.send(held.receiver, CancelWork(wire_id, held.receiver, self.head_id))

    def _release(self, rec: RequestRecord) -> None:
        """Free everything the current attempt of `rec` holds on any worker (CancelWork)."""
        wire_id = rec.wire_id
        for url in rec.involved_instances():
            inst = self.membership.find(url)
            if inst is not None:
                inst.inflight.discard(wire_id)
            if rec.push_in_flight and rec.staged and url == rec.instance:
                # The sender may be writing into this slot right now: freeing it could hand the
                # bytes of a late write to another request. Free it once the sender reports.
                until = self.clock() + 2 * self.membership.heartbeat_timeout
                self.held_slots[wire_id] = HeldSlot(rec.staged.sender, url, until, rec.slot_addr)
                continue
            if url == rec.instance and rec.slot_addr and inst is not None:
                free_standing(inst, wire_id, rec.slot_addr)
            self.membership.send(url, CancelWork(wire_id, url, self.head_id))

    def message_too_large(self, rec: RequestRecord, exc: HeaderTooLarge, outputs: StagedPayload | None = None) -> None:
        """A message for `rec` came out over the control header limit (codec.HeaderTooLarge) and was
        not sent: its worker would have dropped it unread, and the request waited for its timeout.
        It fails now, alone, naming what made it too large: the request's parameters (413: the
        client's to shorten), or the manifest/meta of the `outputs` a sender staged for the next
        role (500). What it holds is released as for any failure. Only on this path are the parts
        encoded again, to measure them."""
        params = len(msgspec.msgpack.encode(rec.wire_params()))
        if outputs is None:
            why = f"the request's parameters are too large ({params} bytes: its prompts, or an inlined reference image)"
            self.finish(rec, RequestState.FAILED, f"{exc}: {why}", status_code=413)
            return
        manifest, meta = len(msgspec.msgpack.encode(outputs.manifest)), len(msgspec.msgpack.encode(outputs.meta))
        sender = self.membership.find(outputs.sender)
        source = f"the {sender.role.value}'s" if sender is not None else "its sender's"
        sizes = f"manifest {manifest} bytes, meta {meta} bytes, the request's parameters {params} bytes"
        if params > manifest + meta:
            self.finish(rec, RequestState.FAILED, f"{exc}: the request's parameters are too large ({sizes})", 413)
        else:
            self.finish(rec, RequestState.FAILED, f"{exc}: {source} outputs manifest/meta is too large ({sizes})")

    def finish(
        self, rec: RequestRecord, state: RequestState, error: str | None = None, status_code: int = 500, code: str = ""
    ) -> None:
        """End a request: release what it holds on every worker, tell its client, forget it; `code`:
        the error's code in the client's answer ("": the state's name)."""
        if rec.state is not state:
            rec.move(state)
        if state is RequestState.DONE:
            for url in rec.involved_instances():
                if (inst := self.membership.find(url)) is not None:
                    inst.inflight.discard(rec.wire_id)
        else:
            self.dispatcher.leave_group(rec)
            self._release(rec)
        self.requests.pop(rec.request_id, None)
        self.attempts.pop(rec.wire_id, None)
        if rec.trace is not None and self.tracing is not None:
            self._end_trace(rec, state, error)
        self.metrics.child(self.metrics.requests, state.value).inc()
        if state is RequestState.DONE:
            self.metrics.request_seconds.observe(self.clock() - rec.created)
            return
        log.info("request %s %s: %s", rec.request_id, state.value, error)
        ended = RequestEvent(rec.request_id, state.value, error=error, status_code=status_code, code=code)
        self.transport.reply(rec.client, ended)


def held(msg: Any) -> bool:
    """A report during a stage that uses its inputs in place: its standing slot is still busy."""
    return isinstance(msg, Progress) and msg.inputs_held


def free_standing(inst: WorkerInstance, wire_id: str, addr: int) -> None:
    """The standing slot at `addr` no longer holds `wire_id`'s input."""
    slot = inst.standing.get(addr)
    if slot is not None and slot.holder == wire_id:
        slot.holder = None
