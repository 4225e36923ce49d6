"""The request state machine (docs/design.md, "Request state machine"), enforced in one place.

PENDING -> ENCODER_WAITING -> ENCODER_RUNNING -> ENCODER_DONE -> DENOISING_WAITING -> ...
-> DECODER_RUNNING -> DONE; any non-terminal state -> FAILED, TIMED_OUT or CANCELLED.
With split encoders a request passes the ENCODER_* states once per encoder hop. A request
whose worker is lost is retried: any non-terminal state -> PENDING, as a new attempt. A
full-pipeline pool's request has one hop: PENDING -> DENOISING_WAITING -> DENOISING_RUNNING -> DONE.
A first hop's Work that a worker refuses (it serves several heads and is full) goes from RUNNING
back to WAITING, and so does a denoising request handed off to another denoiser at a step
boundary (migration.py): DENOISING_RUNNING -> DENOISING_WAITING at the same hop.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from triptych.params import GenerationParams
from triptych.priority import DEFAULT_LEVEL
from triptych.protocol import TransferReady
from triptych.roles import ROLE_SPECS, Role, is_full_pipeline
from triptych_head.timeline import Timeline


class RequestState(enum.StrEnum):
    PENDING = "PENDING"
    ENCODER_WAITING = "ENCODER_WAITING"
    ENCODER_RUNNING = "ENCODER_RUNNING"
    ENCODER_DONE = "ENCODER_DONE"
    DENOISING_WAITING = "DENOISING_WAITING"
    DENOISING_RUNNING = "DENOISING_RUNNING"
    DENOISING_DONE = "DENOISING_DONE"
    DECODER_WAITING = "DECODER_WAITING"
    DECODER_RUNNING = "DECODER_RUNNING"
    DONE = "DONE"
    FAILED = "FAILED"
    TIMED_OUT = "TIMED_OUT"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def hop_role_known(self) -> bool:
        """A hop's WAITING, RUNNING or DONE state (not PENDING, not an ending): the request is at a role."""
        return self is not RequestState.PENDING and not self.terminal


RESERVED_IN_IDS = "~"  # a retry's wire id is "<request id>~retry<N>": no request id may contain it
REJECTED = "REJECTED"  # the state a reply to a request the head refused to take carries (not a request state)

TERMINAL = frozenset({RequestState.DONE, RequestState.FAILED, RequestState.TIMED_OUT, RequestState.CANCELLED})

_S = RequestState
_FORWARD: dict[RequestState, frozenset[RequestState]] = {
    # A full-pipeline pool's one hop is the denoiser's, which ends the request (triptych.roles.FULL_PIPELINE_ROLE).
    _S.PENDING: frozenset({_S.ENCODER_WAITING, _S.DENOISING_WAITING}),
    _S.ENCODER_WAITING: frozenset({_S.ENCODER_RUNNING}),
    # Back to waiting: a worker serving several heads refused the Work (WorkRefused); another takes it.
    _S.ENCODER_RUNNING: frozenset({_S.ENCODER_DONE, _S.ENCODER_WAITING}),
    # A second encoder hop (prompt_encoder -> image_encoder) re-enters ENCODER_WAITING.
    _S.ENCODER_DONE: frozenset({_S.DENOISING_WAITING, _S.ENCODER_WAITING}),
    _S.DENOISING_WAITING: frozenset({_S.DENOISING_RUNNING}),
    _S.DENOISING_RUNNING: frozenset({_S.DENOISING_DONE, _S.DONE, _S.DENOISING_WAITING}),
    _S.DENOISING_DONE: frozenset({_S.DECODER_WAITING}),
    _S.DECODER_WAITING: frozenset({_S.DECODER_RUNNING}),
    _S.DECODER_RUNNING: frozenset({_S.DONE}),
}


def _hop_states(group: str) -> tuple[RequestState, RequestState, RequestState]:
    done = _S.DONE if group == "DECODER" else RequestState[f"{group}_DONE"]  # the last hop ends the request
    return RequestState[f"{group}_WAITING"], RequestState[f"{group}_RUNNING"], done


