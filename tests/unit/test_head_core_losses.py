"""The head core when a worker is found lost in the middle of something else (core.py, queues.py,
transfers.py): a send failing while a queue is being dispatched, a worker lost while the head
retries another worker's requests, a receiver declared lost that was only slow and answers
twice. Each request must still wait in its queue, be retried once per lost attempt, and end once.
"""

from __future__ import annotations

from tests.unit.core_harness import Harness
from triptych.protocol import CancelWork, RequestResult, TransferAlloc, TransferPush
from triptych.roles import Role
from triptych_head.state import RequestState


def _urls(h: Harness, role: Role) -> list[str]:
    return [url for url, w in h.workers.items() if w.role is role]


def _pump(h: Harness) -> None:
    """Every message handled, held stages left running."""
    while h.pending or h.answers:
        h.deliver() if h.pending else h.answer()


def _run_to_end(h: Harness) -> None:
    """Every message handled and every held stage ended, with heartbeats now and then, for at most a
    minute of the head's clock (far less than --disagg-timeout: a request lost from its queue stays lost)."""
    until = h.clock.now + 60
    for _ in range(500):
        computing = sorted(rid for w in h.workers.values() if w.alive for rid in w.computing)
        if h.pending:
            h.deliver()
        elif h.answers:
            h.answer()
        elif computing:
            h.finish(computing[0])
        elif h.core.requests and h.clock.now < until:
            h.clock.advance(0.5)
            h.tick()
        else:
            return


def _ended(h: Harness) -> dict[str, list[str]]:
    """Each request's terminal replies: "RESULT", or the terminal state."""
    ended = h.endings().items()
    return {rid: ["RESULT" if isinstance(m, RequestResult) else m.state for m in msgs] for rid, msgs in ended}


def test_a_group_sent_to_a_disconnected_encoder_is_queued_again_and_runs_on_the_other_one() -> None:
    """--batching-mode dynamic: the head picks the first encoder, whose socket is gone; sending the
    group's Work finds it out, the encoder is lost and the request restarts at the front of the same
    queue. Only the entry its dispatch used leaves the queue; before, the new one went too and the
    request waited in no queue until --disagg-timeout."""
    flags = ("--batching-mode", "dynamic", "--batching-delay-ms", "0")
    h = Harness({Role.ENCODER: 2, Role.DENOISER: 1, Role.DECODER: 1}, flags)
    first, other = _urls(h, Role.ENCODER)
    h.transport.down.add(first)
    h.submit("r")
    rec = h.core.requests["r"]
    assert rec.retries == 1 and rec.state is RequestState.ENCODER_WAITING
    h.core.dispatch()  # the loop turn's end
    h.collect()
    assert rec.instance == other
    _run_to_end(h)
    assert _ended(h) == {"r": ["RESULT"]}
    h.check_idle()


def test_a_request_requeued_ahead_during_another_s_dispatch_stays_queued() -> None:
    """a's continuation (it was handed off) goes to the second denoiser's standing slot, and the push
    to its sender, the first denoiser, fails: that denoiser is lost, so x, whose TransferAlloc went to
    it, waits again at the front of the denoisers' queue while a's dispatch is still under way. The
    entry a's dispatch used leaves the queue, not the one now in front; before, x was dropped and
    waited in no queue, holding its encoder's outputs, until --disagg-timeout."""
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1}, hold=frozenset({Role.DENOISER}))
    first, second = _urls(h, Role.DENOISER)
    h.submit("a")
    _pump(h)
    h.submit("b")
    _pump(h)
    h.finish("b")
    _pump(h)  # a computes on the first denoiser (held); b ran on the second and ended
    assert h.core.requests["a"].instance == first and list(h.core.requests) == ["a"]
    assert h.core.hand_off("a")
    h.collect()
    h.deliver()  # the first denoiser stages a's continuation; the head reads it below
    h.submit("x")
    h.deliver()
    h.answer(1)  # x staged on the encoder: its TransferAlloc goes to the first denoiser
    x = h.core.requests["x"]
    assert x.instance == first and [type(m) for _, m in h.pending] == [TransferAlloc]
    h.transport.down.add(first)  # the first denoiser's process dies
    h.workers[first].alive = False
    h.answer()  # a's continuation: pushed from the dead denoiser, found unreachable; then the loop turn's end
    assert x.retries == 1 and x.instance == second, "x waits in its queue, and the second denoiser takes it"
    _run_to_end(h)
    assert _ended(h) == {"a": ["RESULT"], "b": ["RESULT"], "x": ["RESULT"]}
    h.check_idle()


