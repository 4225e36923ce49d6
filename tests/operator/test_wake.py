"""Scale to zero: what the operator decides for a role whose autoscaling.minReplicas is 0 (wake.py).
The loop around it, against a real API server, HPA controller and metrics API, is
tests/operator/test_autoscaling_cluster.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from tests.operator.helpers import NAMESPACE, minimal_spec, pipeline
from triptych_operator import handlers, kube, wake
from triptych_operator.pipeline_state import PipelineStates
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


def sleepy_pipelines(*names: str) -> tuple[PipelineStates, dict[tuple[str, str], list[dict[str, Any]]]]:
    """Pipelines whose denoiser scales to zero (as reconciled), and the kopf index of their Deployments,
    each denoiser at 0 replicas."""
    states = PipelineStates()
    index = {}
    sleepy = {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 4, "targetWorkSecondsPerReplica": 60}}
    for name in names:
        state = states.get((NAMESPACE, name))
        state.spec = state.last_valid_spec = pipeline(minimal_spec(denoiser=sleepy), name=name)
        state.parsed_for = ("uid", 1)
        index[(NAMESPACE, name)] = [{"metadata": {"name": f"{name}-denoiser"}, "spec": {"replicas": 0}}]
    return states, index


def stub_api(monkeypatch: Any, work: Callable[[str], float]) -> list[tuple[str, ...]]:
    """The API calls the loop makes, stubbed (the real ones: test_autoscaling_cluster.py): the metric
    is `work(deployment)`; the writes are recorded in the list returned."""
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(kube, "deployment_metric", lambda name, namespace, metric: work(name))
    monkeypatch.setattr(kube, "scale_deployment", lambda name, ns, n, manager: calls.append(("scale", name, str(n))))
    monkeypatch.setattr(kube, "annotate_deployment", lambda name, ns, notes, manager: calls.append(("annotate", name)))
    monkeypatch.setattr(kube, "pipeline_event", lambda name, ns, uid, reason, text: calls.append(("event", reason)))
    return calls


def test_a_pass_reads_the_replicas_from_the_watch_and_the_work_from_the_metric(monkeypatch: Any) -> None:
    """One pass over a sleeping denoiser with work and an idle one: the replicas come from the kopf
    index (no read of the scale), the work from the metric; the first is woken, the second left."""
    states, index = sleepy_pipelines("busy", "idle")
    calls = stub_api(monkeypatch, {"busy-denoiser": 90.0, "idle-denoiser": 0.0}.__getitem__)

    asyncio.run(wake.Waker().one_pass(states, index))
    assert calls == [("scale", "busy-denoiser", "2"), ("annotate", "busy-denoiser"), ("event", "ScaledFromZero")]

    del index[(NAMESPACE, "busy")]  # not seen by the watch (yet): left alone
    calls.clear()
    asyncio.run(wake.Waker().one_pass(states, index))
    assert calls == []


def test_a_scale_the_watch_has_not_shown_yet_is_not_made_again(monkeypatch: Any) -> None:
    """The kopf index may lag a scale of the loop: while it still shows the replicas the scale
    changed (up to WATCH_LAG_S), nothing is decided on them, so no second scale and no second Event."""
    states, index = sleepy_pipelines("p")
    calls = stub_api(monkeypatch, lambda name: 30.0)
    now = [1000.0]
    waker = wake.Waker(clock=lambda: now[0])

    def scales() -> list[str]:
        return [call[2] for call in calls if call[0] == "scale"]

    asyncio.run(waker.one_pass(states, index))
    assert scales() == ["1"]
    now[0] += wake.WAKE_INTERVAL_S  # the watch still shows 0
    asyncio.run(waker.one_pass(states, index))
    assert scales() == ["1"]
    now[0] += wake.WATCH_LAG_S  # never shown: decided again
    asyncio.run(waker.one_pass(states, index))
    assert scales() == ["1", "1"]
    index[(NAMESPACE, "p")][0]["spec"]["replicas"] = 1  # shown: the role has its pod, the HPA's from here
    asyncio.run(waker.one_pass(states, index))
    assert scales() == ["1", "1"]


def test_the_replicas_are_the_deployment_s_as_the_watch_saw_it() -> None:
    from triptych_operator.wake import SleepyRole, live_replicas

    role = SleepyRole("ml", "p", "uid", "denoiser", "p-denoiser", AUTO)
    assert live_replicas({}, role) is None
    assert live_replicas({("ml", "p"): [{"metadata": {"name": "p-decoder"}, "spec": {"replicas": 2}}]}, role) is None
    assert live_replicas({("ml", "p"): [{"metadata": {"name": "p-denoiser"}, "spec": {"replicas": 3}}]}, role) == 3
    assert live_replicas({("ml", "p"): [{"metadata": {"name": "p-denoiser"}, "spec": {}}]}, role) == 1  # API default


def test_a_sleeping_role_still_wakes_after_an_invalid_edit_of_its_pipeline(monkeypatch: Any) -> None:
    """An invalid spec applies nothing: the last valid spec's objects keep running, and its role that
    sleeps still wakes for pending work."""
    sleepy = {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 4, "targetWorkSecondsPerReplica": 60}}
    meta = {"name": "p", "namespace": NAMESPACE, "uid": "u1", "generation": 1}
    states = PipelineStates()
    state = states.get((NAMESPACE, "p"))
    log = logging.getLogger("test-wake")
    handlers._validate({"metadata": meta, "spec": minimal_spec(denoiser=sleepy)}, state, logger=log)
    typo = minimal_spec(denoiser=sleepy, transfer={"mode": "rdma", "ibDevice": ""})
    handlers._validate({"metadata": {**meta, "generation": 2}, "spec": typo}, state, logger=log)
    assert state.spec is None and state.spec_error is not None
    calls = stub_api(monkeypatch, lambda name: 30.0)
    index = {(NAMESPACE, "p"): [{"metadata": {"name": "p-denoiser"}, "spec": {"replicas": 0}}]}

    asyncio.run(wake.Waker().one_pass(states, index))
    assert ("scale", "p-denoiser", "1") in calls
