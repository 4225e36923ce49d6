"""Per-role queues and dispatch: which waiting request goes to which instance, and what is sent.

A request waits in its current role's queue until the role's policy (dispatch.py) finds an
instance that can take it; with --batching-mode dynamic, compatible requests leave together
(batcher.py). Each queue is kept in decreasing priority level, first come first served within a
level, and served in that order (preemption.py, which also suspends a running denoise for a
waiting one of higher priority). A request with staged outputs is given a receiver: a free
standing receive slot that fits (the fast path: TransferPush at once), else TransferAlloc; a
suspended request whose own denoiser has a slot again resumes there (TransferReady in_place); a
request at its first role gets Work.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from triptych.protocol import (
    BatchResized,
    HeaderTooLarge,
    TransferAlloc,
    TransferPush,
    TransferReady,
    Work,
    WorkBatch,
)
from triptych.roles import ROLE_SPECS, Role
from triptych_head import migration, preemption
from triptych_head.batcher import Group, GroupBatcher
from triptych_head.dispatch import Eligible, dispatch_lora_affinity, make_policy
from triptych_head.instances import WorkerInstance
from triptych_head.state import ROLE_STATES, BatchTag, RequestRecord, RequestState

if TYPE_CHECKING:
    from triptych_head.core import HeadCore


class Dispatcher:
    def __init__(self, core: HeadCore, roles: Sequence[Role]):
        self._core = core
        self._membership = core.membership
        args = core.args
        self.queues: dict[Role, deque[str]] = {role: deque() for role in roles}
        # One per role: a round-robin cursor shared by roles of different sizes would keep landing on
        # the same instance of one of them (one encoder and two denoisers: always the second denoiser).
        self._policies = {role: make_policy(args.disagg_dispatch_policy) for role in roles}
        self.batcher: GroupBatcher | None = None
        if args.batching_mode == "dynamic":
            self.batcher = GroupBatcher(
                args.batching_max_size,
                args.batching_delay_ms / 1000,
                core.batch_metrics,
                {role: ms / 1000 for role, ms in args.role_batching_delays_ms().items()},
            )

    def enter_hop(self, rec: RequestRecord, ahead: bool = False) -> None:
        """Queue `rec` for its current role; `ahead`: before the others of its level (a retry was
        accepted earlier, a continuation was running)."""
        rec.move(ROLE_STATES[rec.role][0])
        rec.batch = None  # the group of its last hop, if any, runs without it
        rec.hop_started = self._core.clock()
        self._core.event(rec)
        self._put(rec, ahead)
        if len(self.queues[rec.role]) == 1:  # nothing waited ahead of it: dispatched now, not at the loop turn's end
            self.dispatch_queue(rec.role)
        if rec.instance is None and rec.role is Role.DENOISER:
            preemption.preempt(self._core)  # it waits: a lower priority's denoise may make room

    def requeue(self, rec: RequestRecord) -> None:
        """Back to the front of its level in its role's queue: its receiver refused or was lost; its
        sender still holds it."""
        self.leave_group(rec)  # the rest of its group, if any, runs without it
        self._put(rec, ahead=True)

    def leave_group(self, rec: RequestRecord) -> None:
        """`rec` will not reach the receiver its hop's group went to (it stays queued, is requeued,
        restarted or ended): when a member's TransferReady already counted it, the receiver is told
        the group's size now (BatchResized), rather than wait its assembly time for it."""
        tag, rec.batch = rec.batch, None
        if tag is not None and (size := tag.resized()) is not None:
            self._membership.send(tag.instance, BatchResized(tag.batch_id, tag.instance, size, self._core.head_id))

    def _put(self, rec: RequestRecord, ahead: bool) -> None:
        level = self._level(rec.request_id)
        preemption.place(self.queues[rec.role], rec.request_id, level, self._level, ahead)

    def _level(self, rid: str) -> int:
        """The effective priority level of a queued request (a stale entry's is its last; it is skipped anyway)."""
        rec = self._core.requests.get(rid)
        if rec is None:
            return 0
        return preemption.effective_level(rec, self._core.clock(), self._core.args.disagg_priority_aging)

    def reorder(self) -> None:
        """Re-sort every queue by level as the waits have grown (aging; upkeep calls it)."""
        for queue in self.queues.values():
            preemption.reorder(queue, self._level)

    def waiting(self, role: Role) -> list[RequestRecord]:
        """The requests waiting in `role`'s queue, in the order they are served."""
        return [rec for rid in self.queues[role] if (rec := self._queued(role, rid)) is not None]

    def dispatch_all(self) -> None:
        for role in self.queues:
            self.dispatch_queue(role)

    def dispatch_queue(self, role: Role) -> None:
        """Dispatch `role`'s queue in order until its first request finds no instance, passing over
        the requests parked there (`parked`)."""
        absent = self.absent_roles()
        if self.batcher is not None:
            self._dispatch_groups(role, self.batcher, absent)
            return
        queue = self.queues[role]
        passed = 0  # the parked entries at the queue's front
        while len(queue) > passed:
            rid = queue[passed]
            if (rec := self._queued(role, rid)) is not None and parked(rec, absent):
                passed += 1
                continue
            if not self._dispatch_one(role, rid):
                break
            # Its own entry, not the first now: a retry during its dispatch may have queued another ahead.
            queue.remove(rid)

    def absent_roles(self) -> frozenset[Role]:
        """The roles only some requests visit (the image encoder: edits) with no ready instance now
        (none registered, or all draining or silent). A role every request needs parks nobody: they
        would all wait for it anyway."""
        ready, instances = self._membership.ready, self._membership.instances
        return frozenset(
            r for r in self.queues if ROLE_SPECS[r].needs_reference and not any(ready(i) for i in instances(r))
        )

    def _queued(self, role: Role, rid: str) -> RequestRecord | None:
        """The request behind a queue entry, or None for a stale entry (ended, restarted elsewhere in
        its route, or already dispatched)."""
        rec = self._core.requests.get(rid)
        if rec is None or rec.state.terminal or rec.role is not role or rec.instance is not None:
            return None
        return rec

    def _dispatch_groups(self, role: Role, batcher: GroupBatcher, absent: frozenset[Role]) -> None:
        """--batching-mode dynamic: send the groups of `role`'s queue that are ready (batcher.py),
        each to one instance; what an instance has no room for stays queued, as do parked requests."""
        queue = self.queues[role]
        queued: list[RequestRecord] = []
        gone: list[str] = []  # one per entry to drop: the stale ones, then one per dispatched request
        for rid in queue:
            rec = self._queued(role, rid)
            if rec is None:
                gone.append(rid)
            elif not parked(rec, absent):
                queued.append(rec)
        instances = [i for i in self._membership.instances(role) if self._membership.ready(i)]
        room = max((i.batch_room for i in instances), default=0)
        now = self._core.clock()
        for members in batcher.ready_groups(queued, room, now, batcher.delay_for(role)):
            staged = members[0].staged  # compatible: the same size for all
            nbytes, avoid = (staged.nbytes, staged.sender) if staged else (0, "")
            eligible = functools.partial(self._can_take, nbytes=nbytes, avoid=avoid)
            inst = self._choose(role, members[0], instances, eligible)
            if inst is None:
                break
            group = Group(inst, members[: inst.batch_room])
            tag = BatchTag(group.batch_id, group.members, inst.url) if len(group.members) > 1 else None
            for rec in group.members:
                rec.batch = tag  # before its dispatch: an in-place resume's TransferReady goes at once
                if self._dispatch_one(role, rec.request_id, group):
                    gone.append(rec.request_id)
            for rec in group.members:
                if rec.instance != inst.url:
                    self.leave_group(rec)  # it stayed queued (or failed): the others do not wait for it
            if group.work and not self._send_work(group):
                break
            batcher.observe_sent(role.value, group, now)
        # One entry each, not every entry of that id: a member whose Work found its instance gone was
        # retried and queued again meanwhile, and that new entry stays.
        for rid in gone:
            queue.remove(rid)

    def _choose(
        self, role: Role, rec: RequestRecord, instances: Sequence[WorkerInstance], eligible: Eligible
    ) -> WorkerInstance | None:
        """The role's policy; for the denoising role, a request's LoRA adapters first (dispatch.py)."""
        if role is Role.DENOISER and rec.params.loras:
            loras = frozenset(lora.name for lora in rec.params.loras)
            return dispatch_lora_affinity(self._policies[role], instances, eligible, loras)
        return self._policies[role](instances, eligible)

    def _can_take(self, inst: WorkerInstance, nbytes: int, avoid: str = "", here: str = "") -> bool:
        """Ready with room; never `avoid`, the sender (a continuation goes to another denoiser). `here`
        holds the request's suspended state: it needs a free slot only, no room in its pool."""
        if inst.url == avoid or not self._membership.ready(inst):
            return False
        return inst.free_slots > 0 if inst.url == here else inst.can_take(nbytes)

    def _send_work(self, group: Group) -> bool:
        """A group's first-role work as one message (a single request as plain Work). A group over the
        control header limit goes as one Work each (`group.apart`: its members run apart), and a
        request whose own Work is over it fails alone (_send). False when the instance is not connected."""
        inst = group.instance
        if len(group.work) > 1:
            try:
                sent = self._membership.send(inst.url, WorkBatch(inst.url, group.work, self._core.head_id))
            except HeaderTooLarge:
                group.apart = True
            else:
                return sent or self._disconnected(inst)
        return all(self._send_alone(inst, work) for work in group.work)

    def _send_alone(self, inst: WorkerInstance, work: Work) -> bool:
        """One request's Work, as a request in no batch: a group of one, or a member of a group that
        went apart. False when the instance is not connected."""
        rec = self._core.attempts[work.request_id]  # dispatched just now
        rec.batch = None
        sent = self._send(rec, inst.url, work)
        return sent is not False or self._disconnected(inst)  # None: too large, it failed alone

    def _disconnected(self, inst: WorkerInstance) -> bool:
        self._core.instance_lost(inst, "disconnected", f"{inst.role.value} {inst.url} is not connected")
        return False

    def _send(self, rec: RequestRecord, url: str, msg: Work | TransferReady) -> bool | None:
        """membership.send for a message carrying the request's parameters (and a TransferReady, the
        manifest/meta of its staged outputs); None when it came out over the control header limit and
        the request failed instead: its worker would have dropped it unread (HeadCore.message_too_large)."""
        try:
            return self._membership.send(url, msg)
        except HeaderTooLarge as exc:
            self._core.message_too_large(rec, exc, rec.staged)
            return None

    def _too_large(self, role: Role, rec: RequestRecord, nbytes: int) -> bool:
        """Fail a request whose staged payload fits no known instance's transfer pool."""
        known = [i for i in self._membership.instances(role) if self._membership.alive(i) and i.pool_bytes]
        if not known or any(nbytes <= i.pool_bytes for i in known):
            return False
        largest = max(i.pool_bytes for i in known)
        self._core.finish(
            rec,
            RequestState.FAILED,
            f"payload of {nbytes} bytes exceeds --disagg-transfer-pool-size of every {role.value} "
            f"({largest} bytes); raise it on the {role.value} workers",
            status_code=413,
        )
        return True

    def _dispatch_one(self, role: Role, rid: str, group: Group | None = None) -> bool:
        """Give the request at the head of `role`'s queue to an instance; False if none can take it.
        With `group`: to the group's instance, and a first role's Work goes into `group.work`."""
        rec = self._queued(role, rid)
        if rec is None:
            return True
        core, wire_id = self._core, rec.wire_id
        nbytes = rec.staged.nbytes if rec.staged else 0
        if rec.staged and self._too_large(role, rec, nbytes):
            return True
        avoid = migration.sender_to_avoid(rec) if rec.staged else ""
        here = rec.staged.sender if rec.staged and rec.suspended_at is not None else ""
        eligible = functools.partial(self._can_take, nbytes=nbytes, avoid=avoid, here=here)
        if group is not None:
            inst = group.instance if eligible(group.instance) else None
        elif here and (own := self._membership.find(here)) is not None and eligible(own):
            inst = own  # a suspended request resumes where its state is when that denoiser has a slot
        else:
            inst = self._choose(role, rec, self._membership.instances(role), eligible)
        if inst is None:
            return False
        started = core.clock()  # before the send, so the hop's time contains all the instance's work
        waited = started - rec.hop_started
        level = preemption.effective_level(rec, started, core.args.disagg_priority_aging)  # its place on the worker
        if rec.staged and migration.resumes_in_place(rec, inst):
            # Resume where it stopped: its state is in this denoiser's pool already; nothing moves.
            staged = rec.staged
            ready = rec.transfer_ready(staged, inst.url, 0, core.head_id, level, in_place=True)
            sent = self._send(rec, inst.url, ready)
            if sent is None:
                return True  # failed: too large to send
            if sent:
                rec.staged = None  # moved to RUNNING below, as a first hop's Work is
                rec.hop_resumed = True
        elif rec.staged and inst.session and (addr := inst.free_standing_slot(nbytes)) is not None:
            # Transfer flow step 2, fast path: a standing slot fits, so no transfer_alloc round trip.
            sender = rec.staged.sender
            push = TransferPush(
                wire_id, sender, inst.session, addr, core.head_id, slot_bytes=inst.standing[addr].nbytes
            )
            if not self._membership.send(sender, push):
                core.sender_unreachable(rec)
                return True
            inst.standing[addr].holder = wire_id
            rec.slot_addr, rec.push_in_flight = addr, True
            sent = True
        elif rec.staged:
            standing = inst.should_make_standing(nbytes)
            alloc = TransferAlloc(wire_id, inst.url, nbytes, standing=standing, head_id=core.head_id)
            sent = self._membership.send(inst.url, alloc)
        else:
            work = Work(
                wire_id, inst.url, rec.wire_params(), rec.watch, rec.preview_every, core.head_id, rec.traceparent, level
            )
            if group is not None:
                group.work.append(work)  # sent with the rest of the group (_send_work)
                sent = True
            else:
                sent = self._send(rec, inst.url, work)
                if sent is None:
                    return True  # failed: too large to send
        if not sent:  # not connected any more: treat it as gone until it heartbeats again
            core.instance_lost(inst, "disconnected", f"{role.value} {inst.url} is not connected")
            return False
        inst.inflight.add(wire_id)
        inst.dispatched_total += 1
        rec.instance = inst.url
        preemption.note_dispatch(rec, waited, started, core.args.disagg_priority_aging)
        rec.hop_started = started
        if not rec.staged:
            rec.move(ROLE_STATES[role][1])
            core.event(rec)
            preemption.resumed(core, rec)  # a suspended request resuming in place (a no-op for any other)
        core.metrics.child(core.metrics.queue_seconds, role.value).observe(waited)
        rec.timeline.add(f"queue-{role.value}", started - waited, started)
        return True


def parked(rec: RequestRecord, absent: frozenset[Role]) -> bool:
    """A request that has not started its route and whose later roles include one with no ready
    instance that only some requests visit (`absent`: Dispatcher.absent_roles) waits where it is,
    passed over by the rest: started, its outputs would hold this role's slot until that pool came
    back, ahead of requests that do not need it (text-to-image behind edits while no image encoder
    runs). The absent role's pending work still counts it, so an autoscaler wakes that pool, and
    --disagg-no-instance-wait fails it as if it waited there."""
    return bool(absent) and rec.staged is None and any(role in absent for role in rec.remaining_roles()[1:])
