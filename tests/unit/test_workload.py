"""The autoscaling signal: device-seconds of work per role, calibrated from observed stage times."""

from __future__ import annotations

import pytest

from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_head.workload import PRIOR_SECONDS_PER_UNIT, SMOOTHING, WorkEstimator, work_units


def params(**kw) -> GenerationParams:  # type: ignore[no-untyped-def]
    return GenerationParams(**{"prompt": "p", "width": 1000, "height": 1000, "num_inference_steps": 10, **kw})


def test_a_video_costs_its_frames_times_its_steps_on_the_denoiser():
    image, video = params(), params(num_frames=81)
    assert work_units(Role.DENOISER, image) == 10.0  # 1 megapixel x 1 frame x 10 steps
    assert work_units(Role.DENOISER, video) == 81 * work_units(Role.DENOISER, image)
    assert work_units(Role.DECODER, video) == 81.0  # every frame decoded once, whatever the steps
    assert work_units(Role.ENCODER, video) == 1.0  # one prompt, whatever the size
    assert work_units(Role.DENOISER, params(num_outputs=3)) == 30.0


def test_the_first_observed_stage_replaces_the_prior_and_later_ones_smooth():
    est = WorkEstimator()
    assert est.estimate(Role.DENOISER, params()) == pytest.approx(10 * PRIOR_SECONDS_PER_UNIT[Role.DENOISER])
    est.observe(Role.DENOISER, params(), worker_seconds=5.0)  # 0.5 s per megapixel-step on this hardware
    assert est.estimate(Role.DENOISER, params(num_frames=2)) == pytest.approx(10.0)
    est.observe(Role.DENOISER, params(), worker_seconds=15.0)
    assert est.seconds_per_unit(Role.DENOISER) == pytest.approx((1 - SMOOTHING) * 0.5 + SMOOTHING * 1.5)
    assert est.seconds_per_unit(Role.DECODER) == PRIOR_SECONDS_PER_UNIT[Role.DECODER]  # roles calibrate apart


def test_running_work_counts_what_is_left_but_never_less_than_a_tenth():
    est = WorkEstimator({Role.DENOISER: 1.0})
    assert est.remaining(Role.DENOISER, params(), running_for=None) == 10.0
    assert est.remaining(Role.DENOISER, params(), running_for=4.0) == 6.0
    assert est.remaining(Role.DENOISER, params(), running_for=60.0) == 1.0  # overran its estimate: still work


def test_a_zero_time_observation_is_ignored():
    est = WorkEstimator({Role.ENCODER: 0.1})
    est.observe(Role.ENCODER, params(), worker_seconds=0.0)
    assert est.seconds_per_unit(Role.ENCODER) == 0.1
