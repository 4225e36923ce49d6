"""Priority and preemption in the head's core, message by message (preemption.py, queues.py): the
order waiting requests leave in, aging, which running denoise is suspended for a waiting request of
higher priority and when none is, and a suspended request resuming in place or elsewhere.

The denoisers here hold their stages until the test ends them (Harness.finish) or a HandOff stops
them at their next step boundary, as a real denoising loop does."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.core_harness import Harness
from triptych.protocol import HandOff, RequestEvent, RequestResult, TransferReady, Work
from triptych.roles import Role
from triptych_head.state import RequestState

LOW, NORMAL, HIGH = 0, 1, 2


def harness(*flags: str, denoisers: int = 1, heads: int = 1) -> Harness:
    """One encoder, `denoisers` denoisers of one slot each that hold their stages, one decoder (the
    encoder and decoder with room for every request, so that all wait for the denoisers); `heads`:
    replicated heads, whose workers each check their own capacity (runtime.Worker._full)."""
    counts = {Role.ENCODER: 1, Role.DENOISER: denoisers, Role.DECODER: 1}
    capacity = {Role.ENCODER: 16, Role.DENOISER: 1, Role.DECODER: 16}
    return Harness(counts, flags, capacity=capacity, hold=frozenset({Role.DENOISER}), heads=heads)


def settle(h: Harness, limit: int = 500) -> list[tuple[str, Any]]:
    """Deliver and answer every message until nothing moves (held stages keep running); returns what
    the workers were sent, in order."""
    sent = []
    for _ in range(limit):
        if h.pending:
            sent.append(h.pending[h._oldest(0)])
            h.deliver()
        elif h.answers:
            h.answer()
        else:
            return sent
    raise AssertionError("the schedule never settled")


def denoisers(h: Harness) -> list[str]:
    return [url for url, w in h.workers.items() if w.role is Role.DENOISER]


def running_on(h: Harness, rid: str) -> str:
    return next(url for url, w in h.workers.items() if rid in w.computing)


def computing(h: Harness, url: str) -> str:
    """The one request the worker at `url` computes now."""
    [rid] = h.workers[url].computing
    return rid


def hand_offs(sent: list[tuple[str, Any]]) -> list[str]:
    return [msg.request_id for _, msg in sent if isinstance(msg, HandOff)]


def preemption_events(h: Harness, client: bytes) -> list[str]:
    events = [m for c, m in h.transport.replies if c == client and isinstance(m, RequestEvent)]
    return [m.preemption for m in events if m.preemption]


@pytest.mark.parametrize("heads", [1, 2])
def test_a_high_request_suspends_the_low_denoise_takes_its_slot_and_the_low_one_resumes_in_place(heads: int) -> None:
    """With two heads too (every operator deployment): the worker does not count the suspended state
    against its capacity. Before, it refused the high request there, and both waited until they timed out."""
    h = harness(heads=heads)
    [denoiser] = denoisers(h)
    h.submit("video", client=b"v", priority=LOW, watch=True)
    settle(h)
    assert h.state("video") is RequestState.DENOISING_RUNNING and running_on(h, "video") == denoiser
    h.submit("image", client=b"i", priority=HIGH)
    sent = settle(h)
    assert hand_offs(sent) == ["video"]
    # The video stopped at its step boundary, its state kept in the denoiser's pool; the image has its slot.
    assert running_on(h, "image") == denoiser and "video" in h.workers[denoiser].staged
    video = h.core.requests["video"]
    assert video.state is RequestState.DENOISING_WAITING and video.suspended_at is not None
    h.finish("image")
    sent = settle(h)
    assert "image" in h.endings()
    [resume] = [m for url, m in sent if isinstance(m, TransferReady) and m.request_id == "video"]
    assert resume.in_place and resume.instance == denoiser, "it resumes where its state is: nothing moves"
    assert running_on(h, "video") == denoiser
    h.finish("video")
    settle(h)
    assert [type(m) for m in h.endings()["video"]] == [RequestResult]
    assert preemption_events(h, b"v") == ["suspended", "resumed"]
    metrics = h.core.metrics
    assert metrics.suspensions._value.get() == 1
    assert metrics.resumptions.labels("same")._value.get() == 1
    assert metrics.migrations.labels("preempt")._value.get() == 0  # resumed in place: nothing moved
    h.check_idle()


def test_a_suspended_request_resumes_on_another_denoiser_when_that_one_frees_first() -> None:
    h = harness(denoisers=2)
    first, second = denoisers(h)
    h.submit("normal", priority=NORMAL)
    h.submit("video", priority=LOW)
    settle(h)
    video_on = running_on(h, "video")
    h.submit("image", priority=HIGH)
    settle(h)
    assert running_on(h, "image") == video_on
    h.finish("normal")  # the other denoiser frees first: the video's state moves there
    sent = settle(h)
    other = second if video_on == first else first
    assert running_on(h, "video") == other
    assert not any(isinstance(m, TransferReady) and m.in_place for _, m in sent)
    assert h.core.metrics.migrations.labels("preempt")._value.get() == 1
    assert h.core.metrics.resumptions.labels("other")._value.get() == 1
    for rid in ("image", "video"):
        h.finish(rid)
        settle(h)
    assert set(h.endings()) == {"normal", "video", "image"}
    h.check_idle()


def test_no_request_is_suspended_while_a_denoiser_has_a_free_slot() -> None:
    h = harness(denoisers=2)
    h.submit("video", priority=LOW)
    settle(h)
    h.submit("image", priority=HIGH)
    sent = settle(h)
    assert not hand_offs(sent)
    assert running_on(h, "image") != running_on(h, "video")


def test_the_lowest_priority_running_denoise_is_the_one_suspended() -> None:
    h = harness(denoisers=2)
    h.submit("normal", priority=NORMAL)
    h.submit("low", priority=LOW)
    settle(h)
    h.submit("high", priority=HIGH)
    assert hand_offs(settle(h)) == ["low"]


def test_a_step_cached_denoise_is_never_asked_to_suspend_so_a_plain_one_is() -> None:
    """A step cache's state does not travel, so its denoiser never hands a cached request off: asking
    it would leave the waiting request waiting for its whole run. Before, the cached one, of the lower
    level, was asked, ignored the ask, and no other was asked."""
    h = harness(denoisers=2)
    h.submit("cached", priority=LOW, step_cache="first_block")
    h.submit("plain", priority=NORMAL)
    settle(h)
    h.submit("high", priority=HIGH)
    assert hand_offs(settle(h)) == ["plain"]


def test_a_request_never_suspends_one_of_its_own_priority_or_higher() -> None:
    h = harness()
    h.submit("running", priority=NORMAL)
    settle(h)
    h.submit("waiting", priority=NORMAL)
    assert not hand_offs(settle(h))
    h.tick()
    assert not hand_offs(settle(h))
    assert h.state("waiting") is RequestState.DENOISING_WAITING


def test_with_preemption_off_a_high_request_waits_for_the_low_one_to_finish() -> None:
    h = harness("--disagg-preemption", "off")
    h.submit("video", priority=LOW)
    settle(h)
    h.submit("image", priority=HIGH)
    assert not hand_offs(settle(h))
    h.tick()
    assert not hand_offs(settle(h))
    assert h.state("image") is RequestState.DENOISING_WAITING
    h.finish("video")
    settle(h)
    assert h.state("image") is RequestState.DENOISING_RUNNING


def test_waiting_requests_leave_by_priority_first_come_first_served_within_a_level() -> None:
    h = harness()
    h.submit("busy", priority=HIGH)  # nothing outranks it: it keeps its slot
    settle(h)
    for rid, level in (("low-1", LOW), ("normal-1", NORMAL), ("high-1", HIGH), ("low-2", LOW), ("high-2", HIGH)):
        h.submit(rid, priority=level)
        settle(h)
    assert [r.request_id for r in h.core.dispatcher.waiting(Role.DENOISER)] == [
        "high-1", "high-2", "normal-1", "low-1", "low-2",
    ]  # fmt: skip
    order = []
    h.finish("busy")
    for _ in range(5):  # each preempts nobody (none below it runs), so they leave one by one
        settle(h)
        rid = computing(h, denoisers(h)[0])
        order.append(rid)
        h.finish(rid)
    assert order == ["high-1", "high-2", "normal-1", "low-1", "low-2"]


def test_aging_raises_a_waiting_request_one_level_per_aging_period_so_none_starves() -> None:
    h = harness("--disagg-priority-aging", "10", "--disagg-preemption", "off")  # the order alone
    h.submit("busy", priority=HIGH)
    settle(h)
    h.submit("old", priority=LOW)
    settle(h)
    h.clock.advance(5)
    h.submit("fresh-high", priority=HIGH)
    settle(h)
    assert [r.request_id for r in h.core.dispatcher.waiting(Role.DENOISER)] == ["fresh-high", "old"]
    h.clock.advance(25)  # old has waited 30 s: low + 3 levels, above any newly arrived request's high
    h.tick()
    h.submit("new-high", priority=HIGH)
    settle(h)
    # fresh-high has aged too (25 s: high + 2), and stays ahead; new-high is behind old.
    assert [r.request_id for r in h.core.dispatcher.waiting(Role.DENOISER)] == ["fresh-high", "old", "new-high"]


def test_an_aged_request_goes_first_when_a_slot_frees_and_then_no_newer_high_one_suspends_it() -> None:
    h = harness("--disagg-priority-aging", "10")
    h.submit("busy", priority=HIGH)
    settle(h)
    h.submit("old", priority=LOW)
    settle(h)
    h.clock.advance(30)  # old has waited three aging periods: level 3, above any newly arrived high
    h.tick()
    assert not hand_offs(settle(h)), "an aged request waits for a higher priority's denoise to finish"
    h.submit("new", priority=HIGH)
    settle(h)
    h.finish("busy")
    settle(h)
    assert computing(h, denoisers(h)[0]) == "old" and h.core.requests["old"].held_level == LOW + 3
    h.tick()
    assert not hand_offs(settle(h)), "dispatched at level 3, it is not suspended for a high request at level 2"
    assert h.state("new") is RequestState.DENOISING_WAITING


def test_requests_of_one_priority_never_suspend_each_other_however_long_they_wait() -> None:
    h = harness("--disagg-priority-aging", "1")
    h.submit("first", priority=LOW)
    settle(h)
    h.submit("second", priority=LOW)
    settle(h)
    h.clock.advance(4)
    h.tick()
    assert not hand_offs(settle(h))


def test_a_worker_runs_its_queued_jobs_highest_priority_first_oldest_first_within_a_level() -> None:
    from collections import deque

    from triptych.params import GenerationParams
    from triptych_worker.job_groups import Job, enqueue, take_group

    queue: deque[Job] = deque()
    params = GenerationParams(prompt="x", width=16, height=16)
    for rid, level in (("low", LOW), ("normal-1", NORMAL), ("high", HIGH), ("normal-2", NORMAL)):
        enqueue(queue, Job(rid, params, priority=level))
    assert [take_group(queue, 1, 0.0)[0].request_id for _ in range(4)] == ["high", "normal-1", "normal-2", "low"]


def test_work_and_transfer_ready_carry_the_level_the_request_was_dispatched_at() -> None:
    h = harness()
    h.submit("busy", priority=HIGH)
    settle(h)
    h.submit("urgent", priority=HIGH)
    h.submit("low", priority=LOW)
    sent = settle(h)
    works = {m.request_id: m.priority for _, m in sent if isinstance(m, Work)}
    assert works == {"urgent": HIGH, "low": LOW}
    h.finish("busy")
    sent = settle(h)
    [ready] = [m for _, m in sent if isinstance(m, TransferReady) and m.request_id == "urgent"]
    assert ready.priority == HIGH


def test_the_pipeline_view_shows_each_request_s_priority_and_whether_it_is_suspended() -> None:
    h = harness()
    h.submit("video", priority=LOW)
    settle(h)
    h.submit("image", priority=HIGH)
    settle(h)
    h.tick()
    listed = {r["id"]: r for r in h.core.pipeline_view["requests"]}
    assert (listed["video"]["priority"], listed["video"]["suspended"]) == ("low", True)
    assert (listed["image"]["priority"], listed["image"]["suspended"]) == ("high", False)


def test_a_submit_of_a_priority_past_high_is_refused_and_an_aged_level_stays_one_a_worker_reads() -> None:
    """The frontend takes the Submit as sent (no API key checks it there): a level past high is a 400
    naming priority, not a number that, aged, would overflow the Work the head encodes and stop its
    loop. Aging is capped where a worker's decoder still reads it."""
    from tests.unit.core_harness import PARAMS
    from triptych.params import GenerationParams
    from triptych.protocol import RequestResult, Submit, decode, encode
    from triptych_head.preemption import MAX_AGED_LEVEL, aged

    h = harness()
    params = GenerationParams(**PARAMS)
    for level in (3, 2**64 - 1):
        h.core.on_frontend(b"attacker", encode(Submit(f"p{level}", params, priority=level)))
    refusals = [m for client, m in h.transport.replies if client == b"attacker"]
    assert len(refusals) == 2 and not h.core.requests, refusals
    assert all("priority" in str(getattr(m, "error", m)) for m in refusals), refusals
    assert not any(isinstance(m, RequestResult) for m in refusals)

    assert aged(HIGH, 1e30, 0.001) == MAX_AGED_LEVEL
    work = Work("w", "http://x", params, priority=aged(HIGH, 1e30, 0.001))
    decoded, _ = decode(encode(work))
    assert decoded.priority == MAX_AGED_LEVEL


def test_aging_by_a_tiny_period_is_capped_not_an_overflow() -> None:
    """--disagg-priority-aging only has to be > 0: a waited time over a tiny period is infinite as a
    float, and the cap applies before it becomes an int."""
    from triptych_head.preemption import MAX_AGED_LEVEL, aged

    assert aged(LOW, 10.0, 1e-308) == MAX_AGED_LEVEL
    assert aged(HIGH, 10.0, 1e-300) == MAX_AGED_LEVEL
    assert aged(NORMAL, 25.0, 10.0) == NORMAL + 2
