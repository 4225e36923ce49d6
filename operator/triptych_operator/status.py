"""A DiffusionPipeline's status, computed from its Deployments: `(generation, deployments) -> status`.

Conditions follow the Kubernetes convention (type/status/reason/message/lastTransitionTime,
observedGeneration): `Ready`, `Progressing`, `Degraded`, and one `<Component>Ready` per role
plus the head. Reasons are CamelCase and messages say what to look at or change.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from triptych_operator.constants import DEFAULT_ROLES, HEAD_COMPONENT, PIPELINE_ROLES, crd_field
from triptych_operator.serve_args import spec_field_of_flag

COMPONENTS: tuple[str, ...] = (*(crd_field(r) for r in PIPELINE_ROLES), HEAD_COMPONENT)
"""Every component a pipeline may have: its `app.kubernetes.io/component` label and status key."""

if TYPE_CHECKING:
    from triptych_operator.spec.model import PipelineSpec
DEFAULT_COMPONENTS: tuple[str, ...] = (*(crd_field(r) for r in DEFAULT_ROLES), HEAD_COMPONENT)

PHASE_READY = "Ready"
PHASE_PROGRESSING = "Progressing"
PHASE_DEGRADED = "Degraded"
PHASE_INVALID = "Invalid"


@dataclass(frozen=True)
class ComponentHealth:
    """How one component's Deployment is doing."""

    component: str
    ready: int
    desired: int
    is_ready: bool
    stuck: bool
    reason: str
    message: str

    @property
    def condition_type(self) -> str:
        return f"{self.component[0].upper()}{self.component[1:]}Ready"

    def summary(self) -> dict[str, Any]:
        return {"ready": f"{self.ready}/{self.desired}", "readyReplicas": self.ready, "replicas": self.desired}


