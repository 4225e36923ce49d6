"""The chart's Grafana dashboard (charts/triptych/dashboards/triptych.json), from one declaration.

    python -m triptych_operator.dashboard --write      (make dashboard; a test fails when it is stale)

Every query reads what a pipeline's head exports at /metrics (triptych_head.metrics), as the chart's
PodMonitor or ServiceMonitor scrapes it: each series carries the pipeline's name
(`app_kubernetes_io_instance`, from the head pod's or Service's `app.kubernetes.io/instance` label)
and its namespace, which the dashboard's variables select. Rows: requests, per-role queues, latency
by stage, transfers, instance health, device time.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD_FILE = Path(__file__).resolve().parents[2] / "charts" / "triptych" / "dashboards" / "triptych.json"
UID = "triptych-pipelines"
# Every query's series selector: the pipelines (and namespaces) chosen in the dashboard's variables.
S = '{namespace=~"$namespace", app_kubernetes_io_instance=~"$pipeline"}'
PIPELINE = "namespace, app_kubernetes_io_instance"  # one series per pipeline
NAME = "{{app_kubernetes_io_instance}}"  # the pipeline, in a legend
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ROW_WIDTH, PANEL_HEIGHT = 24, 8


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat": one number per series over the dashboard's time range


# Every query keeps the pipelines apart (the variables may select several) and every legend names one:
# `by` below is what a query groups by within a pipeline ("" for the pipeline alone).


def within(by: str) -> str:
    return f"{PIPELINE}, {by}" if by else PIPELINE


def legend(text: str) -> str:
    return f"{NAME} {text}"


def rate(metric: str, by: str) -> str:
    return f"sum by ({within(by)}) (rate({metric}{S}[$__rate_interval]))"


def quantiles(metric: str, by: str, text: str) -> tuple[tuple[str, str], ...]:
    """p50 and p95 of histogram `metric` per pipeline and `by` labels."""
    return tuple(
        (
            f"histogram_quantile({q}, sum by ({within(by)}, le) (rate({metric}_bucket{S}[$__rate_interval])))",
            legend(f"{text} p{p}".lstrip()),
        )
        for q, p in ((0.5, 50), (0.95, 95))
    )


def per(metric: str, by: str) -> str:
    return f"sum by ({within(by)}) ({metric}{S})"


def seen(metric: str, by: str) -> str:
    """What every head reports about the same workers (their instances, slots, pools): the largest
    any head sees, not the sum over the heads, which would count each worker once per head."""
    return f"max by ({within(by)}) ({metric}{S})"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Requests",
        (
            Panel(
                "Requests in flight",
                "Requests the head holds, and the cap --max-queued-requests sets when given (none by default: "
                "requests are refused only when they would miss their deadline).",
                (
                    (per("triptych_active_requests", ""), legend("in flight")),
                    (per("triptych_admission_in_flight_requests", ""), legend("admitted")),
                    (per("triptych_admission_max_in_flight_requests", ""), legend("bound")),
                ),
            ),
            Panel(
                "Finished requests",
                "Requests per second by final state, and those refused with 429: they would have missed their "
                "deadline, or the pipeline was at --max-queued-requests.",
                (
                    (rate("triptych_requests_total", "state"), legend("{{state}}")),
                    (rate("triptych_rejected_deadline_requests_total", ""), legend("refused: deadline (429)")),
                    (rate("triptych_rejected_overloaded_requests_total", ""), legend("refused: cap (429)")),
                ),
                unit="reqps",
            ),
            Panel(
                "End-to-end latency",
                "From the head taking a request to its result.",
                quantiles("triptych_request_seconds", "", ""),
                unit="s",
            ),
        ),
    ),
    (
        "Queues per role",
        (
            Panel(
                "Queued requests",
                "Requests waiting for an instance of the role.",
                ((per("triptych_role_queued_requests", "role"), legend("{{role}}")),),
            ),
            Panel(
                "Running requests",
                "Requests dispatched to an instance of the role.",
                ((per("triptych_role_running_requests", "role"), legend("{{role}}")),),
            ),
            Panel(
                "Pending device-seconds",
                "The head's estimate of the device time accepted requests still need from each role: "
                "the signal autoscaled roles follow.",
                ((per("triptych_role_pending_work_seconds", "role"), legend("{{role}}")),),
                unit="s",
            ),
        ),
    ),
    (
        "Latency by stage",
        (
            Panel(
                "Stage time",
                "A request's time in a role as the head sees it: dispatch to its output reported.",
                quantiles("triptych_stage_seconds", "role", "{{role}}"),
                unit="s",
            ),
            Panel(
                "Wait for an instance",
                "Time a request waits in the head for a free instance of the role.",
                quantiles("triptych_queue_seconds", "role", "{{role}}"),
                unit="s",
            ),
            Panel(
                "Hand-off",
                "From a sender's output being staged to its receiver being told it is ready (slot, push, write).",
                quantiles("triptych_handoff_seconds", "source, destination", "{{source}} → {{destination}}"),
                unit="s",
            ),
        ),
    ),
    (
        "Transfers",
        (
            Panel(
                "Transfer throughput",
                "Bytes moved worker to worker through Mooncake, per second.",
                (
                    (
                        rate("triptych_transfer_bytes_total", "source, destination"),
                        legend("{{source}} → {{destination}}"),
                    ),
                ),
                unit="Bps",
            ),
            Panel(
                "Mooncake write time",
                "How long a sender's write took, as it reports it.",
                quantiles("triptych_transfer_seconds", "source, destination", "{{source}} → {{destination}}"),
                unit="s",
            ),
            Panel(
                "Free transfer-pool bytes",
                "Free bytes of each instance's registered transfer pool, from its heartbeats.",
                ((seen("triptych_transfer_pool_free_bytes", "role, worker"), legend("{{role}} {{worker}}")),),
                unit="bytes",
            ),
        ),
    ),
    (
        "Instance health",
        (
            Panel(
                "Ready instances",
                "Instances that heartbeat and take new work (not draining or leaving).",
                ((seen("triptych_role_ready_instances", "role"), legend("{{role}}")),),
            ),
            Panel(
                "Instances up",
                "1 while an instance heartbeats, 0 once the head counts it gone.",
                ((seen("triptych_instance_up", "role, worker"), legend("{{role}} {{worker}}")),),
            ),
            Panel(
                "Free scheduling slots",
                "Requests each instance can still take.",
                ((seen("triptych_free_slots", "role, worker"), legend("{{role}} {{worker}}")),),
            ),
            Panel(
                "Retries",
                "Requests restarted on another instance after losing one, by cause.",
                ((rate("triptych_retries_total", "role, cause"), legend("{{role}} {{cause}}")),),
                unit="reqps",
            ),
            Panel(
                "Open files, share of the limit",
                "Descriptors each worker holds against its open-file limit (from its heartbeats). Mooncake keeps "
                "connections to peers that went away, so it can grow over a worker's life; the alert fires past 80%.",
                (
                    (
                        f"{seen('triptych_worker_open_files', 'role, worker')} / "
                        f"({seen('triptych_worker_open_files_limit', 'role, worker')} > 0)",
                        legend("{{role}} {{worker}}"),
                    ),
                ),
                unit="percentunit",
            ),
        ),
    ),
    (
        "Device time",
        (
            Panel(
                "Busy devices",
                "Device-seconds per second workers spend on requests' stages (their own time, no queueing): "
                "how many replicas' devices are busy on average. Times a role's gpusPerReplica: GPUs busy.",
                ((rate("triptych_worker_seconds_total", "role"), legend("{{role}}")),),
            ),
            Panel(
                "Device-seconds in the time range",
                "Device time spent per role over the dashboard's range; times gpusPerReplica: GPU-seconds.",
                (
                    (
                        f"sum by ({within('role')}) (increase(triptych_worker_seconds_total{S}[$__range]))",
                        legend("{{role}}"),
                    ),
                ),
                unit="s",
                kind="stat",
            ),
            Panel(
                "Device-seconds per unit of work",
                "The head's calibrated cost of one unit of each role's work (docs/autoscaling.md).",
                ((seen("triptych_role_seconds_per_work_unit", "role"), legend("{{role}}")),),
                unit="s",
            ),
        ),
    ),
)


def _panel(panel: Panel, panel_id: int, x: int, y: int, width: int) -> dict[str, Any]:
    targets: list[dict[str, Any]] = [
        {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
        for i, (expr, legend) in enumerate(panel.targets)
    ]
    options: dict[str, Any] = {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    if panel.kind == "stat":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "textMode": "auto"}
        for target in targets:
            target["instant"] = True
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": width, "h": PANEL_HEIGHT},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": options,
        "targets": targets,
    }


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "allValue": ".*",  # also matches series without the label (a scrape that does not add it)
        "multi": True,
        "refresh": 2,  # on time range change
        "sort": 1,
        "current": {},
    }


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append(
            {
                "id": len(panels) + 1,
                "type": "row",
                "title": title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"x": 0, "y": y, "w": ROW_WIDTH, "h": 1},
            }
        )
        y += 1
        width = ROW_WIDTH // len(row)
        for i, panel in enumerate(row):
            panels.append(_panel(panel, len(panels) + 1, i * width, y, width))
        y += PANEL_HEIGHT
    return {
        "uid": UID,
        "title": "Triptych pipelines",
        "description": "Disaggregated diffusion pipelines, from the metrics their heads export.",
        "tags": ["triptych"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                _variable("namespace", "Namespace", "label_values(triptych_active_requests, namespace)"),
                _variable(
                    "pipeline",
                    "Pipeline",
                    'label_values(triptych_active_requests{namespace=~"$namespace"}, app_kubernetes_io_instance)',
                ),
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triptych_operator.dashboard", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {DASHBOARD_FILE} (default: print it)")
    ns = parser.parse_args(argv)
    if ns.write:
        DASHBOARD_FILE.parent.mkdir(parents=True, exist_ok=True)
        DASHBOARD_FILE.write_text(render())
        print(DASHBOARD_FILE)
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
