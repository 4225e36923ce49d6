"""Deadline-aware admission: the completion estimate (deadline.py) and the decision on it (admission.py)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_head.admission import AdmissionControl, DeadlineUnachievable, Overloaded
from triptych_head.deadline import LoadFigures, RoleFigures, estimate, own_work, route
from triptych_head.metrics import HeadMetrics

E, D, V = Role.ENCODER, Role.DENOISER, Role.DECODER


def params(**kw) -> GenerationParams:  # type: ignore[no-untyped-def]
    # 1 megapixel, 10 steps: 10 denoiser units, 1 decoder unit, 1 encoder unit
    return GenerationParams(**{"prompt": "p", "width": 1000, "height": 1000, "num_inference_steps": 10, **kw})


def figures(
    pending: dict[Role, float] | None = None,
    ready: dict[Role, int] | None = None,
    counted: frozenset[str] = frozenset(),
) -> LoadFigures:
    per_unit = {E: 0.5, D: 0.1, V: 2.0}  # own work of params(): encoder 0.5 s, denoiser 1 s, decoder 2 s
    pending, ready = pending or {}, ready or {}
    roles = {r: RoleFigures(pending.get(r, 0.0), ready.get(r, 1), s, calibrated=True) for r, s in per_unit.items()}
    return LoadFigures(roles, counted)


def control(max_queued: int | None = None, registry: CollectorRegistry | None = None, **kw: Any) -> AdmissionControl:
    admission = AdmissionControl(max_queued, HeadMetrics(registry or CollectorRegistry()))
    admission.update(worker_slots=6, retry_after_s=2, figures=figures(**kw))
    return admission


def test_an_idle_pipeline_estimates_the_requests_own_work_along_its_route():
    idle = figures()
    work = own_work(idle, params())
    assert work == pytest.approx({E: 0.5, D: 1.0, V: 2.0})
    guess = estimate(idle, work, {})
    assert (guess.wait_s, guess.work_s, guess.seconds) == pytest.approx((0.0, 3.5, 3.5))


def test_the_wait_is_the_largest_roles_backlog_over_its_ready_instances_not_their_sum():
    busy = figures(pending={E: 4.0, D: 30.0, V: 8.0}, ready={D: 3, V: 1})
    guess = estimate(busy, own_work(busy, params()), {})
    assert guess.wait_s == pytest.approx(
        10.0
    )  # the denoisers' 30 s over 3 instances; the decoder's 8 s drains meanwhile
    assert guess.seconds == pytest.approx(13.5)


def test_a_role_with_no_ready_instance_counts_as_one():
    waiting = figures(pending={D: 12.0}, ready={D: 0})
    assert estimate(waiting, own_work(waiting, params()), {}).wait_s == pytest.approx(12.0)


def test_an_edit_also_visits_the_image_encoder_and_text_to_image_bypasses_it():
    split = LoadFigures({r: RoleFigures(0.0, 1, 1.0, True) for r in (Role.PROMPT_ENCODER, Role.IMAGE_ENCODER, D, V)})
    assert route(split, params()) == [Role.PROMPT_ENCODER, D, V]
    assert route(split, params(image=b"png")) == [Role.PROMPT_ENCODER, Role.IMAGE_ENCODER, D, V]


def test_priors_are_reported_as_uncalibrated():
    prior = LoadFigures({D: RoleFigures(0.0, 1, 0.2, calibrated=False), V: RoleFigures(0.0, 1, 0.05, True)})
    assert not estimate(prior, own_work(prior, params()), {}).calibrated


def test_a_request_that_would_miss_its_deadline_is_refused_with_its_estimate_and_counted():
    registry = CollectorRegistry()
    admission = control(pending={D: 20.0}, registry=registry)
    with pytest.raises(DeadlineUnachievable, match="after its deadline of 10s") as refused:
        admission.admit("late", params(), deadline_s=10.0, in_flight=0)
    assert refused.value.estimate.seconds == pytest.approx(23.5)
    assert refused.value.retry_after_s == 14  # until the backlog has shrunk by 13.5 s
    assert registry.get_sample_value("triptych_rejected_deadline_requests_total") == 1
    accepted = admission.admit("in-time", params(), deadline_s=30.0, in_flight=0)
    assert accepted is not None and accepted.seconds == pytest.approx(23.5)


def test_a_request_whose_own_work_exceeds_its_deadline_says_so():
    with pytest.raises(DeadlineUnachievable, match=r"its own work alone is estimated at 3\.5s"):
        control().admit("r", params(), deadline_s=1.0, in_flight=0)


def test_work_accepted_since_the_last_tick_is_ahead_of_the_next_request():
    admission = control()  # idle: each request needs 1 s of the one denoiser, 2 s of the one decoder
    guesses = [admission.admit(f"r{i}", params(), deadline_s=100.0, in_flight=i) for i in range(3)]
    assert [g.seconds for g in guesses if g is not None] == pytest.approx(
        [3.5, 5.5, 7.5]
    )  # behind 0, 2, 4 s of decoding
    with pytest.raises(DeadlineUnachievable):
        admission.admit("r3", params(), deadline_s=9.0, in_flight=3)  # 9.5 s


def test_once_the_tick_counts_a_request_its_work_is_not_counted_twice():
    admission = control()
    admission.admit("r0", params(), deadline_s=100.0, in_flight=0)
    admission.update(6, 2, figures(pending={D: 1.0, V: 2.0}, counted=frozenset({"r0"})))
    guess = admission.admit("r1", params(), deadline_s=100.0, in_flight=1)
    assert guess is not None and guess.wait_s == pytest.approx(2.0)


def test_an_answered_request_is_no_longer_ahead_of_anyone():
    admission = control()
    admission.admit("r0", params(), deadline_s=100.0, in_flight=0)
    admission.release("r0")
    guess = admission.admit("r1", params(), deadline_s=100.0, in_flight=0)
    assert guess is not None and guess.wait_s == 0.0


def test_a_burst_of_quick_requests_is_admitted_without_a_cap_in_requests():
    admission = control()
    quick = params(width=256, height=256, num_inference_steps=4)
    for i in range(300):
        admission.admit(f"r{i}", quick, deadline_s=600.0, in_flight=i)
    assert admission.limit.max_in_flight is None


def test_before_the_first_tick_a_request_is_admitted_without_an_estimate():
    admission = AdmissionControl(None, HeadMetrics(CollectorRegistry()))
    assert admission.admit("r", params(), deadline_s=0.001, in_flight=0) is None


def test_max_queued_requests_given_explicitly_still_caps_the_requests_in_flight():
    admission = control(max_queued=2)
    assert admission.limit.max_in_flight == 8  # 6 worker slots + 2
    admission.admit("r", params(), deadline_s=100.0, in_flight=7)
    with pytest.raises(Overloaded, match="--max-queued-requests"):
        admission.admit("r", params(), deadline_s=100.0, in_flight=8)


def test_a_taken_over_job_is_admitted_whatever_its_estimate():
    admission = control(pending={D: 1000.0})
    guess = admission.admit("job", params(), deadline_s=1.0, in_flight=0, bounded=False)
    assert guess is not None and guess.seconds > 1000
