"""What the head knows about each worker instance, learned from its heartbeats."""

from __future__ import annotations

from dataclasses import dataclass, field

from triptych.protocol import EncoderCacheStats, StepCacheStats
from triptych.roles import Role
from triptych.standing import room_for_standing


@dataclass
class StandingSlot:
    nbytes: int
    holder: str | None = None


@dataclass
class WorkerInstance:
    """One worker endpoint (tcp://HOST:PORT) of one role."""

    url: str
    role: Role
    capacity: int = 0
    inflight: set[str] = field(default_factory=set)  # request ids holding one of its scheduling slots
    session: str | None = None
    pool_bytes: int = 0
    free_bytes: int = 0
    standing_bytes: int = 0
    model: str = ""
    last_heartbeat: float | None = None
    session_since: float | None = None  # when this head first heard its current session (process)
    # Set when it refused an allocation for lack of room; cleared by its next heartbeat, which the
    # worker sends whenever it frees pool space (and once a second), so the head retries then.
    refused_bytes: int | None = None
    dispatched_total: int = 0
    # Standing receive slots it keeps for the head: address -> (bytes, request id holding it or None).
    standing: dict[int, StandingSlot] = field(default_factory=dict)
    draining: bool = False  # it got SIGTERM: it finishes what it holds, takes nothing new, then exits
    leaving: bool = False  # discovery no longer lists it (scaled down, not Ready): nothing new goes to it
    # A write to it failed: it may have died. Nothing new goes to it until its next heartbeat says otherwise.
    suspect: bool = False
    max_batch: int = 1  # the most requests it runs as one batch (its --batching-max-size)
    devices: int = 1  # the devices its stages run on (its --num-gpus): what a second of its stages costs
    dtype: str = ""  # what its model computes in (its --dtype); "" for a simulated worker
    full_pipeline: bool = False  # it runs every stage and returns pixels (--disagg-full-pipeline)
    # It runs the whole pipeline and the head routes through role pools, or the reverse: it never gets work.
    wrong_topology: bool = False
    wrong_model: bool = False  # its package is not the head's (another fingerprint): it never gets work
    encoder_cache: EncoderCacheStats | None = None  # its prompt-embedding cache, as of its last heartbeat
    step_cache: tuple[StepCacheStats, ...] = ()  # its step caches per mode, as of its last heartbeat
    loras: frozenset[str] = frozenset()  # the LoRA adapters it holds loaded, as of its last heartbeat
    via: str = ""  # the endpoint its heartbeats reach this head by (echoed in pings)
    # Scheduling slots it holds for other heads (it serves several); a WorkRefused counts it full
    # until its next heartbeat.
    others_busy: int = 0
    held: int = 0  # requests holding one of its slots, for every head (its heartbeat's word)
    peak_held: int = 0  # the most it ever held at once (its heartbeat's word)
    open_files: int = 0  # descriptors its process has open, and its soft limit (0: none or not reported)
    open_files_limit: int = 0

    def alive(self, now: float, heartbeat_timeout: float) -> bool:
        return self.last_heartbeat is not None and now - self.last_heartbeat <= heartbeat_timeout

    def ready(self, now: float, heartbeat_timeout: float) -> bool:
        """Alive and taking new work: not draining, still listed by discovery."""
        return self.alive(now, heartbeat_timeout) and not (
            self.draining or self.leaving or self.suspect or self.wrong_topology or self.wrong_model
        )

    @property
    def free_slots(self) -> int:
        return max(self.capacity - len(self.inflight) - self.others_busy, 0)

    @property
    def batch_room(self) -> int:
        """The largest group it can take now: its free slots, at most one batch of its own size."""
        return min(self.free_slots, self.max_batch)

    def holds(self, loras: frozenset[str]) -> bool:
        """Whether it holds every one of these LoRA adapters loaded (a request naming them skips the loads)."""
        return loras <= self.loras

    def can_take(self, nbytes: int = 0) -> bool:
        """A free scheduling slot and, for a transfer, no recent refusal for this size."""
        if self.free_slots <= 0:
            return False
        return self.refused_bytes is None or nbytes < self.refused_bytes

    def free_standing_slot(self, nbytes: int) -> int | None:
        """The address of an idle standing slot that fits `nbytes` (the smallest such), or None."""
        fits = [(s.nbytes, addr) for addr, s in self.standing.items() if s.holder is None and s.nbytes >= nbytes]
        return min(fits)[1] if fits else None

    def should_make_standing(self, nbytes: int) -> bool:
        """Keep a new slot as standing while that still leaves room to stage outputs and one more slot."""
        return room_for_standing(len(self.standing), self.capacity, self.pool_bytes, nbytes)

    def adopt_standing(self, slots: tuple[tuple[int, int], ...]) -> None:
        """Its standing slots as its heartbeat lists them: the ones this head does not know yet (reserved
        at its start-up, or anew for this head) become idle and this head's to assign, at most its
        capacity in all; an idle one it no longer lists is forgotten (a held one stays until its
        request lets it go; the worker lists it again if it kept it), so the table is never more
        than what the worker holds."""
        listed = dict(slots)
        for addr in [a for a, slot in self.standing.items() if slot.holder is None and a not in listed]:
            del self.standing[addr]
        for addr, nbytes in listed.items():
            if len(self.standing) >= self.capacity:
                break
            if addr not in self.standing:
                self.standing[addr] = StandingSlot(nbytes)

    def heard_for(self, now: float) -> float:
        """Seconds since this head first heard its current process (0 before any heartbeat)."""
        return 0.0 if self.session_since is None else now - self.session_since

    def on_heartbeat(
        self,
        now: float,
        capacity: int,
        session: str,
        pool_bytes: int,
        free_bytes: int,
        model: str,
        standing_bytes: int = 0,
        draining: bool = False,
        max_batch: int = 1,
        others_busy: int = 0,
    ) -> None:
        if session != self.session:
            self.standing.clear()  # a new process behind the same address: its slots are new too
            self.session_since = now
        self.draining = draining
        self.suspect = False
        self.capacity, self.session, self.pool_bytes, self.model = capacity, session, pool_bytes, model
        self.refused_bytes = None
        self.free_bytes, self.standing_bytes = free_bytes, standing_bytes
        self.max_batch = max_batch
        self.others_busy = others_busy
        self.last_heartbeat = now
