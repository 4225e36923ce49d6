"""Admission control: how many requests the head takes before it answers 429 with Retry-After.

Without a bound an overloaded head queues everything it is sent, and every request's latency grows
with the queue (with real models, to hours). The bound is in requests, sized to the pools:

    max in flight = worker slots + max queued

- worker slots: the --worker-capacity of every ready worker, summed over the roles (what the pools
  hold at once: one request running and the next prefetched per worker, by default);
- max queued: --max-queued-requests, or by default QUEUED_PER_SLOT per worker slot and at least
  MIN_QUEUED (so a head whose workers have not heartbeat yet still lets a few requests wait).

The DiffusionServer sees the pools and the queues: on its periodic tick (never on a request's
path) it recomputes the slots and the Retry-After estimate. The HTTP API counts the requests it
has accepted and not answered yet (video jobs included, from their POST) and answers 429 once that
count reaches the bound, so a refused video job is refused at once, never failed later.

Retry-After is how long until one request in flight is likely to finish: the estimated
device-seconds per request of the slowest role (workload.py's calibrated per-unit seconds over
the requests in flight), divided by that role's ready instances; at least 1 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from triptych_head.metrics import HeadMetrics

QUEUED_PER_SLOT = 2
MIN_QUEUED = 8
DEFAULT_RETRY_AFTER_S = 5  # before anything was measured (and in monolithic mode)
MAX_RETRY_AFTER_S = 300


@dataclass(frozen=True)
class AdmissionLimit:
    worker_slots: int
    max_queued: int
    retry_after_s: int

    @property
    def max_in_flight(self) -> int:
        return self.worker_slots + self.max_queued


class Overloaded(Exception):
    """More requests in flight than the head admits; retry after `retry_after_s`."""

    def __init__(self, limit: AdmissionLimit, in_flight: int) -> None:
        super().__init__(
            f"the pipeline is at capacity ({in_flight} requests in flight: {limit.worker_slots} worker slots "
            f"+ {limit.max_queued} queued, --max-queued-requests); retry after {limit.retry_after_s}s"
        )
        self.retry_after_s = limit.retry_after_s


def retry_after_seconds(seconds_per_request: float, instances: int) -> int:
    """Whole seconds until one of the slowest role's requests is likely to finish (1..MAX_RETRY_AFTER_S)."""
    estimate = seconds_per_request / max(instances, 1)
    return min(max(math.ceil(estimate), 1), MAX_RETRY_AFTER_S)


class AdmissionControl:
    """The bound: updated by the DiffusionServer's tick (another thread), read by the API.

    The current limit is one immutable object replaced whole, so a reader never sees half an update.
    """

    def __init__(
        self, max_queued: int | None, metrics: HeadMetrics, worker_slots: int = 0,
        retry_after_s: int = DEFAULT_RETRY_AFTER_S,
    ) -> None:  # fmt: skip
        self._max_queued = max_queued
        self._metrics = metrics
        self.limit = self._limit(worker_slots, retry_after_s)
        self._publish()

    def _limit(self, worker_slots: int, retry_after_s: int) -> AdmissionLimit:
        queued = max(QUEUED_PER_SLOT * worker_slots, MIN_QUEUED) if self._max_queued is None else self._max_queued
        return AdmissionLimit(worker_slots, queued, retry_after_s)

    def update(self, worker_slots: int, retry_after_s: int) -> None:
        limit = self._limit(worker_slots, retry_after_s)
        if limit != self.limit:
            self.limit = limit
            self._publish()

    def _publish(self) -> None:
        self._metrics.admission_max_in_flight.set(self.limit.max_in_flight)
        self._metrics.admission_worker_slots.set(self.limit.worker_slots)
        self._metrics.admission_retry_after.set(self.limit.retry_after_s)

    def check(self, in_flight: int) -> None:
        """Raise Overloaded when `in_flight` requests already fill the bound (counted as rejected)."""
        limit = self.limit
        if in_flight >= limit.max_in_flight:
            self._metrics.rejected_overloaded.inc()
            raise Overloaded(limit, in_flight)

    def count(self, in_flight: int) -> None:
        """The API's requests in flight changed (the current load, exported beside the bound)."""
        self._metrics.admission_in_flight.set(in_flight)

    def snapshot(self, in_flight: int) -> dict[str, Any]:
        """For /health."""
        limit = self.limit
        return {
            "in_flight": in_flight,
            "max_in_flight": limit.max_in_flight,
            "worker_slots": limit.worker_slots,
            "max_queued": limit.max_queued,
            "retry_after_s": limit.retry_after_s,
        }
