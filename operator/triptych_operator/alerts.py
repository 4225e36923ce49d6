"""The chart's Prometheus alerting rules (charts/triptych/alerts/triptych.rules.yaml), from one declaration.

    python -m triptych_operator.alerts --write      (make alerts; a test fails when it is stale)

Every expression reads what a pipeline's head exports at /metrics (triptych_head.metrics) as the
chart's PodMonitor or ServiceMonitor scrapes it: each series carries the pipeline's name
(`app_kubernetes_io_instance`) and its namespace. Per pipeline, what each head counts of its own
requests is summed over the heads, and what every head reports of the same workers is the largest
any head sees (a worker one head still sees alive is alive). The chart renders the file as a
PrometheusRule (`monitoring.prometheusRule`); `promtool test rules` checks each alert against series
it is fed (tests/operator/test_alerts.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

RULES_FILE = Path(__file__).resolve().parents[2] / "charts" / "triptych" / "alerts" / "triptych.rules.yaml"
GROUP = "triptych"
PIPELINE = "namespace, app_kubernetes_io_instance"  # one series per pipeline
ROLE = f"{PIPELINE}, role"
FAILED = '{state=~"FAILED|TIMED_OUT"}'  # requests that ended without their result (triptych_head.state)
WHO = "{{ $labels.namespace }}/{{ $labels.app_kubernetes_io_instance }}"  # the pipeline, in a message


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str  # how long the condition must hold
    severity: str  # critical: requests cannot be served; warning: they are served worse than they should be
    summary: str  # one line; {{ $labels.NAME }} is the series' label
    description: str  # what it means and what to look at


def rate_of(metric: str, by: str, window: str, selector: str = "") -> str:
    return f"sum by ({by}) (rate({metric}{selector}[{window}]))"


ALERTS: tuple[Alert, ...] = (
    Alert(
        "TriptychRoleWithoutReadyInstances",
        f"(max by ({ROLE}) (triptych_role_ready_instances) == 0)\n"
        f"and on ({ROLE})\n"
        f"(sum by ({ROLE}) (triptych_role_pending_work_seconds) > 0)",
        "5m",
        "critical",
        f"{WHO}: work waits for a {{{{ $labels.role }}}} and no head has a ready one",
        "Accepted requests need the role and no head sees an instance of it that heartbeats and takes work: they "
        "wait until one does or their deadline passes. Look at the role's pods (Pending for GPUs, crash-looping, "
        "failing to load the model) and the DiffusionPipeline's status conditions.",
    ),
    Alert(
        "TriptychRequestsFailing",
        f"{rate_of('triptych_requests_total', PIPELINE, '10m', FAILED)}\n"
        f"/\n{rate_of('triptych_requests_total', PIPELINE, '10m')}\n"
        "> 0.05",
        "10m",
        "critical",
        f"{WHO}: more than 5% of requests fail or time out",
        "Over the last 10 minutes more than one request in 20 ended FAILED or TIMED_OUT. The heads' logs name each "
        "failure's role and cause; triptych_retries_total shows instances lost under requests, "
        "triptych_stage_seconds which stage is slow.",
    ),
    Alert(
        "TriptychRequestsRefused",
        f"{rate_of('triptych_rejected_deadline_requests_total', PIPELINE, '5m')}\n"
        f"+\n{rate_of('triptych_rejected_overloaded_requests_total', PIPELINE, '5m')}\n"
        "> 0.05",
        "15m",
        "warning",
        f"{WHO}: requests are refused for want of capacity",
        "For 15 minutes the heads have refused requests (429) that would miss their deadline or exceed "
        "--max-queued-requests, about one every 20 s or more. Add workers to the slowest role (its HPA may be at "
        "maxReplicas, or waiting for GPUs) or lengthen clients' deadlines.",
    ),
    Alert(
        "TriptychInstanceNotHeartbeating",
        f"max by ({ROLE}, worker) (triptych_instance_up) == 0",
        "5m",
        "warning",
        f"{WHO}: {{{{ $labels.role }}}} instance {{{{ $labels.worker }}}} stopped heartbeating",
        "Discovery still lists the instance but no head has had its heartbeat within --disagg-heartbeat-timeout "
        "for 5 minutes: it hangs, or a NetworkPolicy or CURVE key mismatch keeps it from the heads. Its work went "
        "to other instances.",
    ),
    Alert(
        "TriptychInstancesLostUnderRequests",
        f"sum by ({ROLE}, cause) (increase(triptych_retries_total[15m])) > 3",
        "0m",
        "warning",
        f"{WHO}: {{{{ $labels.role }}}} instances keep failing under requests ({{{{ $labels.cause }}}})",
        "More than 3 requests in 15 minutes were restarted on another instance after losing one (heartbeat lost, "
        "disconnected, gone from discovery, a transfer failed, a receiver whose transfer session changed). The "
        "requests are restarted, each up to --disagg-max-retries times, then fail; the instances, or the network "
        "between them, are unhealthy.",
    ),
    Alert(
        "TriptychInstanceNearOpenFilesLimit",
        f"max by ({ROLE}, worker) (triptych_worker_open_files)\n"
        f"/\nmax by ({ROLE}, worker) (triptych_worker_open_files_limit > 0)\n"
        "> 0.8",
        "15m",
        "warning",
        f"{WHO}: {{{{ $labels.role }}}} instance {{{{ $labels.worker }}}} holds over 80% of its open-file limit",
        "For 15 minutes the worker's process has held more than 80% of its open-file limit; at the limit its "
        "transfers and connections fail. Mooncake's TCP transport keeps up to 4 connections to every peer that "
        "went away, so a long-lived worker behind a pool that scales often keeps growing: restart its pod (it "
        "drains first), or raise the container runtime's or node's hard limit on open files.",
    ),
)


def rules() -> dict[str, Any]:
    """The Prometheus rule file's content."""
    return {
        "groups": [
            {
                "name": GROUP,
                "rules": [
                    {
                        "alert": a.name,
                        "expr": a.expr,
                        "for": a.for_,
                        "labels": {"severity": a.severity},
                        "annotations": {"summary": a.summary, "description": a.description},
                    }
                    for a in ALERTS
                ],
            }
        ]
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line expressions as literal blocks, as one writes them by hand."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def render() -> str:
    header = "# Generated by `make alerts` from operator/triptych_operator/alerts.py; do not edit.\n"
    return header + yaml.dump(rules(), Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triptych_operator.alerts", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {RULES_FILE.name} (else print it)")
    args = parser.parse_args(argv)
    if args.write:
        RULES_FILE.parent.mkdir(parents=True, exist_ok=True)
        RULES_FILE.write_text(render())
        print(f"wrote {RULES_FILE.relative_to(RULES_FILE.parents[3])}")
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