def test_a_slow_receiver_asked_twice_for_one_slot_gets_one_push() -> None:
    """The denoiser stalls past the heartbeat timeout with a's TransferAlloc unanswered: it is
    declared lost and a waits for another receiver, its outputs kept. It was only slow: it answers,
    heartbeats, is asked again, and answers again with the slot it already holds. The push that is
    under way is the only one; before, a second one went, the encoder (its outputs already on their
    way) failed it, and the head restarted a and freed the slot while the first write still landed."""
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    (encoder,), (denoiser,) = _urls(h, Role.ENCODER), _urls(h, Role.DENOISER)
    h.submit("a")
    h.deliver()
    h.answer()
    assert [(u, type(m)) for u, m in h.pending] == [(denoiser, TransferAlloc)]
    h.workers[denoiser].alive = False  # stalled: it neither reads nor heartbeats
    h.clock.advance(h.args.disagg_heartbeat_timeout + 1)
    h.tick()
    a = h.core.requests["a"]
    assert a.retries == 1 and a.instance is None
    h.workers[denoiser].alive = True
    h.tick()  # it reads the first TransferAlloc and heartbeats: the head asks it again
    assert [(u, type(m)) for u, m in h.pending] == [(denoiser, TransferAlloc)]
    h.answer()  # the first TransferAllocated: the push goes out
    h.deliver()  # the second TransferAlloc: the same slot
    h.answer()
    assert [(u, type(m)) for u, m in h.pending] == [(encoder, TransferPush)]
    _run_to_end(h)
    assert _ended(h) == {"a": ["RESULT"]}
    assert h.core.metrics.retries.labels("denoiser", "transfer_failed")._value.get() == 0
    h.check_idle()


def test_a_second_slot_answer_that_comes_after_the_push_landed_leaves_the_request_running() -> None:
    """As above, but the receiver's second answer (the same slot) reaches the head only after the
    push it answered landed and the request runs on the receiver: it is a duplicate, not a stale
    attempt's. Before, the head told the receiver to cancel the request, which then never ended."""
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    (encoder,), (denoiser,) = _urls(h, Role.ENCODER), _urls(h, Role.DENOISER)
    h.submit("a")
    h.deliver()
    h.answer()
    h.workers[denoiser].alive = False
    h.clock.advance(h.args.disagg_heartbeat_timeout + 1)
    h.tick()
    h.workers[denoiser].alive = True
    h.tick()  # it reads the first TransferAlloc and heartbeats: the head asks it again
    h.answer()  # the first TransferAllocated: the push goes out
    h.deliver()  # the second TransferAlloc, answered with the same slot (not read by the head yet)
    assert [(u, type(m)) for u, m in h.pending] == [(encoder, TransferPush)]
    h.deliver()  # the encoder writes
    h.answer(1)  # its TransferPushed, before the denoiser's second answer: the denoiser gets its input
    assert h.state("a") is RequestState.DENOISING_RUNNING
    h.answer()  # the late second TransferAllocated
    assert not [m for u, m in h.pending if isinstance(m, CancelWork)], h.pending
    _run_to_end(h)
    assert _ended(h) == {"a": ["RESULT"]}
    assert h.core.metrics.retries.labels("denoiser", "transfer_failed")._value.get() == 0
    h.check_idle()


def test_a_request_retried_by_a_loss_found_during_another_retry_is_not_retried_again() -> None:
    """The denoiser is lost while a computes on it and b's TransferAlloc is out to it. Retrying a
    sends its Work to the encoder, whose socket is gone: the encoder is lost too, and b, staged on
    it, restarts then. The denoiser's loss must not retry b's new attempt again; before, it did
    (two retries for one loss), and with --disagg-max-retries 1 b failed though it could run."""
    h = Harness(
        {Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1},
        ("--disagg-max-retries", "1"),
        hold=frozenset({Role.DENOISER}),
    )
    (encoder,), (denoiser,) = _urls(h, Role.ENCODER), _urls(h, Role.DENOISER)
    h.submit("a")
    _pump(h)
    assert h.state("a") is RequestState.DENOISING_RUNNING
    h.submit("b")
    h.deliver()
    h.answer()
    assert [(u, type(m)) for u, m in h.pending] == [(denoiser, TransferAlloc)]
    h.pending.clear()  # lost with the denoiser's socket
    h.transport.down.add(encoder)
    lost = h.core.membership.find(denoiser)
    assert lost is not None
    h.core.instance_lost(lost, "heartbeat_lost", "the denoiser stopped heartbeating")
    h.collect()
    assert [r.retries for r in h.core.requests.values()] == [1, 1]
    assert "b" not in h.endings()
    h.transport.down.clear()  # the encoder is back, a new process: what the old one staged went with it
    h.workers[encoder].staged.clear()
    h.workers[denoiser].hold = False
    _run_to_end(h)
    assert _ended(h) == {"a": ["RESULT"], "b": ["RESULT"]}
    h.check_idle()
