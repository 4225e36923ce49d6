"""The head's decision core with no socket: a recording Transport, a hand-moved clock, and
simulated workers that answer its messages as the protocol says.

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
    CancelWork,
    Failed,
    Heartbeat,
    Ping,
    RequestEvent,
    RequestResult,
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
    computing: set[str] = field(default_factory=set)  # request ids whose stages it runs now
    staged: set[str] = field(default_factory=set)  # request ids whose outputs it holds for a push
    reserved: dict[int, str] = field(default_factory=dict)  # allocated receive slot -> the request it is for
    kept: set[int] = field(default_factory=set)  # standing slots: kept for the head, which assigns them
    content: dict[int, str] = field(default_factory=dict)  # slot -> whose bytes were written into it last
    peak_computing: int = 0

    def heartbeat(self, head_id: str = "") -> Heartbeat:
        return Heartbeat(self.url, self.role.value, self.session, POOL_BYTES, POOL_BYTES, CAPACITY, "m")

    def start(self, rid: str) -> None:
        self.computing.add(rid)
        self.peak_computing = max(self.peak_computing, len(self.computing))
        if len(self.computing) > CAPACITY:
            raise SlotViolation(f"{self.url} computes {sorted(self.computing)}: more than its {CAPACITY} slots")

    def drop(self, rid: str) -> None:
        self.computing.discard(rid)
        self.staged.discard(rid)
        for addr, holder in list(self.reserved.items()):
            if holder == rid:
                del self.reserved[addr]


class Harness:
    """A HeadCore over simulated workers; `deliver` hands one worker's answer back to the core."""

    def __init__(self, counts: dict[Role, int], flags: Sequence[str] = ()):
        self.clock = FakeClock()
        self.transport = RecordingTransport()
        self.workers: dict[str, SimWorker] = {}
        argv = ["serve", "--model-path", "m", "--disagg-role", "server", *flags]
        port = itertools.count(41000)
        for role, n in counts.items():
            urls = [f"tcp://127.0.0.1:{next(port)}" for _ in range(n)]
            argv += [f"{role.flag_prefix}urls", ";".join(urls)]
            for url in urls:
                self.workers[url] = SimWorker(role, url, session=f"session-{url[-5:]}")
        self.args = ServeArgs.from_namespace(build_parser().parse_args(argv))
        self.core = HeadCore(self.args, self.transport, clock=self.clock)
        self._addr = itertools.count(0x1000, 0x100)
        self.pending: list[tuple[str, Any]] = []  # what the workers were sent and have not handled yet
        self.answers: list[tuple[Role, Any, str]] = []  # what the workers said and the head has not read yet
        self.core.membership.sync(self.discovered())
        self.tick()

    # --- driving the core ---------------------------------------------------------------------

    def discovered(self) -> dict[Role, list[str]]:
        by_role: dict[Role, list[str]] = {}
        for w in self.workers.values():
            by_role.setdefault(w.role, []).append(w.url)
        return by_role

    def tick(self) -> None:
        """Live workers heartbeat, then the core's upkeep runs."""
        for w in self.workers.values():
            if w.alive:
                self.core.on_worker(w.role, encode(w.heartbeat()))
        self.core.tick(self.discovered())
        self.core.dispatch()
        self.collect()

    def submit(self, rid: str, client: bytes = b"client", **params: Any) -> None:
        from triptych.params import GenerationParams

        submit = Submit(rid, GenerationParams(**{**PARAMS, **params}))
        self.core.on_frontend(client, encode(submit))
        self.collect()

    def cancel(self, rid: str, client: bytes = b"client") -> None:
        from triptych.protocol import Cancel

        self.core.on_frontend(client, encode(Cancel(rid)))
        self.collect()

    def collect(self) -> None:
        """Move what the core sent into the workers' inboxes (pings are answered by tick)."""
        for url, msg in self.transport.take():
            if not isinstance(msg, Ping):
                self.pending.append((url, msg))

    def deliver(self, index: int = 0) -> None:
        """The worker the index-th pending message went to handles its oldest one (a socket is FIFO)."""
        url = self.pending[index][0]
        index = next(i for i, (u, _) in enumerate(self.pending) if u == url)
        _, msg = self.pending.pop(index)
        worker = self.workers[url]
        if worker.alive:
            self._handle(worker, msg)

    def fail(self, index: int) -> bool:
        """The worker the index-th pending message went to fails its oldest one, if that is a
        stage to run (Work or TransferReady): it frees what it held for it and says Failed."""
        url = self.pending[index][0]
        index = next(i for i, (u, _) in enumerate(self.pending) if u == url)
        msg = self.pending[index][1]
        worker = self.workers[url]
        if not isinstance(msg, (Work, TransferReady)) or not worker.alive:
            return False
        del self.pending[index]
        worker.drop(msg.request_id)
        self.said(worker.role, Failed(msg.request_id, url, "simulated stage error"), url)
        return True

    def answer(self, index: int = 0) -> None:
        """The head reads the oldest answer of the worker that sent the index-th one."""
        url = self.answers[index][2]
        index = next(i for i, (_, _, u) in enumerate(self.answers) if u == url)
        role, msg, _ = self.answers.pop(index)
        self.core.on_worker(role, encode(msg))
        self.core.dispatch()
        self.collect()

    def said(self, role: Role, msg: Any, url: str) -> None:
        self.answers.append((role, msg, url))

    # --- the workers' side of the protocol --------------------------------------------------

    def _handle(self, w: SimWorker, msg: Any) -> None:
        if isinstance(msg, WorkBatch):
            for item in msg.items:
                self._handle(w, item)
        elif isinstance(msg, Work):
            w.start(msg.request_id)
            self._finish_stage(w, msg.request_id)
        elif isinstance(msg, TransferAlloc):
            addr = next(self._addr)
            if msg.standing:
                w.kept.add(addr)
            else:
                w.reserved[addr] = msg.request_id
            self.said(w.role, TransferAllocated(msg.request_id, w.url, w.session, addr, standing=msg.standing), w.url)
        elif isinstance(msg, TransferPush):
            self._write(w, msg)
        elif isinstance(msg, TransferReady):
            self._load(w, msg)
        elif isinstance(msg, CancelWork):
            w.drop(msg.request_id)
        else:
            raise AssertionError(f"{w.url} got an unexpected {msg.TYPE}")

    def _finish_stage(self, w: SimWorker, rid: str) -> None:
        rec = self.core.attempts.get(rid)
        last = rec is not None and rec.last_hop and rec.role is w.role
        w.computing.discard(rid)
        if last:
            self.said(w.role, WorkerResult(rid, w.url, [], 0.01), w.url)
        else:
            w.staged.add(rid)
            self.said(w.role, TransferStaged(rid, w.url, NBYTES, [], {}, 0.01), w.url)

    def _write(self, sender: SimWorker, push: TransferPush) -> None:
        """The sender's Mooncake write into the receiver's slot: a slot the receiver still has, and
        (an allocated one) reserved for this request."""
        rid = push.request_id
        receiver = next(w for w in self.workers.values() if w.session == push.dest_session)
        if rid not in sender.staged:
            raise SlotViolation(f"{sender.url} was told to push {rid}, whose outputs it does not hold")
        addr = push.dest_addr
        if receiver.alive:
            if addr not in receiver.kept and receiver.reserved.get(addr) != rid:
                holder = receiver.reserved.get(addr)
                raise SlotViolation(f"{rid}'s bytes written into {receiver.url} slot {addr:#x}, which holds {holder!r}")
            receiver.content[addr] = rid
        sender.staged.discard(rid)
        self.said(sender.role, TransferPushed(rid, sender.url, NBYTES, 0.001), sender.url)

    def _load(self, w: SimWorker, ready: TransferReady) -> None:
        """The receiver loads its input: the bytes in the slot must be this request's (unless the
        head has ended it meanwhile: its CancelWork follows, and nothing it computes is used)."""
        rid = ready.request_id
        addr = ready.slot_addr or next((a for a, h in w.reserved.items() if h == rid), None)
        live = rid in self.core.attempts
        if live and (addr is None or w.content.get(addr) != rid):
            found = w.content.get(addr) if addr is not None else None
            raise SlotViolation(f"{w.url} loaded {found!r}'s bytes as {rid}'s input (slot {addr})")
        if addr is not None:
            w.reserved.pop(addr, None)  # loaded: an allocated slot goes back to the pool, a kept one stays
            if w.content.get(addr) == rid:
                w.content.pop(addr)
        w.start(rid)
        self._finish_stage(w, rid)

    # --- what the tests assert ----------------------------------------------------------------

    def endings(self) -> dict[str, list[Any]]:
        """Each request's terminal replies (RequestResult, or a RequestEvent in a terminal state)."""
        out: dict[str, list[Any]] = {}
        for _, msg in self.transport.replies:
            if isinstance(msg, RequestResult) or (isinstance(msg, RequestEvent) and msg.state in TERMINAL_STATES):
                out.setdefault(msg.request_id, []).append(msg)
        return out

    def check_ledger(self) -> None:
        """The head's own ledger: no instance above its capacity, no standing slot held by two
        requests, every standing slot's holder a live attempt or a slot still being written."""
        core = self.core
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

    def check_idle(self) -> None:
        """Nothing is held anywhere once every request ended."""
        core = self.core
        assert not core.requests and not core.attempts, sorted(core.requests)
        assert not core.held_slots, core.held_slots
        for inst in core.membership.all():
            assert not inst.inflight, (inst.url, inst.inflight)
            assert all(s.holder is None for s in inst.standing.values()), (inst.url, inst.standing)

    def state(self, rid: str) -> RequestState:
        return self.core.requests[rid].state

    def refuse_next_alloc(self) -> bool:
        """The first pending TransferAlloc that is its worker's oldest message is answered with a
        (non-fatal) refusal instead; False when there is none."""
        for i, (url, msg) in enumerate(self.pending):
            if isinstance(msg, TransferAlloc):
                if any(u == url for u, _ in self.pending[:i]):
                    continue  # not this worker's oldest message
                del self.pending[i]
                w = self.workers[url]
                self.said(w.role, TransferRefused(msg.request_id, url, "no room", fatal=False), url)
                return True
        return False


def decoded(parts: list[bytes]) -> Any:
    return decode(parts)[0]
