"""Scale to zero: a role whose `autoscaling.minReplicas` is 0 has no pod while it has no work, and
gets one (or more) as soon as a request needs it.

An HPA does not go below one replica (minReplicas 0 needs an alpha feature gate), but it stands
aside while its target has none ("ScalingDisabled") and takes over again once it has one. So the
operator makes the two steps the HPA cannot, as KEDA does, from the HPA's own signal (the role's
`triptych_pending_work_seconds`, read through the custom metrics API):

- **to zero**: the role's pending work has been 0 for `scaleDownStabilizationSeconds`: its
  Deployment's scale is set to 0 (its pods drain as on any scale-down);
- **from zero**: pending work while it has no pod: ceil(work / `targetWorkSecondsPerReplica`) pods,
  within [1, `maxReplicas`]; the HPA goes on from there.

Every WAKE_INTERVAL_S, for each such role of the pipelines this operator reconciles, one read (the
metric; the Deployment's replicas come from the operator's watch, its kopf index) and, when it
decides, one write and an Event on the pipeline; nothing for the other pipelines. With several
operator replicas only the one kopf lets work passes (leading.py): the others' watches are paused,
so what they saw is stale. Without the
metric (no metrics server, no head answering) nothing changes: a role is never taken to zero on a
missing signal. The head lets requests wait for a role at zero as long as they may live
(serve_args.head_wake_wait).

A Deployment put to sleep carries the ASLEEP annotation until it wakes, so that a role whose
`minReplicas` is raised (or whose autoscaling is turned off) while it sleeps is woken by the
pipeline's reconcile (`left_asleep`): its HPA, which never goes below 1, would otherwise stand aside
at 0 for good.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.client import ApiException

from triptych_operator import kube
from triptych_operator.constants import API_TIME_FORMAT, GROUP, PENDING_WORK_METRIC, crd_field
from triptych_operator.leading import Leadership
from triptych_operator.pipeline_state import PipelineStates
from triptych_operator.serve_args import object_name
from triptych_operator.spec.model import Autoscaling, PipelineSpec

log = logging.getLogger(__name__)

WAKE_INTERVAL_S = 5.0
# How long the watch may still show the replicas a scale of this loop changed: meanwhile nothing is
# decided on that stale figure (no second scale, no second Event), as a controller's expectations.
WATCH_LAG_S = 30.0
# The kopf index of the operator's Deployments: (namespace, pipeline) -> the Deployments' bodies.
DeploymentIndex = Mapping[tuple[str, str], Iterable[Mapping[str, Any]]]
SCALER = "triptych-operator-scale-to-zero"  # the field manager of the replicas it sets (never the HPA's)
ASLEEP = f"{GROUP}/asleep"  # on a Deployment this operator took to zero: since when (UTC)


@dataclass(frozen=True)
class SleepyRole:
    """A role that scales to zero, of one pipeline."""

    namespace: str
    pipeline: str
    uid: str  # the pipeline's, for its Events
    component: str  # the role's CRD field (denoiser, prompt_encoder, ...)
    deployment: str
    autoscaling: Autoscaling


def roles_to_watch(states: PipelineStates) -> Iterator[SleepyRole]:
    """The roles that scale to zero in the pipelines this process reconciled, as their last valid spec
    declares them: an invalid edit leaves that spec's objects running, so they still wake for work."""
    for (namespace, name), state in list(states.by_key.items()):
        spec = state.last_valid_spec
        if spec is None or state.parsed_for is None:
            continue
        for role, pool in spec.roles.items():
            if pool.autoscaling.scales_to_zero:
                deployment = object_name(name, role.dns_name)
                yield SleepyRole(namespace, name, state.parsed_for[0], crd_field(role), deployment, pool.autoscaling)


