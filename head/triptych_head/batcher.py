"""Dynamic batching in the head (--batching-mode dynamic): which queued requests leave together.

A role's queue is split into groups of compatible requests (triptych.batching.batch_key), in queue
order, each at most --batching-max-size. A group leaves for one worker instance when it is full,
when its oldest request has waited --batching-delay-ms (or the role's own from
--batching-role-delay-ms), or when it already fills the room of the roomiest ready instance (its
free slots, at most its own --batching-max-size, which it heartbeats: waiting longer could not make
the group larger). The server sends a group for the first role as one WorkBatch, and tags a later
role's transfers with the group's id and size so that the receiver runs them together
(protocol/messages.py; the size counts the members still on their way, state.BatchTag).

With --enable-batching-metrics, /metrics has per role: the sizes of the groups the head sent
(triptych_batch_size; a first role's group whose WorkBatch is over the control header limit goes
as one Work each, so it counts as that many groups of one, and a request that failed on the way
counts in none), how long their oldest request waited for the group to form
(triptych_batch_wait_seconds), how full they left (triptych_batch_fill_ratio: size / max size) and
the batches the workers ran (triptych_worker_batch_size, from what each worker reports with a
request's output: a group may run split when a worker's own --batching-max-size is smaller).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from triptych.batching import batch_key
from triptych.protocol import Work
from triptych.roles import Role
from triptych_head.instances import WorkerInstance
from triptych_head.state import RequestRecord

SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1)
FILL_BUCKETS = (0.125, 0.25, 0.5, 0.75, 0.999, 1)


class BatchingMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.size = Histogram(
            "triptych_batch_size",
            "Requests per group the head sent (a group over the control header limit goes as groups of one)",
            ["role"],
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.wait = Histogram(
            "triptych_batch_wait_seconds",
            "How long a group's oldest request waited in the queue before the group left",
            ["role"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.fill = Histogram(
            "triptych_batch_fill_ratio",
            "Group size over --batching-max-size",
            ["role"],
            buckets=FILL_BUCKETS,
            registry=r,
        )
        self.worker_size = Histogram(
            "triptych_worker_batch_size",
            "Requests per batched forward, as the workers report running them",
            ["role"],
            buckets=SIZE_BUCKETS,
            registry=r,
        )

    def observe_ran(self, role: str, batch_size: int, leader: bool) -> None:
        """A worker's report of the batch one request ran in; each batch counts once (its leader)."""
        if leader:
            self.worker_size.labels(role).observe(batch_size)


@dataclass
class Group:
    """Requests leaving together for one instance; `work` collects the first role's Work items;
    `apart`: they left as one Work each instead (their WorkBatch was over the control header limit)."""

    instance: WorkerInstance
    members: list[RequestRecord]
    work: list[Work] = field(default_factory=list)
    apart: bool = False
    queued_since: list[float] = field(init=False)  # the members' hop_started: their dispatch restarts it

    def __post_init__(self) -> None:
        self.queued_since = [rec.hop_started for rec in self.members]

    @property
    def batch_id(self) -> str:
        return self.members[0].wire_id


class GroupBatcher:
    def __init__(
        self,
        max_size: int,
        delay_s: float,
        metrics: BatchingMetrics | None = None,
        role_delays_s: Mapping[Role, float] | None = None,
    ):
        self.max_size = max_size
        self.delay_s = delay_s  # every role's, but those in role_delays_s (--batching-role-delay-ms)
        self.role_delays_s = dict(role_delays_s or {})
        self.metrics = metrics

    def delay_for(self, role: Role) -> float:
        """How long `role`'s oldest queued request may wait for its group to fill."""
        return self.role_delays_s.get(role, self.delay_s)

    @property
    def shortest_delay_s(self) -> float:
        """The shortest wait of any role: how often the head's loop must look at least."""
        return min([self.delay_s, *self.role_delays_s.values()])

    def ready_groups(
        self, queued: Iterable[RequestRecord], room: int, now: float, delay_s: float | None = None
    ) -> list[list[RequestRecord]]:
        """The groups that may leave now, in queue order (`queued`'s: by priority level, then first
        come first served) of each group's first member; `room`: the largest group a ready instance
        takes now; `delay_s`: the role's wait (delay_for), else every role's."""
        delay_s = self.delay_s if delay_s is None else delay_s
        limit = min(self.max_size, room)
        if limit <= 0:
            return []
        by_key: dict[tuple[Any, ...], list[RequestRecord]] = {}
        place: dict[str, int] = {}
        for rec in queued:
            place[rec.wire_id] = len(place)
            # Continuations (migration.py) batch only with continuations of the same step.
            step = rec.staged.continues_at if rec.staged else None
            by_key.setdefault((step, *batch_key(rec.params, rec.wire_id)), []).append(rec)
        groups: list[list[RequestRecord]] = []
        for members in by_key.values():
            for start in range(0, len(members), limit):
                chunk = members[start : start + limit]
                if len(chunk) >= limit or now - chunk[0].hop_started >= delay_s:
                    groups.append(chunk)
        groups.sort(key=lambda chunk: place[chunk[0].wire_id])  # not by age: a higher level goes first
        return groups

    def observe_sent(self, role: str, group: Group, now: float) -> None:
        """The group as it left: one group, or one group of one per member when it went apart. Of its
        members, those its instance got: not one left queued, nor one that failed on the way (too large)."""
        if self.metrics is None:
            return
        sent = [
            since
            for rec, since in zip(group.members, group.queued_since, strict=True)
            if rec.instance == group.instance.url and not rec.state.terminal
        ]
        for queued_since in [[since] for since in sent] if group.apart else [sent]:
            size = len(queued_since)
            if not size:
                continue
            self.metrics.size.labels(role).observe(size)
            self.metrics.wait.labels(role).observe(max(0.0, now - min(queued_since)))
            self.metrics.fill.labels(role).observe(size / self.max_size)