# The (waiting, running, done) states a hop to `role` passes through, named by the role descriptor.
ROLE_STATES: dict[Role, tuple[RequestState, RequestState, RequestState]] = {
    role: _hop_states(spec.stage_states) for role, spec in ROLE_SPECS.items()
}


class InvalidTransition(RuntimeError):
    pass


def check_transition(current: RequestState, target: RequestState) -> None:
    """Raise InvalidTransition unless the request state machine (docs/design.md) allows current -> target."""
    if current.terminal:
        raise InvalidTransition(f"request already {current.value}; cannot move to {target.value}")
    if target in (_S.FAILED, _S.TIMED_OUT, _S.CANCELLED, _S.PENDING):  # PENDING: retried from the start
        return
    if target not in _FORWARD.get(current, frozenset()):
        raise InvalidTransition(f"{current.value} -> {target.value} is not a transition of the request state machine")


@dataclass
class StagedPayload:
    """Tensors a sender holds in its transfer buffer, waiting for a receiver."""

    sender: str
    nbytes: int
    manifest: list[dict[str, Any]]
    meta: dict[str, Any]
    staged_at: float = field(default_factory=time.monotonic)
    continues_at: int | None = None  # a denoising continuation: the step the next denoiser starts at


@dataclass(eq=False)
class BatchTag:
    """The group a later role's hop was dispatched in, to one instance, which runs its members as one
    batch once `batch_size` of them have arrived (batcher.py). The size is counted as each member's
    TransferReady goes out, not when the group formed: a member that stayed queued, was requeued or
    ended meanwhile is not waited for, nor one the instance has already run (a member leaves the tag
    when it enters its next hop, Dispatcher.enter_hop)."""

    batch_id: str
    members: list[RequestRecord]
    instance: str  # the receiver the group went to
    announced: int = 0  # the largest size a member's TransferReady has carried (0: none went out)

    def on_wire(self) -> tuple[str, int]:
        """(batch_id, batch_size) for a member's message; ("", 1) when it is the only one left."""
        size = self._size()
        self.announced = max(self.announced, size)
        return (self.batch_id, size) if size > 1 else ("", 1)

    def resized(self) -> int | None:
        """After a member left: the group's size now when a TransferReady already went out saying more (the
        receiver would wait its assembly time for the member that left); else None."""
        size = self._size()
        if self.announced <= max(size, 1):
            return None
        self.announced = size
        return size

    def _size(self) -> int:
        return sum(1 for m in self.members if m.batch is self and not m.state.terminal)