def decide(replicas: int, pending_s: float, idle_s: float, auto: Autoscaling) -> int | None:
    """The replicas to set now, or None to leave them (to the HPA, while the role has pods and work)."""
    if pending_s > 0:
        if replicas > 0:
            return None
        wanted = math.ceil(pending_s / auto.target_work_seconds_per_replica)
        return max(1, min(wanted, auto.max_replicas or 1))
    if replicas > 0 and idle_s >= auto.scale_down_stabilization_seconds:
        return 0
    return None


class Waker:
    """Takes the roles that scale to zero down when idle and up when needed, one pass at a time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._busy: dict[tuple[str, str], float] = {}  # (namespace, deployment) -> when it last had work
        self._silent: set[tuple[str, str]] = set()  # those without a metric, logged once until it comes back
        self._scaled: dict[tuple[str, str], tuple[int, float]] = {}  # -> (the replicas it changed, when)

    async def one_pass(
        self, states: PipelineStates, deployments: DeploymentIndex, leadership: Leadership | None = None
    ) -> None:
        """`deployments`: the operator's kopf index of Deployments, by (namespace, pipeline);
        `leadership`: whether this replica acts on a namespace (leading.py; None: standalone). A role
        it does not act on now is forgotten (when it last had work, what it scaled): a replica that
        leads again later starts afresh, not from what it saw before another replica took over."""
        seen = set()
        leading: dict[str, bool] = {}  # per namespace, read once a pass
        for role in roles_to_watch(states):
            if leadership is not None:
                if role.namespace not in leading:
                    leading[role.namespace] = await leadership.leads(role.namespace)
                if not leading[role.namespace]:
                    continue
            key = (role.namespace, role.deployment)
            seen.add(key)
            try:
                await self._check(role, key, live_replicas(deployments, role))
            except asyncio.CancelledError:
                raise
            except Exception:  # an API error: this role's next check is in the next pass, the others go on
                log.exception("scale to zero: checking %s/%s failed", role.namespace, role.deployment)
        for gone in set(self._busy) - seen:
            del self._busy[gone]
        for gone in set(self._scaled) - seen:
            del self._scaled[gone]
        self._silent &= seen

    async def _check(self, role: SleepyRole, key: tuple[str, str], replicas: int | None) -> None:
        if replicas is None:
            return  # not created yet (or not seen by the watch yet)
        if self._stale(key, replicas):
            return
        pending = await kube.run(kube.deployment_metric, role.deployment, role.namespace, PENDING_WORK_METRIC)
        now = self._clock()
        if pending is None:
            if key not in self._silent:
                self._silent.add(key)
                log.warning(
                    "%s/%s: no %s from the custom metrics API; its replicas stay %d until there is",
                    role.namespace, role.deployment, PENDING_WORK_METRIC, replicas,
                )  # fmt: skip
            return
        self._silent.discard(key)
        last_busy = self._busy.setdefault(key, now)  # first seen: idle from now on, not since ever
        if pending > 0:
            self._busy[key] = last_busy = now
        wanted = decide(replicas, pending, now - last_busy, role.autoscaling)
        if wanted is None or wanted == replicas:
            return
        await _scale(role.deployment, role.namespace, wanted)
        self._scaled[key] = (replicas, self._clock())
        if wanted:
            reason = "ScaledFromZero"
            message = f"{role.component}: {pending:g} s of work pending, no pod; {role.deployment} scaled to {wanted}"
        else:
            reason = "ScaledToZero"
            message = (
                f"{role.component}: no work for {role.autoscaling.scale_down_stabilization_seconds} s "
                f"(scaleDownStabilizationSeconds); {role.deployment} scaled to 0 until a request needs it"
            )
        log.info("%s/%s: %s", role.namespace, role.pipeline, message)
        await kube.run(kube.pipeline_event, role.pipeline, role.namespace, role.uid, reason, message)

    def _stale(self, key: tuple[str, str], replicas: int) -> bool:
        """Whether the watch still shows the replicas this loop's last scale of `key` changed (for up
        to WATCH_LAG_S): a decision on them would repeat that scale."""
        scaled = self._scaled.get(key)
        if scaled is None:
            return False
        before, at = scaled
        if replicas == before and self._clock() - at < WATCH_LAG_S:
            return True
        del self._scaled[key]
        return False


def live_replicas(deployments: DeploymentIndex, role: SleepyRole) -> int | None:
    """The replicas the role's Deployment asks for, as the watch last saw it; None when it has not
    seen one (not created yet). The HPA and this loop set them through the scale subresource, which
    writes the Deployment's spec.replicas: the watch sees each change."""
    for deployment in deployments.get((role.namespace, role.pipeline)) or ():
        if deployment["metadata"]["name"] == role.deployment:
            return int((deployment.get("spec") or {}).get("replicas", 1))  # the API's default when unset
    return None


