"""The head's per-role gauges, read out of Prometheus text format.

The operator image carries no prometheus_client, and only a handful of gauges matter here, so
this is a small reader of the exposition format rather than a dependency.
"""

from __future__ import annotations

import math
import re
from typing import Final

from triptych_operator.constants import PENDING_WORK_METRIC

# Metric served by the custom metrics API -> the head's gauge (label `role`) it comes from.
HEAD_GAUGES: Final = {
    PENDING_WORK_METRIC: "triptych_role_pending_work_seconds",
    "triptych_queued_requests": "triptych_role_queued_requests",
    "triptych_running_requests": "triptych_role_running_requests",
    "triptych_ready_instances": "triptych_role_ready_instances",
}
_SERVED_BY_GAUGE: Final = {gauge: served for served, gauge in HEAD_GAUGES.items()}
# What each head sees of the same workers (every worker serves every head): the heads' largest
# value, not their sum. The others count each head's own requests, which no other head counts.
SHARED_VIEW_METRICS: Final = frozenset({"triptych_ready_instances"})

# role -> served metric name -> value
RoleValues = dict[str, dict[str, float]]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_role_gauges(text: str) -> RoleValues:
    """The per-role gauges in a /metrics page; samples without a `role` label or with a
    non-finite value are skipped, unrelated metrics ignored."""
    out: RoleValues = {}
    for line in text.splitlines():
        if not line.startswith("triptych_role_"):
            continue
        match = _SAMPLE.match(line)
        if not match or match.group(1) not in _SERVED_BY_GAUGE:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if "role" not in labels or not math.isfinite(value):
            continue
        out.setdefault(labels["role"], {})[_SERVED_BY_GAUGE[match.group(1)]] = value
    return out


def add(total: RoleValues, more: RoleValues) -> RoleValues:
    """Sum `more` into `total` (several heads of one pipeline); the workers' count is the largest any head sees."""
    for role, values in more.items():
        into = total.setdefault(role, {})
        for name, value in values.items():
            combine = max if name in SHARED_VIEW_METRICS else float.__add__
            into[name] = combine(into[name], value) if name in into else value
    return total
