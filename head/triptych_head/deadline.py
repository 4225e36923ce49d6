"""When a new request would complete: the estimate deadline-aware admission compares to its deadline.

A request may carry a deadline, in seconds from its arrival (`deadline_seconds` in the body, or the
`X-Deadline-Seconds` header; by default the request timeout, --disagg-timeout). The head refuses it
at once (429, `deadline_unachievable`, admission.py) when the estimate is beyond it, and tells an
accepted one its estimate.

Per role R of the request's route, from workload.py's units and calibrated seconds per unit:

    wait(R)  = pending(R) / ready instances of R       the work accepted requests still need from R
    own(R)   = units(R, request) x seconds_per_unit(R)  one instance runs it
    estimate = max over R of wait(R)  +  sum over R of own(R)

pending(R) is the autoscaling signal's device-seconds (every accepted request's remaining work for R,
also of those that have not reached R yet), plus the work of requests the API accepted since the
tick last counted. The roles drain their backlogs side by side, each on other requests, so a new
request waits behind the largest one, not their sum; then its own stages run one after the other.
A role with no ready instance counts as one (requests wait for instances: --disagg-no-instance-wait).

A request naming LoRA adapters no ready denoiser holds adds their loads to the denoiser's own work.
The estimate is as good as the work model: before a role's first measured request it uses the
priors (PRIOR_SECONDS_PER_UNIT, `calibrated` False), and it ignores a request's fixed costs
(transfers, start-up of a stage). It only refuses a request whose estimate exceeds its deadline.
Everything here is arithmetic on figures the head's tick publishes (LoadFigures) and the request's own
parameters: nothing on the request's path waits for the DiffusionServer's loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from triptych.params import GenerationParams
from triptych.roles import Role, route_for
from triptych_head.workload import lora_loads, work_units


@dataclass(frozen=True)
class RoleFigures:
    """One role's load as of the tick."""

    pending_s: float  # device-seconds the accepted requests still need from it
    ready: int  # ready instances
    seconds_per_unit: float
    calibrated: bool  # seconds_per_unit was measured on this deployment (False: the prior)


@dataclass(frozen=True)
class LoadFigures:
    """What the tick publishes for admission: every role's figures and the requests they count."""

    roles: Mapping[Role, RoleFigures] = field(default_factory=dict)
    counted: frozenset[str] = frozenset()  # ids of the requests pending_s includes
    held_loras: frozenset[str] = frozenset()  # the LoRA adapters some ready denoiser holds
    lora_load_s: float = 0.0  # one adapter load on a denoiser (workload.WorkEstimator.lora_load_s)

    def wait_s(self, role: Role, unseen_s: float = 0.0) -> float:
        figures = self.roles.get(role)
        if figures is None:
            return 0.0
        return (figures.pending_s + unseen_s) / max(figures.ready, 1)


@dataclass(frozen=True)
class Estimate:
    """Seconds from now until a request completes: waiting behind others, then its own work."""

    wait_s: float
    work_s: float
    calibrated: bool  # every role of its route was measured (False: some figures are priors)

    @property
    def seconds(self) -> float:
        return self.wait_s + self.work_s


def route(figures: LoadFigures, params: GenerationParams) -> list[Role]:
    """The roles a request visits in this deployment (as the DiffusionServer routes it)."""
    return route_for(frozenset(figures.roles), has_reference=params.has_reference)


def own_work(figures: LoadFigures, params: GenerationParams) -> dict[Role, float]:
    """Device-seconds the request needs from each role of its route (the denoiser's with the loads of
    the LoRA adapters it names that no ready denoiser holds)."""
    work = {role: work_units(role, params) * figures.roles[role].seconds_per_unit for role in route(figures, params)}
    if Role.DENOISER in work:
        work[Role.DENOISER] += lora_loads(params, figures.held_loras) * figures.lora_load_s
    return work


def estimate(figures: LoadFigures, work: Mapping[Role, float], unseen_s: Mapping[Role, float]) -> Estimate:
    """When a request needing `work` (own_work) would complete; `unseen_s`: per role, the work of
    requests accepted since the figures were counted."""
    wait = max((figures.wait_s(role, unseen_s.get(role, 0.0)) for role in work), default=0.0)
    calibrated = all(figures.roles[role].calibrated for role in work)
    return Estimate(wait_s=wait, work_s=sum(work.values()), calibrated=calibrated)
