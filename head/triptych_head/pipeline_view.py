"""What the playground's pipeline view and `triptych status` show: each role's instances, queue and
running requests, and every request in flight with where it is (GET /v1/pipeline).

Built by the DiffusionServer's loop at each upkeep tick (twice a second) from what it already
walks for its load metrics, and swapped in whole, so the API thread reads one consistent picture
without a lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from triptych import priority
from triptych.roles import Role
from triptych_head.state import RequestRecord

MAX_LISTED_REQUESTS = 200  # the oldest first; a busy head's view lists no more than this


def request_view(rec: RequestRecord, now: float) -> dict[str, Any]:
    return {
        "id": rec.request_id,
        "state": rec.state.value,
        "role": rec.role.value,
        "done": [role.value for role in rec.route[: rec.hop]],  # the roles it has passed through
        "instance": rec.instance,
        "step": rec.step,
        "total_steps": rec.total_steps,
        "age_s": round(now - rec.created, 3),
        "attempt": rec.attempt,
        "priority": priority.name(rec.priority),
        "suspended": rec.suspended_at is not None,  # its denoising stopped for a higher priority (preemption.py)
    }


def build_view(
    instances: dict[str, list[dict[str, Any]]],
    queued: dict[Role, int],
    running: dict[Role, int],
    requests: Iterable[RequestRecord],
    now: float,
) -> dict[str, Any]:
    listed = sorted(requests, key=lambda r: r.created)[:MAX_LISTED_REQUESTS]
    return {
        "roles": {
            role.value: {"instances": instances.get(role.value, []), "queued": queued[role], "running": running[role]}
            for role in queued
        },
        "requests": [request_view(rec, now) for rec in listed],
    }
