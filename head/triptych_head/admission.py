"""Admission control: which requests the head takes, and the 429 with Retry-After for the others.

A request is refused because it would miss its deadline, not because a counter is full. Each
request has one (`deadline_seconds`, the `X-Deadline-Seconds` header, or by default the request
timeout, --disagg-timeout); the head estimates when it would complete from the work ahead of it and
its own (deadline.py) and answers 429 (`code: deadline_unachievable`, the estimate and the deadline
in the body) when the estimate is beyond the deadline. An accepted request is told its estimate.

`--max-queued-requests N` adds a hard cap as a safety valve, in requests:

    max in flight = worker slots + N

(worker slots: the --worker-capacity of every ready worker, summed over the roles), beyond which a
request gets 429 `code: overloaded`. It is off unless given, except in monolithic mode, which has
no work model to estimate with and keeps MIN_QUEUED queued requests by default.

The DiffusionServer sees the pools and the queues: on its periodic tick (never on a request's path)
it publishes the load figures (deadline.LoadFigures), the slots and the Retry-After estimate. The
HTTP API estimates each request against the latest figures plus the work it accepted since they
were counted, counts the requests it has accepted and not answered yet (video jobs included, from
their POST), and refuses at once: a refused video job is refused at its POST, never failed later.

Retry-After is, for a missed deadline, how long until the backlog ahead has shrunk enough (the
estimate minus the deadline); for the cap, how long until one request in flight is likely to
finish: the estimated device-seconds per request of the slowest role (over the requests in flight),
divided by that role's ready instances. At least 1 s either way.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_head.deadline import Estimate, LoadFigures, estimate, own_work
from triptych_head.metrics import HeadMetrics

MIN_QUEUED = 8  # monolithic mode's default cap beyond its one running request
DEFAULT_RETRY_AFTER_S = 5  # before anything was measured (and in monolithic mode)
MAX_RETRY_AFTER_S = 300


@dataclass(frozen=True)
class AdmissionLimit:
    worker_slots: int
    max_queued: int | None  # None: no cap in requests (the deadline alone decides)
    retry_after_s: int

    @property
    def max_in_flight(self) -> int | None:
        return None if self.max_queued is None else self.worker_slots + self.max_queued


class Overloaded(Exception):
    """More requests in flight than --max-queued-requests admits; retry after `retry_after_s`."""

    def __init__(self, limit: AdmissionLimit, in_flight: int) -> None:
        super().__init__(
            f"the pipeline is at capacity ({in_flight} requests in flight: {limit.worker_slots} worker slots "
            f"+ {limit.max_queued} queued, --max-queued-requests); retry after {limit.retry_after_s}s"
        )
        self.retry_after_s = limit.retry_after_s


class DeadlineUnachievable(Exception):
    """The request's estimated completion is beyond its deadline; retry after `retry_after_s`."""

    def __init__(self, estimate: Estimate, deadline_s: float) -> None:
        self.estimate, self.deadline_s = estimate, deadline_s
        self.retry_after_s = retry_after_seconds(estimate.seconds - deadline_s, 1)
        if estimate.work_s > deadline_s:
            why = f"its own work alone is estimated at {estimate.work_s:.1f}s"
        else:
            why = (
                f"{estimate.wait_s:.1f}s of work is ahead of it and its own is estimated at {estimate.work_s:.1f}s; "
                f"retry after {self.retry_after_s}s or with a later deadline"
            )
        basis = "this deployment's measured stage times" if estimate.calibrated else "prior figures (not measured yet)"
        super().__init__(
            f"the request would complete in about {estimate.seconds:.1f}s, after its deadline of {deadline_s:g}s: "
            f"{why} (from {basis})"
        )


def retry_after_seconds(seconds_per_request: float, instances: int) -> int:
    """Whole seconds until one of the slowest role's requests is likely to finish (1..MAX_RETRY_AFTER_S)."""
    estimate = seconds_per_request / max(instances, 1)
    return min(max(math.ceil(estimate), 1), MAX_RETRY_AFTER_S)


