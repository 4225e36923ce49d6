"""Scale to zero: what the operator decides for a role whose autoscaling.minReplicas is 0 (wake.py).
The loop around it, against a real API server, HPA controller and metrics API, is
tests/operator/test_autoscaling_cluster.py."""

from __future__ import annotations

from triptych_operator.spec.model import Autoscaling
from triptych_operator.wake import decide

AUTO = Autoscaling(
    enabled=True,
    min_replicas=0,
    max_replicas=4,
    target_work_seconds_per_replica=60,
    scale_down_stabilization_seconds=300,
)


def test_work_for_a_role_without_pods_wakes_it_with_the_pods_its_work_asks_for() -> None:
    assert decide(0, 0.5, 0, AUTO) == 1  # any work at all: one pod at least
    assert decide(0, 150, 0, AUTO) == 3  # ceil(150 / 60)
    assert decide(0, 10_000, 0, AUTO) == 4  # never past maxReplicas


def test_a_role_with_pods_and_work_is_the_hpa_s() -> None:
    assert decide(2, 150, 0, AUTO) is None


def test_a_role_goes_to_zero_only_after_the_stabilization_window_without_work() -> None:
    assert decide(2, 0, 299, AUTO) is None
    assert decide(2, 0, 300, AUTO) == 0
    assert decide(0, 0, 10_000, AUTO) is None  # asleep already


def test_a_deployment_left_asleep_by_a_role_that_no_longer_scales_to_zero_is_woken() -> None:
    from tests.operator.helpers import minimal_spec, pipeline
    from triptych_operator.wake import ASLEEP, left_asleep

    def live(name: str, replicas: int, asleep: bool = True) -> dict:
        annotations = {ASLEEP: "2026-12-05T17:00:00Z"} if asleep else {}
        return {"metadata": {"name": name, "annotations": annotations}, "spec": {"replicas": replicas}}

    raised = pipeline(minimal_spec(denoiser={"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4}}))
    assert left_asleep(raised, [live("wan-t2v-denoiser", 0)]) == [("wan-t2v-denoiser", 2)]
    assert left_asleep(raised, [live("wan-t2v-denoiser", 0, asleep=False)]) == []  # scaled to 0 by someone else
    assert left_asleep(raised, [live("wan-t2v-denoiser", 3)]) == [("wan-t2v-denoiser", None)]  # awake: unmark only
    still = pipeline(minimal_spec(denoiser={"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 4}}))
    assert left_asleep(still, [live("wan-t2v-denoiser", 0)]) == []  # the wake loop's
    fixed = pipeline(minimal_spec())  # autoscaling off: its apply sets the replicas, the mark just goes
    assert left_asleep(fixed, [live("wan-t2v-denoiser", 0)]) == [("wan-t2v-denoiser", None)]