@dataclass
class RequestRecord:
    """Everything the head knows about one in-flight request."""

    request_id: str
    params: GenerationParams
    route: list[Role]
    client: bytes
    deadline: float
    watch: bool = False  # the client asked for every state change and denoising step
    preview_every: int = 0  # with watch: a preview image every k denoising steps (0: none)
    step: int = 0  # the last denoising step reported (watched requests only)
    total_steps: int = 0
    state: RequestState = RequestState.PENDING
    hop: int = 0
    instance: str | None = None  # the worker running (or receiving) the current hop
    staged: StagedPayload | None = None
    slot_addr: int = 0  # the receiver's standing slot this request's transfer uses (0: an allocated one)
    batch: BatchTag | None = None  # the group its current hop was dispatched in (batcher.py)
    push_in_flight: bool = False  # the sender was told to write into the receiver's slot and has not reported back
    created: float = field(default_factory=time.monotonic)
    hop_started: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)
    device_seconds: float = 0.0  # its stages' time times their instances' devices, hop by hop (transfers.py)
    timeline: Timeline = field(default_factory=Timeline)  # its parts, for Server-Timing and its trace
    trace: Any = None  # its root span when the head traces requests (triptych.tracing)
    traceparent: str = ""  # that span's W3C traceparent, carried to the workers in Work and TransferReady
    hand_off_from: str | None = None  # the denoiser last asked to hand it off (migration.py)
    hand_off_reason: str = ""  # why: "drain", "asked", or "preempt" (preemption.py)
    migrations: int = 0  # how many times its denoising moved to another denoiser
    hop_resumed: bool = False  # its current hop runs a continuation: the rest of a loop, not a sample of its work
    priority: int = DEFAULT_LEVEL  # triptych.priority's level, as submitted (0 low, 1 normal, 2 high)
    waited_s: float = 0.0  # seconds it waited in queues before its current hop's dispatch (aging, preemption.py)
    held_level: int = DEFAULT_LEVEL  # its effective level at its current hop's dispatch (what preemption compares)
    suspended_at: float | None = None  # its denoising was suspended for a higher priority then and has not resumed
    suspensions: int = 0  # how many times its denoising was suspended
    attempt: int = 0  # how many times it was restarted after losing a worker
    retries: int = 0  # restarts plus hops given to another receiver after losing one

    @property
    def wire_id(self) -> str:
        """The id workers know this attempt by: a late message of an earlier attempt never matches it."""
        return self.request_id if self.attempt == 0 else f"{self.request_id}{RESERVED_IN_IDS}retry{self.attempt}"

    @property
    def role(self) -> Role:
        return self.route[self.hop]

    def wire_params(self) -> GenerationParams:
        """The request as the current hop's role gets it: an inlined reference image travels only
        to the role that encodes it (a full-pipeline worker encodes it too), not on to the denoiser and decoder."""
        if self.params.image is None or self.role.runs_affinity(Role.IMAGE_ENCODER) or self.whole_pipeline:
            return self.params
        return msgspec.structs.replace(self.params, image=None)

    def wire_batch(self) -> tuple[str, int]:
        """(batch_id, batch_size) for its current hop's TransferReady: ("", 1) in no group."""
        return self.batch.on_wire() if self.batch is not None else ("", 1)

    def transfer_ready(
        self, staged: StagedPayload, receiver: str, slot_addr: int, head_id: str, level: int, in_place: bool = False
    ) -> TransferReady:
        """Transfer flow step 6: `receiver` runs its stages on `staged`, landed at `slot_addr` (or, `in_place`,
        on the continuation it staged itself), at priority `level`."""
        return TransferReady(
            self.wire_id, receiver, self.wire_params(), staged.manifest, staged.meta, slot_addr, self.watch,
            self.preview_every, *self.wire_batch(), head_id, self.traceparent, in_place=in_place, priority=level,
            edit=self.params.has_reference,
        )  # fmt: skip

    @property
    def whole_pipeline(self) -> bool:
        """Its one hop runs every stage (a full-pipeline pool) and returns its pixels."""
        return is_full_pipeline(self.route)

    @property
    def last_hop(self) -> bool:
        return self.hop + 1 >= len(self.route)

    @property
    def receiver_reserved(self) -> bool:
        """Staged output with an instance chosen for it: a receive slot is reserved or being reserved."""
        return self.staged is not None and self.instance is not None

    def move(self, target: RequestState) -> None:
        check_transition(self.state, target)
        self.state = target

    def restart(self) -> None:
        """Back to the first hop as a new attempt (its outputs so far were lost with a worker)."""
        self.move(RequestState.PENDING)
        self.attempt += 1
        self.hop = 0
        self.instance = None
        self.staged = None
        self.slot_addr = 0
        self.push_in_flight = False
        self.hop_resumed = False
        self.batch = None
        self.hand_off_from = None
        self.suspended_at = None

    def remaining_roles(self) -> list[Role]:
        """The roles whose hop this request has not finished: the current one and those after it."""
        return self.route[self.hop :]

    def involved_instances(self) -> set[str]:
        """Workers that may hold state for this request (running it, staging for it, or a slot)."""
        out = {self.instance} if self.instance else set()
        if self.staged:
            out.add(self.staged.sender)
        return out
