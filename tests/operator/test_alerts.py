"""The chart's alerting rules (operator/triptych_operator/alerts.py -> charts/triptych/alerts/): the file is
what the declaration writes, every metric an alert reads is one the head exports, and Prometheus's own
rule engine (`promtool test rules`, promtool built from the Go module proxy by `make setup`) fires each
alert on the series it names, with its labels and messages, and not on a healthy or parked pipeline or
on what one head of several sees. The PrometheusRule the chart renders (real `helm template`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.fixtures import CLUSTER_SRC
from tests.operator.test_chart import PROMETHEUS_OPERATOR, by_kind_name, helm_bin, render
from tests.operator.test_chart_monitoring import exported_series, metric_names
from triptych_operator.alerts import ALERTS, RULES_FILE
from triptych_operator.alerts import render as render_rules

__all__ = ["helm_bin"]  # the fixture, shared with test_chart.py

PROMETHEUS_RULE = ("PrometheusRule", "rel-triptych-alerts")


@pytest.fixture(scope="module")
def promtool() -> Path:
    """promtool, built when missing (idempotent and cached: tests/cluster/build.sh)."""
    build = CLUSTER_SRC / "build.sh"
    path = Path(subprocess.run(["bash", str(build), "--print-promtool"], capture_output=True, text=True,
                               check=True).stdout.strip())  # fmt: skip
    if not path.is_file():
        subprocess.run(["bash", str(build)], check=True, timeout=2400)
    return path


def test_the_rules_file_is_what_its_declaration_generates() -> None:
    assert RULES_FILE.read_text() == render_rules(), "stale: run `make alerts`"


def test_every_metric_an_alert_reads_is_one_the_head_exports() -> None:
    exported = exported_series()
    for alert in ALERTS:
        names = metric_names(alert.expr)
        assert names and names <= exported, (
            f"{alert.name} reads {sorted(names - exported)}, which the head does not export"
        )


def test_promtool_accepts_the_rules(promtool: Path) -> None:
    check = subprocess.run([str(promtool), "check", "rules", str(RULES_FILE)], capture_output=True, text=True,
                           timeout=60, check=False)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in check.stdout, check.stdout


# ---------------------------------------------------------------- each alert against series it is fed

FLUX = {"namespace": "ml", "app_kubernetes_io_instance": "flux"}
WAN = {"namespace": "ml", "app_kubernetes_io_instance": "wan"}


def series(name: str, values: str, head: str = "h1", **labels: str) -> dict[str, str]:
    """One input series as a head (pod `head`) exports it, scraped with the pipeline's labels and the
    target's own: `instance` is the scraped head's address, as Prometheus sets it on every series."""
    pipeline = WAN if labels.pop("pipeline", "flux") == "wan" else FLUX
    all_labels = {**pipeline, "job": "rel-triptych-heads", "pod": head, "instance": f"{head}:30000", **labels}
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in all_labels.items()) + "}", "values": values}


def expected(alert_name: str, **labels: str) -> dict[str, Any]:
    """The alert as it should fire: the expression's labels, the severity, the messages filled in."""
    alert = next(a for a in ALERTS if a.name == alert_name)
    all_labels = {**FLUX, **labels}

    def fill(text: str) -> str:
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: all_labels[m.group(1)], text)

    return {
        "exp_labels": {**all_labels, "severity": alert.severity},
        "exp_annotations": {"summary": fill(alert.summary), "description": fill(alert.description)},
    }