def _condition(deployment: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


# Container states that need a person (fix the image, the Secret, the arguments); not transient.
STUCK_WAITING_REASONS = frozenset(
    {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError"}
)


REFUSAL = re.compile(r"^triptych: error: (.*)$", re.MULTILINE)
FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def startup_refusal(container: Mapping[str, Any]) -> str:
    """'; it exits with: <the process's one-line refusal> (spec.<role>.<field>)' when its last run refused to
    start, read from its termination message (the container's log tail: FallbackToLogsOnError); else ''."""
    terminated = (container.get("lastState") or {}).get("terminated") or {}
    refusals = REFUSAL.findall(str(terminated.get("message") or ""))
    if not refusals:
        return ""
    refusal = refusals[-1]
    fields = [f for f in (spec_field_of_flag(str(container.get("name")), m) for m in FLAG.findall(refusal)) if f]
    return f"; it exits with: {refusal}" + (f" (set by {fields[0]})" if fields else "")


def pod_problem(pods: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """(reason, message) for the first pod that cannot become ready without help, if any."""
    for pod in pods:
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        for cond in status.get("conditions") or []:
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                return "Unschedulable", f"pod {name} cannot be scheduled: {cond.get('message', '')}"
        for container in status.get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_WAITING_REASONS:
                detail = f": {waiting['message']}" if waiting.get("message") else ""
                detail += startup_refusal(container)
                return str(
                    waiting["reason"]
                ), f"pod {name} container {container.get('name')} is {waiting['reason']}{detail}"
    return None


def component_health(
    component: str,
    deployment: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]] = (),
    *,
    spec_error: bool = False,
    scales_to_zero: bool = False,
) -> ComponentHealth:
    """Read one Deployment (and its pods, for why they are not ready).

    Ready only when the current generation's pods are all updated and ready, or, for a role that
    scales to zero (`scales_to_zero`), when it has none while idle: the first request wakes it. Pods
    that cannot be scheduled or whose containers cannot start make the component stuck: waiting
    will not help.
    """
    if deployment is None:
        if spec_error:
            return ComponentHealth(component, 0, 0, False, False, "InvalidSpec", "not created: the spec is invalid")
        return ComponentHealth(component, 0, 0, False, False, "DeploymentMissing", "the Deployment is being created")
    name = deployment["metadata"]["name"]
    status = deployment.get("status") or {}
    desired = int((deployment.get("spec") or {}).get("replicas", 1))
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    if int(status.get("observedGeneration") or 0) < int(deployment["metadata"].get("generation") or 0):
        return ComponentHealth(component, ready, desired, False, False, "RolloutPending", f"{name}: rollout starting")
    failure = _condition(deployment, "ReplicaFailure")
    if failure and failure.get("status") == "True":
        msg = f"{name}: cannot create pods: {failure.get('message', '')}"
        return ComponentHealth(component, ready, desired, False, True, "ReplicaFailure", msg)
    progressing = _condition(deployment, "Progressing")
    if progressing and progressing.get("reason") == "ProgressDeadlineExceeded":
        msg = (
            f"{name}: rollout stalled with {ready}/{desired} pods ready; check `kubectl describe pods -l "
            f"app.kubernetes.io/component={component}` for unschedulable pods (GPUs, RDMA) or crashing containers"
        )
        return ComponentHealth(component, ready, desired, False, True, "RolloutStuck", msg)
    if desired == 0 and scales_to_zero:
        msg = f"{name} is scaled to 0 while idle; the first request for it wakes it (autoscaling.minReplicas 0)"
        return ComponentHealth(component, 0, 0, True, False, "IdleAtZero", msg)
    if desired == 0:
        msg = f"{name} is scaled to 0; the pipeline cannot serve until it has at least one replica"
        return ComponentHealth(component, 0, 0, False, False, "ScaledToZero", msg)
    if updated < desired or ready < desired:
        problem = pod_problem(pods)
        if problem is not None:
            reason, detail = problem
            msg = f"{name}: {ready}/{desired} pods ready; {detail}"
            return ComponentHealth(component, ready, desired, False, True, reason, msg)
        msg = f"{name}: {ready}/{desired} pods ready, {updated}/{desired} updated"
        return ComponentHealth(component, ready, desired, False, False, "WaitingForPods", msg)
    return ComponentHealth(component, ready, desired, True, False, "AllReplicasReady", f"{ready}/{desired} pods ready")


def _make(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def components_scaling_to_zero(spec: PipelineSpec | None) -> frozenset[str]:
    """The roles (as components) whose autoscaling takes them to zero pods while idle."""
    if spec is None:
        return frozenset()
    return frozenset(crd_field(role) for role, pool in spec.roles.items() if pool.autoscaling.scales_to_zero)


def pipeline_components(spec: PipelineSpec | None) -> tuple[str, ...]:
    """The components a pipeline reports: its declared roles and the head (the default shape while
    no valid spec was parsed yet)."""
    if spec is None:
        return DEFAULT_COMPONENTS
    return (*(crd_field(role) for role in spec.roles), HEAD_COMPONENT)


def compute_status(
    generation: int,
    deployments: Mapping[str, Mapping[str, Any] | None],
    pods: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    *,
    spec_error: str | None = None,
    apply_error: str | None = None,
    previous_conditions: Sequence[Mapping[str, Any]] = (),
    now: str,
    components: Sequence[str] = DEFAULT_COMPONENTS,
    scaling_to_zero: Collection[str] = frozenset(),
) -> dict[str, Any]:
    """The full status for a pipeline at `generation`, given its Deployments (and pods) by component.

    `spec_error` is the validation message when the spec cannot be deployed; objects from the last
    valid spec keep running and are still reported. `apply_error` is the API server refusing a
    child (admission, quota). `now` stamps conditions that changed. `components`: the pipeline's
    (its declared roles and the head; pipeline_components); `scaling_to_zero`: those of them that
    may have no pod while idle (components_scaling_to_zero).
    """
    pods = pods or {}
    health = [
        component_health(
            c,
            deployments.get(c),
            pods.get(c, ()),
            spec_error=spec_error is not None,
            scales_to_zero=c in scaling_to_zero,
        )
        for c in components
    ]
    not_ready = [h for h in health if not h.is_ready]
    stuck = [h for h in health if h.stuck]
    conditions = [_make(h.condition_type, h.is_ready, h.reason, h.message) for h in health]

    if not not_ready:
        ready = _make("Ready", True, "AllComponentsReady", "every role and the head have all pods ready")
    elif spec_error is not None and all(deployments.get(c) is None for c in components):
        ready = _make("Ready", False, "InvalidSpec", spec_error)
    else:
        names = ", ".join(f"{h.component} ({h.reason})" for h in not_ready)
        ready = _make("Ready", False, "ComponentsNotReady", f"not ready: {names}")

    rolling = [
        h for h in not_ready if not h.stuck and h.reason in ("RolloutPending", "WaitingForPods", "DeploymentMissing")
    ]
    if rolling:
        msg = "; ".join(h.message for h in rolling)
        progressing = _make("Progressing", True, "RollingOut", msg)
    else:
        progressing = _make("Progressing", False, "Stable", "no rollout in progress")

    if spec_error is not None:
        degraded = _make("Degraded", True, "InvalidSpec", f"{spec_error}; fix the spec, nothing new was applied")
    elif apply_error is not None:
        degraded = _make("Degraded", True, "ApplyFailed", f"the API server refused {apply_error}; retrying")
    elif stuck:
        degraded = _make("Degraded", True, stuck[0].reason, "; ".join(h.message for h in stuck))
    else:
        degraded = _make("Degraded", False, "AsExpected", "no problems detected")

    conditions = [ready, progressing, degraded, *conditions]
    _stamp(conditions, previous_conditions, generation, now)

    if spec_error is not None:
        phase = PHASE_INVALID
    elif stuck or apply_error is not None:
        phase = PHASE_DEGRADED
    elif not not_ready:
        phase = PHASE_READY
    else:
        phase = PHASE_PROGRESSING
    status: dict[str, Any] = {"observedGeneration": generation, "phase": phase, "conditions": conditions}
    for h in health:
        status[h.component] = h.summary()
    return status


def status_patch(status: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that makes the stored status `status`: a component it does not report (a role of
    the encoder shape the pipeline left) is removed (None); left out, the merge would keep it forever."""
    return {**dict.fromkeys((c for c in COMPONENTS if c not in status), None), **status}


def _stamp(conditions: list[dict[str, Any]], previous: Sequence[Mapping[str, Any]], generation: int, now: str) -> None:
    """Keep lastTransitionTime when a condition's status did not flip, so it tells when it last changed."""
    before = {c.get("type"): c for c in previous}
    for cond in conditions:
        old = before.get(cond["type"])
        same = old is not None and old.get("status") == cond["status"] and old.get("lastTransitionTime")
        cond["lastTransitionTime"] = old["lastTransitionTime"] if same and old else now
        cond["observedGeneration"] = generation
