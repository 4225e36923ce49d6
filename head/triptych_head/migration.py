"""Moving a denoising request to another denoiser at a step boundary (docs/design.md "Migration").

The head asks the denoiser running a request to hand it off (HandOff). At its next step boundary
that denoiser stages the request's state, its inputs, latents and scheduler state, and reports a
TransferStaged with `continues_at`: a continuation. The request goes back to DENOISING_WAITING at
the same hop (its route position does not advance) and takes the normal transfer flow to another
denoiser, never the one it left, which resumes the loop at that step.

A request suspended for a higher priority (preemption.py, which asks through this module) is handed
off the same way, with reason "preempt"; it may resume anywhere, the denoiser it left included (in
place, nothing moves).

A draining denoiser's requests are moved this way while another denoiser has a free slot for
them, so a drain takes about one step and a transfer whatever the requests' length; without
room elsewhere they finish where they are, as before.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from triptych.protocol import HandOff, TransferStaged
from triptych.roles import Role
from triptych_head.instances import WorkerInstance
from triptych_head.state import RequestRecord, RequestState, StagedPayload

if TYPE_CHECKING:
    from triptych_head.core import HeadCore

log = logging.getLogger(__name__)


def can_hand_off(core: HeadCore, rec: RequestRecord) -> bool:
    """Whether `rec` is denoising on a worker now, with its inputs loaded there (not moving), and
    would stop when asked: a step cache's state does not travel, so its denoiser never hands a
    cached request off (StageBatch.should_hand_off), and asking it would wait for nothing."""
    return (
        not core.full_pipeline  # a full-pipeline worker decodes its own latents: nothing to hand on
        and not rec.params.resolved_step_cache.on
        and rec.role is Role.DENOISER
        and rec.state is RequestState.DENOISING_RUNNING
        and rec.instance is not None
        and rec.staged is None
        and rec.hand_off_from != rec.instance
    )


def ask_hand_off(core: HeadCore, rec: RequestRecord, reason: str) -> bool:
    """Ask the denoiser running `rec` to hand it to another at its next step boundary; False when
    it is not denoising now. The denoiser may finish it anyway (past its last step, or unable)."""
    if not can_hand_off(core, rec):
        return False
    assert rec.instance is not None
    if not core.membership.send(rec.instance, HandOff(rec.wire_id, rec.instance, core.head_id)):
        return False
    rec.hand_off_from, rec.hand_off_reason = rec.instance, reason
    log.info("request %s: asked %s to hand it off at its next step (%s)", rec.request_id, rec.instance, reason)
    return True


def drain_by_migration(core: HeadCore) -> None:
    """Ask draining denoisers to hand their requests off, as many as other ready denoisers have
    free slots for (the rest finish where they are); with --disagg-migration off, none is asked."""
    if core.full_pipeline or core.args.disagg_migration == "off":
        return
    instances = core.membership.instances(Role.DENOISER)
    draining = {i.url for i in instances if i.draining and core.membership.alive(i)}
    if not draining:
        return
    room = sum(i.free_slots for i in instances if core.membership.ready(i))
    room -= sum(1 for r in core.requests.values() if r.instance in draining and r.hand_off_from == r.instance)
    for rec in list(core.requests.values()):
        if room <= 0:
            return
        if rec.instance in draining and ask_hand_off(core, rec, "drain"):
            room -= 1


def left(core: HeadCore, rec: RequestRecord, sender: WorkerInstance, msg: TransferStaged) -> str:
    """A denoiser staged `rec`'s state before step `msg.continues_at`: its staged state now waits for
    another denoiser (queues.py never picks the sender) or, suspended for a higher priority, for any
    denoiser, the sender included (preemption.py). Returns the reason the hand-off was asked for."""
    rec.staged = StagedPayload(sender.url, msg.nbytes, msg.manifest, msg.meta, core.clock(), msg.continues_at)
    rec.instance = None
    reason, rec.hand_off_from, rec.hand_off_reason = rec.hand_off_reason or "asked", None, ""
    log.info("request %s: %s handed it off before step %s (%s)", rec.request_id, sender.url, msg.continues_at, reason)
    return reason


def migrated(core: HeadCore, rec: RequestRecord, reason: str, nbytes: int) -> None:
    """`rec`'s state moved to another denoiser (`nbytes` of it), for `reason`: counted."""
    rec.migrations += 1
    core.metrics.migrations.labels(reason).inc()
    core.metrics.migration_bytes.inc(nbytes)


def sender_to_avoid(rec: RequestRecord) -> str:
    """The denoiser a staged continuation must not go back to: the one it left ("" for a suspended
    request, which may resume where its state is, and for any other staged output)."""
    if rec.staged is None or rec.staged.continues_at is None or rec.suspended_at is not None:
        return ""
    return rec.staged.sender


def resumes_in_place(rec: RequestRecord, inst: WorkerInstance) -> bool:
    """`inst` holds `rec`'s suspended state itself: it resumes it without a transfer."""
    return rec.suspended_at is not None and rec.staged is not None and rec.staged.sender == inst.url