CASES: dict[str, tuple[list[dict[str, str]], list[tuple[str, list[dict[str, Any]]]]]] = {
    # (input series, [(eval time, the alerts firing then)])
    "TriptychRoleWithoutReadyInstances": (
        [
            # flux's denoisers all gone while work waits for them (both heads agree)
            series("triptych_role_ready_instances", "1 1 0x20", role="denoiser"),
            series("triptych_role_ready_instances", "1 1 0x20", head="h2", role="denoiser"),
            series("triptych_role_pending_work_seconds", "0 0 5x20", role="denoiser"),
            series("triptych_role_pending_work_seconds", "0 0 0x20", head="h2", role="denoiser"),
            # a parked role: no instance, and no work for it
            series("triptych_role_ready_instances", "0x22", role="encoder"),
            series("triptych_role_pending_work_seconds", "0x22", role="encoder"),
            # one head lost its decoder, the other still sees it: alive
            series("triptych_role_ready_instances", "0x22", role="decoder"),
            series("triptych_role_ready_instances", "1x22", head="h2", role="decoder"),
            series("triptych_role_pending_work_seconds", "3x22", role="decoder"),
        ],
        [("5m", []), ("10m", [expected("TriptychRoleWithoutReadyInstances", role="denoiser")])],
    ),
    "TriptychRequestsFailing": (
        [
            series("triptych_requests_total", "0+10x40", state="DONE"),
            series("triptych_requests_total", "0+2x40", state="FAILED"),  # 2 in 12: failing
            series("triptych_requests_total", "0+10x40", pipeline="wan", state="DONE"),
            series("triptych_requests_total", "0+10x40", head="h2", pipeline="wan", state="DONE"),
            series("triptych_requests_total", "0+0.5x40", head="h2", pipeline="wan", state="TIMED_OUT"),  # 2.4%
        ],
        [("5m", []), ("30m", [expected("TriptychRequestsFailing")])],
    ),
    "TriptychRequestsRefused": (
        [
            series("triptych_rejected_deadline_requests_total", "0+6x40"),  # 0.1/s
            series("triptych_rejected_overloaded_requests_total", "0x40"),
            series("triptych_rejected_deadline_requests_total", "0x40", pipeline="wan"),
            series("triptych_rejected_overloaded_requests_total", "0+1x40", pipeline="wan"),  # one a minute
        ],
        [("10m", []), ("30m", [expected("TriptychRequestsRefused")])],
    ),
    "TriptychInstanceNotHeartbeating": (
        [
            series("triptych_instance_up", "1 1 0x20", role="denoiser", worker="tcp://a:19000"),
            series("triptych_instance_up", "1 1 0x20", head="h2", role="denoiser", worker="tcp://a:19000"),
            series("triptych_instance_up", "0x22", role="denoiser", worker="tcp://b:19000"),
            series("triptych_instance_up", "1x22", head="h2", role="denoiser", worker="tcp://b:19000"),
        ],
        [
            ("5m", []),
            ("10m", [expected("TriptychInstanceNotHeartbeating", role="denoiser", worker="tcp://a:19000")]),
        ],
    ),
    "TriptychInstancesLostUnderRequests": (
        [
            series("triptych_retries_total", "0+1x30", role="denoiser", cause="heartbeat_lost"),
            series("triptych_retries_total", "0+0.1x30", pipeline="wan", role="decoder", cause="disconnected"),
        ],
        [
            ("1m", []),
            ("20m", [expected("TriptychInstancesLostUnderRequests", role="denoiser", cause="heartbeat_lost")]),
        ],
    ),
    "TriptychInstanceNearOpenFilesLimit": (
        [
            # a's descriptors grow towards its limit (as both heads hear it); b's stay low; c reports no limit
            series("triptych_worker_open_files", "100+50x40", role="denoiser", worker="tcp://a:19000"),
            series("triptych_worker_open_files", "100+50x40", head="h2", role="denoiser", worker="tcp://a:19000"),
            series("triptych_worker_open_files_limit", "1024x40", role="denoiser", worker="tcp://a:19000"),
            series("triptych_worker_open_files_limit", "1024x40", head="h2", role="denoiser", worker="tcp://a:19000"),
            series("triptych_worker_open_files", "200x40", role="denoiser", worker="tcp://b:19000"),
            series("triptych_worker_open_files_limit", "1024x40", role="denoiser", worker="tcp://b:19000"),
            series("triptych_worker_open_files", "5000x40", role="decoder", worker="tcp://c:19000"),
            series("triptych_worker_open_files_limit", "0x40", role="decoder", worker="tcp://c:19000"),
        ],
        [
            ("20m", []),  # over 80% (819 of 1024) since minute 15: pending, not yet for 15 minutes
            ("36m", [expected("TriptychInstanceNearOpenFilesLimit", role="denoiser", worker="tcp://a:19000")]),
        ],
    ),
}


def test_every_alert_has_its_case() -> None:
    assert sorted(CASES) == sorted(a.name for a in ALERTS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_alert_fires_on_what_it_names_only(promtool: Path, tmp_path: Path, name: str) -> None:
    inputs, checks = CASES[name]
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES_FILE.read_text())
    test = {
        "rule_files": [rules.name],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": [
                    {"eval_time": at, "alertname": name, "exp_alerts": alerts} for at, alerts in checks
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    run = subprocess.run([str(promtool), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def test_promtool_tells_a_wrong_expectation(promtool: Path, tmp_path: Path) -> None:
    """The check above can fail: the same run expecting the alert where it does not fire."""
    inputs, _ = CASES["TriptychRoleWithoutReadyInstances"]
    (tmp_path / "rules.yaml").write_text(RULES_FILE.read_text())
    wrong = [{"eval_time": "10m", "alertname": "TriptychRoleWithoutReadyInstances",
              "exp_alerts": [expected("TriptychRoleWithoutReadyInstances", role="encoder")]}]  # fmt: skip
    test = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": wrong}]}  # fmt: skip
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    run = subprocess.run([str(promtool), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert run.returncode != 0 and "FAILED" in run.stdout + run.stderr, run.stdout + run.stderr


# ---------------------------------------------------------------- the chart's PrometheusRule


def test_the_chart_renders_the_rules_only_when_enabled_where_the_crds_are(helm_bin: Path) -> None:
    on = by_kind_name(render(helm_bin, "monitoring.prometheusRule.enabled=true", api_versions=[PROMETHEUS_OPERATOR]))
    rule = on[PROMETHEUS_RULE]
    assert rule["apiVersion"] == PROMETHEUS_OPERATOR
    assert rule["spec"] == yaml.safe_load(RULES_FILE.read_text())
    assert PROMETHEUS_RULE not in by_kind_name(render(helm_bin, "monitoring.prometheusRule.enabled=true"))
    assert PROMETHEUS_RULE not in by_kind_name(render(helm_bin, api_versions=[PROMETHEUS_OPERATOR]))


def test_alerts_can_be_left_out_by_name_and_an_unknown_name_is_refused(helm_bin: Path) -> None:
    sets = ["monitoring.prometheusRule.enabled=true", "monitoring.prometheusRule.disabled={TriptychRequestsRefused}",
            "monitoring.prometheusRule.labels.release=kps"]  # fmt: skip
    rule = by_kind_name(render(helm_bin, *sets, api_versions=[PROMETHEUS_OPERATOR]))[PROMETHEUS_RULE]
    names = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert names == [a.name for a in ALERTS if a.name != "TriptychRequestsRefused"]
    assert rule["metadata"]["labels"]["release"] == "kps"
    with pytest.raises(
        AssertionError, match=r"monitoring\.prometheusRule\.disabled: NoSuchAlert is not one of the alerts"
    ):
        render(helm_bin, "monitoring.prometheusRule.enabled=true", "monitoring.prometheusRule.disabled={NoSuchAlert}",
               api_versions=[PROMETHEUS_OPERATOR])  # fmt: skip
