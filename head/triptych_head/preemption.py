"""Priority and preemption: the order a role's queue is dispatched in, and which running denoise is
suspended for a waiting request of higher priority (docs/design.md, "Priority and preemption").

Order. A waiting request's effective level is its priority (triptych.priority: low 0, normal 1,
high 2) plus one for every --disagg-priority-aging seconds it has waited in queues so far, over all
its hops and suspensions. Each role's queue is kept in decreasing effective level (queues.py),
first come first served within a level; upkeep re-sorts it as waits grow. A request's level only
rises while it waits, so after (2 - its priority + 1) x aging seconds of waiting it is ahead of
every request that has just arrived: none starves.

Preemption (--disagg-preemption on, no dynamic batching). When a request waits for a denoiser and
no ready denoiser has a free slot, the head asks a running denoise of a lower priority to hand off
at its next step boundary (HandOff; migration.py): of those whose level when dispatched (their
effective level then, aging included) is below the waiting request's effective level, the lowest.
Both must hold: requests of one priority never suspend each other (no time slicing among equals),
an aged request never suspends one of a higher priority (it goes first when a slot frees), and a
request dispatched at an aged level is not suspended by newer requests it outranked then; so a
low request waits at most until (2 - 0 + 1) aging periods have passed and then the requests
already running finish. One victim per waiting request: hand-offs already asked for count against
the waiting requests, highest first. A request in a batch, or already moving, is never a victim.

Suspension. The denoiser stages the request's state (TransferStaged with `continues_at`) and keeps
it in its pool; the head frees that scheduling slot at once and queues the request again at its own
level, behind the request it was suspended for, which takes the slot (the queue is served in order:
nothing behind a waiting request passes it). The suspended request resumes on whichever denoiser
has a slot for it first: the one holding its state resumes it in place (TransferReady `in_place`,
nothing moves), another receives it through the transfer flow (a migration). Its client hears
"suspended" and "resumed" (RequestEvent.preemption).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from triptych.roles import Role
from triptych_head import migration
from triptych_head.instances import WorkerInstance
from triptych_head.state import RequestRecord

if TYPE_CHECKING:
    from triptych_head.core import HeadCore

log = logging.getLogger(__name__)

PREEMPT = "preempt"  # the hand-off reason of a suspension
SUSPENDED, RESUMED = "suspended", "resumed"  # RequestEvent.preemption


MAX_AGED_LEVEL = 2**31  # what a Work message carries at most (messages.AgedLevel): ~2000 years of aging at 30 s


def aged(priority: int, waited_s: float, aging_s: float) -> int:
    """A priority level raised one level per `aging_s` seconds waited (monolithic mode's queue too)."""
    return priority + int(min(waited_s / aging_s, MAX_AGED_LEVEL - priority))  # capped before int(): inf


def effective_level(rec: RequestRecord, now: float, aging_s: float) -> int:
    """`rec`'s priority raised one level per `aging_s` seconds waited (its current wait included)."""
    return aged(rec.priority, rec.waited_s + max(now - rec.hop_started, 0.0), aging_s)


def place(queue: deque[str], rid: str, level: int, level_of: Callable[[str], int], ahead: bool = False) -> None:
    """Put `rid` into `queue` (kept in decreasing level): after the entries of its level, or before
    them with `ahead`."""
    i = len(queue)
    while i > 0 and (level_of(queue[i - 1]) < level or (ahead and level_of(queue[i - 1]) == level)):
        i -= 1
    queue.insert(i, rid)


def reorder(queue: deque[str], level_of: Callable[[str], int]) -> None:
    """Re-sort `queue` by decreasing level as waits have grown (stable: the order within a level stays)."""
    if len(queue) > 1:
        ordered = sorted(queue, key=lambda rid: -level_of(rid))
        queue.clear()
        queue.extend(ordered)


def note_dispatch(rec: RequestRecord, waited: float, now: float, aging_s: float) -> None:
    """`rec` leaves its queue after `waited` seconds: the level it holds while it runs, and its total wait."""
    rec.held_level = effective_level(rec, now, aging_s)
    rec.waited_s += waited


def enabled(core: HeadCore) -> bool:
    return core.args.disagg_preemption == "on" and not core.full_pipeline and core.dispatcher.batcher is None


def suspendable(core: HeadCore, rec: RequestRecord) -> bool:
    """Denoising on a worker now, alone (not in a batch), and not asked to move already."""
    return rec.wire_batch()[1] == 1 and migration.can_hand_off(core, rec)


def preempt(core: HeadCore) -> list[RequestRecord]:
    """Ask the lowest-level running denoises to suspend for the waiting denoiser requests that
    outrank them, when no ready denoiser has a free slot; returns the requests asked."""
    if not enabled(core) or Role.DENOISER not in core.dispatcher.queues:
        return []
    membership = core.membership
    ready = [i for i in membership.instances(Role.DENOISER) if membership.ready(i)]
    if not ready or any(i.free_slots > 0 for i in ready) or not core.dispatcher.queues[Role.DENOISER]:
        return []  # checked first: cheap, and most of the time a slot is free or nothing waits
    waiting = core.dispatcher.waiting(Role.DENOISER)
    ready_urls = {i.url for i in ready}
    now, aging = core.clock(), core.args.disagg_priority_aging
    running = [r for r in core.requests.values() if r.role is Role.DENOISER and r.instance in ready_urls]
    pending = sum(1 for r in running if r.hand_off_reason == PREEMPT and r.hand_off_from == r.instance)
    # The lowest level first; among equals the earliest dispatched, which its worker (running its jobs
    # in order) is computing now, rather than one queued behind it there.
    victims = sorted((r for r in running if suspendable(core, r)), key=lambda r: (r.held_level, r.hop_started))
    asked: list[RequestRecord] = []
    for rec in waiting:
        if pending:  # a suspension asked for earlier frees a slot for this one
            pending -= 1
            continue
        if not victims:
            break
        level = effective_level(rec, now, aging)
        victim = next((v for v in victims if v.priority < rec.priority and v.held_level < level), None)
        if victim is None:
            continue  # a request behind it of a higher priority (and a lower level) may still have one
        victims.remove(victim)
        if migration.ask_hand_off(core, victim, PREEMPT):
            log.info("request %s (level %d) waits for a denoiser: suspending %s (level %d) on %s",
                     rec.request_id, level, victim.request_id, victim.held_level, victim.instance)  # fmt: skip
            asked.append(victim)
    return asked


def suspended(core: HeadCore, rec: RequestRecord, sender: WorkerInstance, nbytes: int) -> None:
    """`rec` stopped at a step boundary for a higher priority: its slot on `sender` is free now, its
    state stays in `sender`'s pool until it resumes."""
    sender.inflight.discard(rec.wire_id)
    rec.suspended_at = core.clock()
    rec.suspensions += 1
    core.metrics.suspensions.inc()
    core.metrics.suspension_bytes.inc(nbytes)
    log.info("request %s suspended on %s (%d bytes of state kept there)", rec.request_id, sender.url, nbytes)
    core.event(rec, preemption=SUSPENDED)


def resumed(core: HeadCore, rec: RequestRecord, moved_bytes: int = 0) -> None:
    """A suspended `rec` runs again: where it stopped (`moved_bytes` 0) or on another denoiser,
    its state moved there (a migration; from its dispatch to the receiver told to resume it)."""
    if rec.suspended_at is None:
        return
    now = core.clock()
    core.metrics.suspended_seconds.observe(now - rec.suspended_at)
    core.metrics.resumptions.labels("other" if moved_bytes else "same").inc()
    if moved_bytes:
        migration.migrated(core, rec, PREEMPT, moved_bytes)
        core.metrics.migration_seconds.observe(now - rec.hop_started)
    rec.suspended_at = None
    core.event(rec, preemption=RESUMED)
