"""Which operator replica's scale-to-zero loop acts (leading.py): kopf's peering rule read from the
peering object, and the loop standing by where another replica leads. Against a real API server and
real replicas: tests/operator/test_operator_ha_cluster.py."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from tests.operator.helpers import NAMESPACE
from tests.operator.test_wake import sleepy_pipelines, stub_api
from triptych.roles import Role
from triptych_operator import kube, leading, wake
from triptych_operator.leading import Leadership, leads

NOW = datetime.datetime(2026, 12, 7, 18, 0, tzinfo=datetime.UTC)


def peer(priority: int, seen_s_ago: float = 1, lifetime: int = 60, now: datetime.datetime = NOW) -> dict[str, Any]:
    """A peer's entry as kopf writes it in the peering object's status, as seen `seen_s_ago` before `now`."""
    seen = now - datetime.timedelta(seconds=seen_s_ago)
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen.isoformat()}


def test_a_replica_leads_unless_another_live_peer_has_a_priority_as_high() -> None:
    assert leads({"me": peer(100)}, "me", 100, NOW)  # alone
    assert leads({"me": peer(100), "low": peer(50)}, "me", 100, NOW)
    assert not leads({"me": peer(100), "high": peer(200)}, "me", 100, NOW)
    assert not leads({"me": peer(100), "twin": peer(100)}, "me", 100, NOW)  # kopf pauses both of a pair
    assert leads({"me": peer(100), "dead": peer(200, seen_s_ago=61)}, "me", 100, NOW)  # past its lifetime
    assert not leads({"high": peer(200, seen_s_ago=9, lifetime=10)}, "me", 100, NOW)
    assert leads({"high": peer(200, seen_s_ago=11, lifetime=10)}, "me", 100, NOW)
    assert not leads({"high": {"priority": 200}}, "me", 100, NOW)  # no lastseen: taken for live, as kopf does
    naive = {"high": {"priority": 200, "lifetime": 60, "lastseen": "2026-12-07T17:59:30"}}
    assert not leads(naive, "me", 100, NOW)  # without a zone: UTC


def test_standalone_always_leads_and_a_peering_object_is_read_in_the_pipeline_s_namespace(monkeypatch: Any) -> None:
    reads: list[tuple[str, str | None]] = []
    now = datetime.datetime.now(datetime.UTC)  # Leadership.leads reads the clock
    status: dict[str, Any] = {"me": peer(100, now=now), "other": peer(200, now=now)}

    def peering_status(name: str, namespace: str | None) -> dict[str, Any] | None:
        reads.append((name, namespace))
        return status

    monkeypatch.setattr(kube, "peering_status", peering_status)
    assert asyncio.run(Leadership().leads("ml"))
    assert reads == []  # standalone: no peering object to read
    namespaced = Leadership("op", "me", 100, clusterwide=False)
    assert not asyncio.run(namespaced.leads("ml"))
    clusterwide = Leadership("op", "me", 300, clusterwide=True)
    assert asyncio.run(clusterwide.leads("ml"))
    assert reads == [("op", "ml"), ("op", None)]


def test_a_replica_that_cannot_read_its_peering_object_stands_by(monkeypatch: Any, caplog: Any) -> None:
    def missing(name: str, namespace: str | None) -> None:
        return None

    def refused(name: str, namespace: str | None) -> None:
        raise kube.client.ApiException(status=403, reason="Forbidden")

    monkeypatch.setattr(kube, "peering_status", missing)
    replica = Leadership("op", "me", 100, clusterwide=False)
    caplog.set_level("INFO", logger=leading.__name__)
    assert not asyncio.run(replica.leads("ml"))
    assert not asyncio.run(replica.leads("ml"))
    monkeypatch.setattr(kube, "peering_status", refused)
    assert not asyncio.run(replica.leads("ml"))
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "scale to zero in ml: no peering object op; standing by",  # once, not every pass
        "scale to zero in ml: cannot read the peering object op: (403)\nReason: Forbidden\n; standing by",
    ], said


class Switch(Leadership):
    """A replica whose lead is set by the test."""

    def __init__(self) -> None:
        super().__init__("op", "me", 1)
        self.leading = True

    async def leads(self, namespace: str) -> bool:
        return self.leading


def test_a_replica_that_lost_the_lead_scales_nothing_and_starts_afresh_when_it_leads_again(monkeypatch: Any) -> None:
    """While another replica leads, the loop neither reads nor writes (its watch is paused: the replicas
    and spec it holds are stale). When it leads again, what it saw before counts for nothing: a role
    busy when it lost the lead is not taken for idle since then."""
    states, index = sleepy_pipelines("p")
    window = (
        states.get((NAMESPACE, "p")).last_valid_spec.roles[Role.DENOISER].autoscaling.scale_down_stabilization_seconds
    )
    for deployments in index.values():
        deployments[0]["spec"]["replicas"] = 2  # awake
    work = {"p-denoiser": 30.0}
    calls = stub_api(monkeypatch, lambda name: work[name])
    now = [0.0]
    waker = wake.Waker(clock=lambda: now[0])
    replica = Switch()

    asyncio.run(waker.one_pass(states, index, replica))  # busy: the HPA's
    assert calls == []
    replica.leading = False
    work["p-denoiser"] = 0.0
    reads = []
    monkeypatch.setattr(kube, "deployment_metric", lambda name, ns, metric: reads.append(name) or 0.0)
    for _ in range(3):
        now[0] += window + 1  # past the stabilization window
        asyncio.run(waker.one_pass(states, index, replica))
    assert calls == [] and reads == []  # standing by: no read, no scale
    replica.leading = True
    asyncio.run(waker.one_pass(states, index, replica))
    assert calls == []  # idle from now on, not since it last saw work three windows ago
    now[0] += window
    asyncio.run(waker.one_pass(states, index, replica))
    assert ("scale", "p-denoiser", "0") in calls  # idle for the window since it leads again
