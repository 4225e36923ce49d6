"""The head's decision core with no socket: a recording Transport, a hand-moved clock, and
simulated workers that answer its messages as the protocol says; with `heads` > 1, several cores
(replicated heads) share the workers, which refuse what they have no slot for and release what a
dead head held, as a worker serving several heads does.

The simulated workers also keep their own ledger of the receive slots and scheduling slots the
head gave them, so a test can assert the slot-safety invariants from the workers' side: never
two requests' bytes in one slot, never a write into a slot freed or given to another request,
never more requests computing on a worker than its capacity.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from triptych.cli import build_parser
from triptych.config import ServeArgs
from triptych.protocol import (
    BatchResized,
    CancelWork,
    Failed,
    HandOff,
    Heartbeat,
    Ping,
    RequestEvent,
    RequestResult,
    StepCacheStats,
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
    WorkRefused,
    decode,
    encode,
)
from triptych.protocol import Result as WorkerResult
from triptych.roles import Role
from triptych_head.core import HeadCore
from triptych_head.state import TERMINAL, RequestState

PARAMS = {"prompt": "x", "width": 16, "height": 16}
CAPACITY = 2
POOL_BYTES = 1 << 20
NBYTES = 4096
TERMINAL_STATES = {s.value for s in TERMINAL} | {"REJECTED"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordingTransport:
    """Every message the core sends, in order; `down` URLs are not connected (send returns False)."""

    def __init__(self) -> None:
        self.outbox: list[tuple[str, Any]] = []
        self.replies: list[tuple[bytes, Any]] = []
        self.down: set[str] = set()
        self.opened: set[str] = set()

    def open(self, url: str) -> str | None:
        self.opened.add(url)
        return None

    def close(self, url: str) -> None:
        self.opened.discard(url)

    def send(self, url: str, msg: Any) -> bool:
        if url in self.down:
            return False
        self.outbox.append((url, msg))
        return True

    def reply(self, client: bytes, msg: Any, frames: Sequence[Any] = ()) -> None:
        self.replies.append((client, msg))

    def take(self) -> list[tuple[str, Any]]:
        sent, self.outbox = self.outbox, []
        return sent


class SlotViolation(AssertionError):
    pass


@dataclass
class SimWorker:
    """One worker as the protocol has it, with its own view of its slots."""

    role: Role
    url: str
    session: str
    alive: bool = True
    owner: dict[str, str] = field(default_factory=dict)  # request id -> the head it came from
    fingerprint: str = ""  # its model package's (heartbeats report it)
    computing: set[str] = field(default_factory=set)  # request ids whose stages it runs now
    staged: set[str] = field(default_factory=set)  # request ids whose outputs it holds for a push
    continuations: set[str] = field(default_factory=set)  # of those, states at a step boundary: no slot held
    reserved: dict[int, str] = field(default_factory=dict)  # allocated receive slot -> the request it is for
    kept: set[int] = field(default_factory=set)  # standing slots: kept for the head, which assigns them
    content: dict[int, str] = field(default_factory=dict)  # slot -> whose bytes were written into it last
    peak_computing: int = 0
    # HandOff received: the request's stages stop at their next step boundary (all at once, here)
    # and stage a continuation; the test decides when it arrives (`deliver` keeps a link's order).
    handing_off: set[str] = field(default_factory=set)
    capacity: int = CAPACITY
    # Its stages run until the test ends them (Harness.finish) or a HandOff stops them at their next
    # step; otherwise a stage ends as soon as it starts.
    hold: bool = False
    max_batch: int = 1  # its --batching-max-size, which it heartbeats
    devices: int = 1  # its --num-gpus, which it heartbeats
    step_cache: tuple[StepCacheStats, ...] = ()  # its step caches' counts, which it heartbeats
    resized: list[BatchResized] = field(default_factory=list)  # the groups the head said lost members

    def held(self) -> set[str]:
        """Requests holding one of its scheduling slots (computing, outputs staged, a slot reserved): a
        suspended request's state holds none (runtime.Worker._held_requests)."""
        return self.computing | (self.staged - self.continuations) | set(self.reserved.values())

    def heartbeat(self, head_id: str = "") -> Heartbeat:
        # Slots held for other heads; a worker serving one head (head_id "") reports none, as runtime does.
        others = sum(1 for r in self.held() if self.owner.get(r) != head_id) if head_id else 0
        return Heartbeat(
            self.url, self.role.value, self.session, POOL_BYTES, POOL_BYTES, self.capacity, "m",
            head_id=head_id, others_busy=others, held=len(self.held()), model_fingerprint=self.fingerprint,
            max_batch=self.max_batch, devices=self.devices, step_cache=self.step_cache,
        )  # fmt: skip

    def start(self, rid: str) -> None:
        self.computing.add(rid)
        self.peak_computing = max(self.peak_computing, len(self.computing))
        if len(self.computing) > self.capacity:
            raise SlotViolation(f"{self.url} computes {sorted(self.computing)}: more than its {self.capacity} slots")

    def check_capacity(self) -> None:
        if len(self.held()) > self.capacity:
            raise SlotViolation(f"{self.url} holds {sorted(self.held())}: more than its {self.capacity} slots")

    def drop(self, rid: str) -> None:
        self.computing.discard(rid)
        self.staged.discard(rid)
        self.continuations.discard(rid)
        for addr, holder in list(self.reserved.items()):
            if holder == rid:
                del self.reserved[addr]