async def _scale(deployment: str, namespace: str, replicas: int) -> None:
    """Set the replicas; marked ASLEEP at 0 (before the scale: a crash in between leaves a mark, not
    an unmarked Deployment at 0), unmarked once woken."""
    if replicas == 0:
        since = datetime.datetime.now(datetime.UTC).strftime(API_TIME_FORMAT)
        await kube.run(kube.annotate_deployment, deployment, namespace, {ASLEEP: since}, SCALER)
    await kube.run(kube.scale_deployment, deployment, namespace, replicas, SCALER)
    if replicas:
        await kube.run(kube.annotate_deployment, deployment, namespace, {ASLEEP: None}, SCALER)


def left_asleep(spec: PipelineSpec, deployments: Iterable[Mapping[str, Any]]) -> list[tuple[str, int | None]]:
    """The Deployments this operator put to sleep whose role no longer scales to zero, with the replicas
    to wake each to (None: the role is no longer autoscaled, so its apply sets them)."""
    by_name = {d["metadata"]["name"]: d for d in deployments}
    found = []
    for role, pool in spec.roles.items():
        name = object_name(spec.name, role.dns_name)
        live = by_name.get(name)
        if live is None or pool.autoscaling.scales_to_zero or ASLEEP not in (live["metadata"].get("annotations") or {}):
            continue
        asleep = int((live.get("spec") or {}).get("replicas") or 0) == 0
        found.append((name, max(1, pool.autoscaling.min_replicas) if pool.autoscaling.enabled and asleep else None))
    return found


async def wake_left_asleep(spec: PipelineSpec, namespace: str, deployments: Iterable[Mapping[str, Any]]) -> None:
    """Wake (or just unmark) what `left_asleep` finds; called by the pipeline's reconcile, which an API
    error here does not stop (the pipeline's next reconcile tries again: the mark stays until done)."""
    for name, replicas in left_asleep(spec, deployments):
        try:
            if replicas is None:
                await kube.run(kube.annotate_deployment, name, namespace, {ASLEEP: None}, SCALER)
            else:
                log.info("%s/%s no longer scales to zero: woken with %d replicas", namespace, name, replicas)
                await _scale(name, namespace, replicas)
        except ApiException as exc:
            log.warning("%s/%s: could not wake it (%s); the next reconcile tries again", namespace, name, exc.reason)


async def run(
    states: PipelineStates,
    deployments: DeploymentIndex,
    leadership: Leadership | None = None,
    interval_s: float = WAKE_INTERVAL_S,
) -> None:
    """Pass over the roles that scale to zero every `interval_s`, until cancelled; `deployments` is
    the operator's live kopf index of its Deployments (handlers.start_waking passes it), `leadership`
    whether this replica is the one that acts (leading.py)."""
    waker = Waker()
    while True:
        try:
            await waker.one_pass(states, deployments, leadership)
        except asyncio.CancelledError:
            raise
        except Exception:  # an API error: the next pass tries again
            log.exception("scale to zero: a pass failed; the next one is in %g s", interval_s)
        await asyncio.sleep(interval_s)