class AdmissionControl:
    """The figures, updated by the DiffusionServer's tick (another thread), and the decision, taken by the API.

    The limit and the figures are immutable objects replaced whole, so a reader never sees half an
    update; the work accepted since the last tick is kept under a lock both threads take briefly.
    """

    def __init__(
        self, max_queued: int | None, metrics: HeadMetrics, worker_slots: int = 0,
        retry_after_s: int = DEFAULT_RETRY_AFTER_S,
    ) -> None:  # fmt: skip
        self._max_queued = max_queued
        self._metrics = metrics
        self.limit = AdmissionLimit(worker_slots, max_queued, retry_after_s)
        self.figures: LoadFigures | None = None  # None until the first tick (and always in monolithic mode)
        self._lock = threading.Lock()
        self._unseen: dict[str, dict[Role, float]] = {}  # accepted requests the figures do not count yet
        self._unseen_s: dict[Role, float] = {}  # their work per role, summed
        self._publish()

    def update(self, worker_slots: int, retry_after_s: int, figures: LoadFigures | None = None) -> None:
        """The tick's figures: the ready workers' slots, the Retry-After of the cap, and the load."""
        limit = AdmissionLimit(worker_slots, self._max_queued, retry_after_s)
        if limit != self.limit:
            self.limit = limit
            self._publish()
        if figures is not None:
            with self._lock:
                self._unseen = {rid: w for rid, w in self._unseen.items() if rid not in figures.counted}
                self._unseen_s = _summed(self._unseen.values())
                self.figures = figures
                unseen_s = dict(self._unseen_s)
            wait = max((figures.wait_s(role, unseen_s.get(role, 0.0)) for role in figures.roles), default=0.0)
            self._metrics.admission_wait.set(wait)

    def _publish(self) -> None:
        limit = self.limit
        self._metrics.admission_max_in_flight.set(math.inf if limit.max_in_flight is None else limit.max_in_flight)
        self._metrics.admission_worker_slots.set(limit.worker_slots)
        self._metrics.admission_retry_after.set(limit.retry_after_s)

    def admit(
        self, request_id: str, params: GenerationParams, deadline_s: float | None, in_flight: int,
        bounded: bool = True,
    ) -> Estimate | None:  # fmt: skip
        """Take the request, or raise DeadlineUnachievable / Overloaded (counted as rejected). The
        estimate of its completion, or None without figures to estimate with (before the first tick,
        in monolithic mode). `bounded=False`: take it whatever the load (accepted once already)."""
        limit = self.limit
        if bounded and limit.max_in_flight is not None and in_flight >= limit.max_in_flight:
            self._metrics.rejected_overloaded.inc()
            raise Overloaded(limit, in_flight)
        with self._lock:
            figures = self.figures
            if figures is None:
                return None
            work = own_work(figures, params)
            guess = estimate(figures, work, self._unseen_s)
            if bounded and deadline_s is not None and guess.seconds > deadline_s:
                self._metrics.rejected_deadline.inc()
                raise DeadlineUnachievable(guess, deadline_s)
            self._unseen[request_id] = work
            for role, seconds in work.items():
                self._unseen_s[role] = self._unseen_s.get(role, 0.0) + seconds
        self._metrics.admission_estimate.observe(guess.seconds)
        return guess

    def release(self, request_id: str) -> None:
        """The request was answered: its work is no longer ahead of anyone."""
        with self._lock:
            work = self._unseen.pop(request_id, None)
            if work is not None:
                for role, seconds in work.items():
                    self._unseen_s[role] = max(self._unseen_s.get(role, 0.0) - seconds, 0.0)

    def count(self, in_flight: int) -> None:
        """The API's requests in flight changed (the current load, exported beside the bound)."""
        self._metrics.admission_in_flight.set(in_flight)

    def snapshot(self, in_flight: int) -> dict[str, Any]:
        """For /health."""
        limit, figures = self.limit, self.figures
        with self._lock:
            unseen_s = dict(self._unseen_s)
        roles = () if figures is None else figures.roles
        waits = {r.value: round(figures.wait_s(r, unseen_s.get(r, 0.0)), 3) for r in roles if figures is not None}
        return {
            "in_flight": in_flight,
            "max_in_flight": limit.max_in_flight,
            "worker_slots": limit.worker_slots,
            "max_queued": limit.max_queued,
            "retry_after_s": limit.retry_after_s,
            "wait_s": waits,  # per role: how long a new request would wait behind the work ahead of it
        }


def _summed(works: Iterable[Mapping[Role, float]]) -> dict[Role, float]:
    total: dict[Role, float] = {}
    for work in works:
        for role, seconds in work.items():
            total[role] = total.get(role, 0.0) + seconds
    return total
