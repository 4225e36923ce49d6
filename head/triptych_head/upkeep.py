"""The head's periodic upkeep (twice a second): pings, lost and leaving workers, timeouts, roles
with no instance, and the load it publishes (the autoscaling signal and admission's figures)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from triptych.params import GenerationParams
from triptych.roles import ROLE_SPECS, Role
from triptych_head import migration, preemption
from triptych_head.admission import retry_after_seconds
from triptych_head.deadline import LoadFigures, RoleFigures
from triptych_head.pipeline_view import build_view
from triptych_head.queues import parked
from triptych_head.state import ROLE_STATES, RequestRecord, RequestState
from triptych_head.workload import lora_loads

if TYPE_CHECKING:
    from triptych_head.core import HeadCore

log = logging.getLogger(__name__)


class LoadTracker:
    """What upkeep remembers between ticks."""

    def __init__(self, roles: Sequence[Role]):
        self.roles = list(roles)
        self.typical_seconds: dict[Role, float] = {}  # device-seconds of a request per role, for Retry-After
        self.last_params: GenerationParams | None = None  # the latest request's, for the estimate when idle
        self.no_instance_since: dict[Role, float] = {}  # roles with no ready instance, since when


def tick(core: HeadCore, now: float) -> None:
    membership = core.membership
    membership.ping_all()
    for inst in membership.lost():
        if inst.draining and not core.holds_anything(inst.url):
            log.info("%s %s drained and exited", inst.role.value, inst.url)
            continue
        core.instance_lost(
            inst,
            "heartbeat_lost",
            f"{inst.role.value} {inst.url} stopped responding (no heartbeat for {membership.heartbeat_timeout:g}s)",
        )
    _remove_idle_leavers(core)
    migration.drain_by_migration(core)  # draining denoisers hand their requests to ready ones
    core.dispatcher.reorder()  # waits grew: aged requests move up their queues
    preemption.preempt(core)  # and may now outrank a running denoise
    for rec in [r for r in core.requests.values() if now >= r.deadline]:
        core.finish(rec, RequestState.TIMED_OUT, _timeout_reason(core, rec), status_code=504)
    _fail_roles_without_instances(core, now)
    for rid in [rid for rid, held in core.held_slots.items() if now >= held.until]:
        log.warning("request %s: sender never reported its write; freeing the receive slot anyway", rid)
        core.release_held(rid)
    membership.publish_metrics()
    publish_load(core, now)
    core.metrics.active_requests.set(len(core.requests))


def _remove_idle_leavers(core: HeadCore) -> None:
    """Forget the instances discovery dropped once nothing of a request is left on them."""
    membership = core.membership
    for inst in membership.leaving():
        if not core.holds_anything(inst.url):
            membership.remove(inst)
        elif not membership.alive(inst):  # gone before finishing: what it held is retried
            core.instance_lost(inst, "left_discovery", f"{inst.role.value} {inst.url} left the service")
            membership.remove(inst)


def _fail_roles_without_instances(core: HeadCore, now: float) -> None:
    """Fail the requests waiting for a role that has had no ready instance for --disagg-no-instance-wait
    while requests waited for it: counted from when one first waited with none ready, so a role that
    had none for an hour (parked, or scaled to zero while idle) does not fail the request that wakes it."""
    wait = core.args.disagg_no_instance_wait
    membership, since_by_role = core.membership, core.load.no_instance_since
    for role, queue in core.dispatcher.queues.items():
        instances = membership.instances(role)
        waiting = [] if any(membership.ready(i) for i in instances) else _waiting_for(core, role, queue)
        if not waiting:
            since_by_role.pop(role, None)
            continue
        since = since_by_role.setdefault(role, now)
        if now - since < wait:
            continue
        alive = [i for i in instances if membership.alive(i)]
        reason = (
            f"no {role.value} instance has taken work for {now - since:.0f}s (--disagg-no-instance-wait "
            f"{wait:g}); {len(alive)} of {len(instances)} known {role.value} instances responding, none ready"
        )
        if wrong := sum(1 for i in alive if i.wrong_topology):
            flag = "without" if core.full_pipeline else "with"
            reason += f" ({wrong} started {flag} --disagg-full-pipeline, which this head's URL flags do not match)"
        if other := sum(1 for i in alive if i.wrong_model):
            reason += f" ({other} serve another model than this head's --model-path)"
        for rec in waiting:
            core.finish(rec, RequestState.FAILED, reason, status_code=503)


def _waiting_for(core: HeadCore, role: Role, queue: Iterable[str]) -> list[RequestRecord]:
    """The requests of `queue` that wait for an instance of `role`, and those parked earlier in their
    routes for want of one (queues.parked)."""
    records = (core.requests.get(rid) for rid in queue)
    waiting = [rec for rec in records if rec is not None and rec.role is role and rec.instance is None]
    if not ROLE_SPECS[role].needs_reference:  # only such a role parks requests (queues.parked)
        return waiting
    absent = frozenset((role,))
    return waiting + [
        rec for rec in core.requests.values() if rec.role is not role and rec.instance is None and parked(rec, absent)
    ]


def publish_load(core: HeadCore, now: float) -> None:
    """Per-role queued, running and estimated pending device-seconds (the autoscaling signal), and
    what admission needs: the load figures a new request's estimate starts from, the ready workers'
    slots and how long a refused client should wait."""
    roles, workload, load, metrics = core.load.roles, core.workload, core.load, core.metrics
    queued = dict.fromkeys(roles, 0)
    running = dict.fromkeys(roles, 0)
    pending = dict.fromkeys(roles, 0.0)
    per_request = dict.fromkeys(roles, 0.0)  # full estimates, for the Retry-After
    visiting = dict.fromkeys(roles, 0)
    held = core.membership.held_loras(Role.DENOISER)  # a request naming others costs their loads too
    for rec in core.requests.values():
        if rec.instance is None:
            queued[rec.role] += 1
        else:
            running[rec.role] += 1
        computing = rec.state is ROLE_STATES[rec.role][1]
        for role in rec.remaining_roles():
            running_for = now - rec.hop_started if computing and role is rec.role else None
            pending[role] += workload.remaining(role, rec.params, running_for, lora_loads(rec.params, held))
            per_request[role] += workload.estimate(role, rec.params)
            visiting[role] += 1
    slots, retry_after = 0, 1
    figures: dict[Role, RoleFigures] = {}
    for role in roles:
        metrics.role_queued.labels(role.value).set(queued[role])
        metrics.role_running.labels(role.value).set(running[role])
        metrics.role_pending_work.labels(role.value).set(pending[role])
        metrics.role_seconds_per_unit.labels(role.value).set(workload.seconds_per_unit(role))
        ready, role_slots = core.membership.ready_capacity(role)
        slots += role_slots
        figures[role] = RoleFigures(pending[role], ready, workload.seconds_per_unit(role), workload.calibrated(role))
        if visiting[role]:
            load.typical_seconds[role] = per_request[role] / visiting[role]
        elif load.last_params is not None:  # idle: what the latest request would cost, at today's rates
            load.typical_seconds[role] = workload.estimate(role, load.last_params)
        retry_after = max(retry_after, retry_after_seconds(load.typical_seconds.get(role, 0.0), ready))
    core.admission.update(
        slots, retry_after, LoadFigures(figures, frozenset(core.requests), held, workload.lora_load_s)
    )
    core.pipeline_view = build_view(core.membership.snapshot(), queued, running, core.requests.values(), now)


def view(core: HeadCore) -> dict[str, Any]:
    """GET /v1/pipeline: the instances as they are now (what /health shows), the queues and the
    requests as of the last tick (at most one tick old)."""
    tick_view, instances = core.pipeline_view, core.membership.snapshot()
    by_role = tick_view["roles"] or {role: {"queued": 0, "running": 0} for role in instances}  # before the first tick
    roles = {role: {**info, "instances": instances.get(role, [])} for role, info in by_role.items()}
    return {**tick_view, "topology": core.topology, "roles": roles}


def _timeout_reason(core: HeadCore, rec: RequestRecord) -> str:
    instances = core.membership.instances(rec.role)
    alive = sum(1 for i in instances if core.membership.alive(i))
    return (
        f"request timed out after {core.args.disagg_timeout:g}s (--disagg-timeout) in state {rec.state.value}; "
        f"{alive} of {len(instances)} {rec.role.value} instances responding"
    )