class Harness:
    """HeadCores (one, or several replicated heads) over simulated workers; `deliver` hands a
    worker one head's message, `answer` hands that head the worker's reply."""

    def __init__(
        self,
        counts: dict[Role, int],
        flags: Sequence[str] = (),
        heads: int = 1,
        capacity: dict[Role, int] | None = None,
        hold: frozenset[Role] = frozenset(),
    ):
        """`capacity`: slots of each role's workers (default CAPACITY); `hold`: roles whose stages run
        until Harness.finish or a HandOff."""
        self.clock = FakeClock()
        self.workers: dict[str, SimWorker] = {}
        argv = ["serve", "--model-path", "m", "--disagg-role", "server", *flags]
        port = itertools.count(41000)
        for role, n in counts.items():
            urls = [f"tcp://127.0.0.1:{next(port)}" for _ in range(n)]
            argv += [f"{role.flag_prefix}urls", ";".join(urls)]
            for url in urls:
                slots = (capacity or {}).get(role, CAPACITY)
                self.workers[url] = SimWorker(role, url, f"session-{url[-5:]}", capacity=slots, hold=role in hold)
        self.args = ServeArgs.from_namespace(build_parser().parse_args(argv))
        self.transports = [RecordingTransport() for _ in range(heads)]
        self.cores = [HeadCore(self.args, t, clock=self.clock) for t in self.transports]
        self.core, self.transport = self.cores[0], self.transports[0]
        self.dead: set[str] = set()  # head ids of killed heads
        self.several = heads > 1  # the workers serve several heads: no standing slots, refusals when full
        self._addr = itertools.count(0x1000, 0x100)
        self.pending: list[tuple[str, Any]] = []  # what the workers were sent and have not handled yet
        self.answers: list[tuple[Role, Any, str, str]] = []  # (role, message, worker, head id) not read yet
        for core in self.cores:
            core.membership.sync(self.discovered())
        self.tick()

    def core_of(self, head_id: str) -> HeadCore:
        return next(c for c in self.cores if c.head_id == head_id)

    # --- driving the cores --------------------------------------------------------------------

    def discovered(self) -> dict[Role, list[str]]:
        by_role: dict[Role, list[str]] = {}
        for w in self.workers.values():
            by_role.setdefault(w.role, []).append(w.url)
        return by_role

    def live_cores(self) -> list[HeadCore]:
        return [c for c in self.cores if c.head_id not in self.dead]

    def tick(self) -> None:
        """Live workers heartbeat to every live head, then each head's upkeep runs. A worker's leader
        handles every message waiting on its socket before it heartbeats: a live worker is never
        seconds behind on what a head sent it."""
        while waiting := [i for i, (url, _) in enumerate(self.pending) if self.workers[url].alive]:
            self.deliver(waiting[0])
        for core in self.live_cores():
            for w in self.workers.values():
                if w.alive:
                    core.on_worker(w.role, encode(w.heartbeat(core.head_id if self.several else "")))
            core.tick(self.discovered())
            core.dispatch()
        self.collect()

    def kill_head(self, index: int) -> None:
        """SIGKILL of one head: what it sent and was sent is lost; the workers, hearing no ping from
        it, release all they hold for it."""
        head = self.cores[index].head_id
        self.dead.add(head)
        self.pending = [(u, m) for u, m in self.pending if m.head_id != head]
        self.answers = [a for a in self.answers if a[3] != head]
        for w in self.workers.values():
            for rid in [r for r, h in w.owner.items() if h == head]:
                w.drop(rid)
                for addr in [a for a, r in w.content.items() if r == rid]:
                    del w.content[addr]

    def submit(
        self, rid: str, client: bytes = b"client", head: int = 0, priority: int = 1, watch: bool = False,
        **params: Any,
    ) -> None:  # fmt: skip
        from triptych.params import GenerationParams

        submit = Submit(rid, GenerationParams(**{**PARAMS, **params}), watch=watch, priority=priority)
        self.cores[head].on_frontend(client, encode(submit))
        self.collect()

    def cancel(self, rid: str, client: bytes = b"client") -> None:
        from triptych.protocol import Cancel

        for core in self.live_cores():
            if rid in core.requests:
                core.on_frontend(client, encode(Cancel(rid)))
        self.collect()

    def collect(self) -> None:
        """Move what the cores sent into the workers' inboxes (pings are answered by tick)."""
        for core, transport in zip(self.cores, self.transports, strict=True):
            sent = transport.take()
            if core.head_id not in self.dead:
                self.pending += [(url, msg) for url, msg in sent if not isinstance(msg, Ping)]

    def _oldest(self, index: int) -> int:
        """The index of the oldest pending message on the link (head -> worker) of the index-th one."""
        url, msg = self.pending[index]
        return next(i for i, (u, m) in enumerate(self.pending) if u == url and m.head_id == msg.head_id)

    def deliver(self, index: int = 0) -> None:
        """The worker the index-th pending message went to handles the oldest one its head sent (a
        connection is FIFO)."""
        url, msg = self.pending.pop(self._oldest(index))
        worker = self.workers[url]
        if worker.alive:
            self._handle(worker, msg)
            if self.several:
                worker.check_capacity()

    def fail(self, index: int) -> bool:
        """The worker the index-th pending message went to fails the oldest one on that link, if that
        is a stage to run (Work or TransferReady): it frees what it held for it and says Failed."""
        index = self._oldest(index)
        url, msg = self.pending[index]
        worker = self.workers[url]
        if not isinstance(msg, (Work, TransferReady)) or not worker.alive:
            return False
        del self.pending[index]
        worker.owner[msg.request_id] = msg.head_id
        worker.drop(msg.request_id)
        self.said(worker, Failed(msg.request_id, url, "simulated stage error"))
        return True

    def answer(self, index: int = 0) -> None:
        """The head reads the oldest answer on the link (worker -> head) of the index-th one."""
        _, _, url, head = self.answers[index]
        index = next(i for i, a in enumerate(self.answers) if a[2] == url and a[3] == head)
        role, msg, _, _ = self.answers.pop(index)
        core = self.core_of(head)
        core.on_worker(role, encode(msg))
        core.dispatch()
        self.collect()

    def said(self, w: SimWorker, msg: Any) -> None:
        """`w` reports on a request to the head it came from."""
        head = w.owner.get(msg.request_id, self.core.head_id)
        if head not in self.dead:
            self.answers.append((w.role, msg, w.url, head))

    # --- the workers' side of the protocol --------------------------------------------------

    def _full(self, w: SimWorker) -> bool:
        return self.several and len(w.held()) >= w.capacity  # its own --worker-capacity, as runtime.Worker._full

    def _handle(self, w: SimWorker, msg: Any) -> None:
        if isinstance(msg, WorkBatch):
            for item in msg.items:
                self._handle(w, item)
            return
        if hasattr(msg, "request_id") and not isinstance(msg, CancelWork):
            w.owner[msg.request_id] = msg.head_id
        if isinstance(msg, Work):
            if self._full(w):
                self.said(w, WorkRefused(msg.request_id, w.url, "every slot taken"))
                return
            w.start(msg.request_id)
            if not w.hold:
                self._finish_stage(w, msg.request_id)
        elif isinstance(msg, TransferAlloc):
            held = next((addr for addr, rid in w.reserved.items() if rid == msg.request_id), None)
            if held is not None:  # asked again (a retried hop): the slot it holds, as slots.allocate answers
                self.said(w, TransferAllocated(msg.request_id, w.url, w.session, held, standing=held in w.kept))
                return
            if self._full(w):
                self.said(w, TransferRefused(msg.request_id, w.url, "every slot taken", fatal=False))
                return
            addr = next(self._addr)
            standing = msg.standing and not self.several
            if standing:
                w.kept.add(addr)
            w.reserved[addr] = msg.request_id  # held until it is loaded (a standing slot stays kept)
            self.said(w, TransferAllocated(msg.request_id, w.url, w.session, addr, standing=standing))
        elif isinstance(msg, TransferPush):
            self._write(w, msg)
        elif isinstance(msg, TransferReady):
            self._load(w, msg)
        elif isinstance(msg, CancelWork):
            if w.owner.get(msg.request_id, msg.head_id) == msg.head_id:
                w.drop(msg.request_id)
        elif isinstance(msg, BatchResized):
            w.resized.append(msg)  # its stages run each request as it loads: nothing waits for a group here
        elif isinstance(msg, HandOff):
            if not w.hold:
                w.handing_off.add(msg.request_id)
            elif msg.request_id in w.computing:  # its loop reaches the next step boundary
                w.handing_off.add(msg.request_id)
                self._finish_stage(w, msg.request_id)  # (one that ended before is not asked: as a worker)
        else:
            raise AssertionError(f"{w.url} got an unexpected {msg.TYPE}")

    def _finish_stage(self, w: SimWorker, rid: str) -> None:
        core = self.core_of(w.owner.get(rid, self.core.head_id))
        rec = core.attempts.get(rid)
        last = rec is not None and rec.last_hop and rec.role is w.role
        w.computing.discard(rid)
        if rid in w.handing_off:  # stopped before step 1 of its loop: another denoiser runs the rest
            w.handing_off.discard(rid)
            w.staged.add(rid)
            w.continuations.add(rid)
            self.said(w, TransferStaged(rid, w.url, NBYTES, [], {"resume": {"step": 1}}, 0.01, continues_at=1))
        elif last:
            self.said(w, WorkerResult(rid, w.url, [], 0.01))
        else:
            w.staged.add(rid)
            self.said(w, TransferStaged(rid, w.url, NBYTES, [], {}, 0.01))

    def _write(self, sender: SimWorker, push: TransferPush) -> None:
        """The sender's Mooncake write into the receiver's slot: a slot the receiver still has, and
        reserved for this request (a standing one: whichever request the head assigned it to)."""
        rid = push.request_id
        receiver = next(w for w in self.workers.values() if w.session == push.dest_session)
        if rid not in sender.staged:
            raise SlotViolation(f"{sender.url} was told to push {rid}, whose outputs it does not hold")
        if push.slot_bytes < NBYTES:  # every push names its slot's size, which holds the outputs
            raise SlotViolation(f"{rid} pushed into a slot of {push.slot_bytes} bytes, not its {NBYTES}")
        addr = push.dest_addr
        if receiver.alive:
            if addr not in receiver.kept and receiver.reserved.get(addr) != rid:
                holder = receiver.reserved.get(addr)
                raise SlotViolation(f"{rid}'s bytes written into {receiver.url} slot {addr:#x}, which holds {holder!r}")
            receiver.content[addr] = rid
        sender.staged.discard(rid)
        sender.continuations.discard(rid)
        self.said(sender, TransferPushed(rid, sender.url, NBYTES, 0.001))

    def _load(self, w: SimWorker, ready: TransferReady) -> None:
        """The receiver loads its input: the bytes in the slot must be this request's (unless the
        head has ended it meanwhile: its CancelWork follows, and nothing it computes is used)."""
        rid = ready.request_id
        if ready.in_place:  # its own continuation, still staged here: nothing was written
            if rid not in w.staged:
                raise SlotViolation(f"{w.url} told to resume {rid} in place, but it holds no continuation of it")
            w.staged.discard(rid)
            w.continuations.discard(rid)
            w.start(rid)
            if not w.hold:
                self._finish_stage(w, rid)
            return
        addr = ready.slot_addr or next((a for a, h in w.reserved.items() if h == rid), None)
        live = rid in self.core_of(ready.head_id).attempts
        if live and (addr is None or w.content.get(addr) != rid):
            found = w.content.get(addr) if addr is not None else None
            raise SlotViolation(f"{w.url} loaded {found!r}'s bytes as {rid}'s input (slot {addr})")
        if addr is not None:
            if w.reserved.get(addr) == rid:
                del w.reserved[addr]  # loaded: the slot is free again (a standing one stays kept)
            if w.content.get(addr) == rid:
                w.content.pop(addr)
        w.start(rid)
        if not w.hold:
            self._finish_stage(w, rid)

    def finish(self, rid: str) -> None:
        """The held stage computing `rid` ends (its outputs staged, or its pixels returned)."""
        w = next(w for w in self.workers.values() if rid in w.computing)
        self._finish_stage(w, rid)

    # --- what the tests assert ----------------------------------------------------------------

    def endings(self) -> dict[str, list[Any]]:
        """Each request's terminal replies (RequestResult, or a RequestEvent in a terminal state), from every head."""
        out: dict[str, list[Any]] = {}
        for transport in self.transports:
            for _, msg in transport.replies:
                if isinstance(msg, RequestResult) or (isinstance(msg, RequestEvent) and msg.state in TERMINAL_STATES):
                    out.setdefault(msg.request_id, []).append(msg)
        return out

    def check_ledger(self) -> None:
        """Each live head's own ledger: no instance above its capacity, no standing slot held by two
        requests, every standing slot's holder a live attempt or a slot still being written; and no
        worker holding more than its capacity, whichever heads its requests came from."""
        for core in self.live_cores():
            live = set(core.attempts) | set(core.held_slots)
            seen: dict[tuple[str, int], str] = {}
            for inst in core.membership.all():
                if len(inst.inflight) > max(inst.capacity, 0):
                    raise SlotViolation(f"{inst.url} holds {sorted(inst.inflight)} in {inst.capacity} slots")
                for addr, slot in inst.standing.items():
                    if slot.holder is not None and slot.holder not in live:
                        raise SlotViolation(f"{inst.url} standing slot {addr:#x} leaked to ended {slot.holder}")
            for rec in core.attempts.values():
                if rec.slot_addr and rec.instance:
                    key = (rec.instance, rec.slot_addr)
                    if key in seen:
                        raise SlotViolation(f"{rec.wire_id} and {seen[key]} both in slot {key}")
                    seen[key] = rec.wire_id
        if self.several:  # a worker serving several heads enforces its capacity itself (one head: its ledger does)
            for w in self.workers.values():
                w.check_capacity()

    def check_idle(self) -> None:
        """Nothing is held anywhere once every request ended: not by a live head, not on a worker."""
        for core in self.live_cores():
            assert not core.requests and not core.attempts, sorted(core.requests)
            assert not core.held_slots, core.held_slots
            for inst in core.membership.all():
                assert not inst.inflight, (inst.url, inst.inflight)
                assert all(s.holder is None for s in inst.standing.values()), (inst.url, inst.standing)
        for w in self.workers.values():
            if w.alive:
                assert not w.held(), (w.url, w.held())

    def state(self, rid: str) -> RequestState:
        return self.core.requests[rid].state

    def refuse_next_alloc(self) -> bool:
        """The first pending TransferAlloc that is the oldest on its link is answered with a
        (non-fatal) refusal instead; False when there is none."""
        for i, (url, msg) in enumerate(self.pending):
            if isinstance(msg, TransferAlloc) and self._oldest(i) == i:
                del self.pending[i]
                w = self.workers[url]
                w.owner[msg.request_id] = msg.head_id
                self.said(w, TransferRefused(msg.request_id, url, "no room", fatal=False))
                return True
        return False


def decoded(parts: list[bytes]) -> Any:
    return decode(parts)[0]
