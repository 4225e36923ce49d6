"""The chart's monitoring: Prometheus Operator monitors only where its CRDs exist, and a Grafana dashboard
whose every query reads a metric the head exports. Real `helm template` (the toolchain's helm)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from tests.operator.helpers import minimal_spec, pipeline
from tests.operator.test_chart import CHART, PROMETHEUS_OPERATOR, by_kind_name, helm_bin, render, series_matcher
from triptych_head.metrics import HeadMetrics
from triptych_operator import manifests
from triptych_operator.dashboard import DASHBOARD_FILE, dashboard
from triptych_operator.dashboard import render as render_dashboard
from triptych_operator.metrics_api.prometheus import HEAD_GAUGES, SHARED_VIEW_METRICS

__all__ = ["helm_bin"]  # the fixture, shared with test_chart.py

MONITORS = {"podMonitor": "PodMonitor", "serviceMonitor": "ServiceMonitor"}
DASHBOARD = ("ConfigMap", "rel-triptych-dashboard")
# What issue 18 asks the dashboard to show, by the metric that shows it.
REQUIRED = {
    "triptych_role_queued_requests": "per-role queue",
    "triptych_stage_seconds_bucket": "latency by stage",
    "triptych_transfer_bytes_total": "transfer throughput",
    "triptych_instance_up": "instance health",
    "triptych_worker_seconds_total": "device (GPU) seconds",
}


@pytest.mark.parametrize("value", sorted(MONITORS))
def test_a_monitor_renders_only_where_the_prometheus_operator_crds_exist(helm_bin: Path, value: str) -> None:
    kind = MONITORS[value]
    with_crds = by_kind_name(render(helm_bin, f"monitoring.{value}.enabled=true", api_versions=[PROMETHEUS_OPERATOR]))
    monitor = with_crds[(kind, "rel-triptych-heads")]
    assert monitor["apiVersion"] == PROMETHEUS_OPERATOR
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "head"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    without_crds = render(helm_bin, f"monitoring.{value}.enabled=true")
    assert [d for d in without_crds if d["apiVersion"] == PROMETHEUS_OPERATOR] == []
    assert len(without_crds) == len(with_crds) - 1  # nothing else differs
    off = render(helm_bin, api_versions=[PROMETHEUS_OPERATOR])  # the CRDs alone render nothing
    assert [d for d in off if d["apiVersion"] == PROMETHEUS_OPERATOR] == []


def test_the_service_monitor_scrapes_each_head_once_through_its_workers_service(helm_bin: Path) -> None:
    """A head has two Services with its labels (<pipeline>-head, <pipeline>-api); only the first is kept."""
    docs = render(helm_bin, "monitoring.serviceMonitor.enabled=true", api_versions=[PROMETHEUS_OPERATOR])
    endpoints = by_kind_name(docs)[("ServiceMonitor", "rel-triptych-heads")]["spec"]["endpoints"]
    assert [e["port"] for e in endpoints] == ["http", "https"]  # a head has one of them (head.tls: https)
    for endpoint in endpoints:
        [keep] = endpoint["relabelings"]
        assert keep["action"] == "keep" and keep["sourceLabels"] == ["__meta_kubernetes_service_name"]
        assert re.fullmatch(keep["regex"], "wan-head") and not re.fullmatch(keep["regex"], "wan-head-api")
        assert endpoint["path"] == "/metrics"


@pytest.mark.parametrize("value", sorted(MONITORS))
def test_heads_serving_https_are_scraped_over_it_with_the_tls_config_given(helm_bin: Path, value: str) -> None:
    kind, key = MONITORS[value], "podMetricsEndpoints" if value == "podMonitor" else "endpoints"
    default = by_kind_name(render(helm_bin, f"monitoring.{value}.enabled=true", api_versions=[PROMETHEUS_OPERATOR]))
    [https] = [e for e in default[(kind, "rel-triptych-heads")]["spec"][key] if e["port"] == "https"]
    assert https["scheme"] == "https" and https["tlsConfig"] == {"insecureSkipVerify": True}
    [http] = [e for e in default[(kind, "rel-triptych-heads")]["spec"][key] if e["port"] == "http"]
    assert "scheme" not in http and "tlsConfig" not in http
    verified = by_kind_name(
        render(
            helm_bin,
            f"monitoring.{value}.enabled=true",
            "monitoring.headsTLSConfig.insecureSkipVerify=false",
            "monitoring.headsTLSConfig.serverName=flux-head.ml.svc",
            api_versions=[PROMETHEUS_OPERATOR],
        )
    )
    [https] = [e for e in verified[(kind, "rel-triptych-heads")]["spec"][key] if e["port"] == "https"]
    assert https["tlsConfig"] == {"insecureSkipVerify": False, "serverName": "flux-head.ml.svc"}


def test_both_monitors_at_once_are_refused_naming_the_values(helm_bin: Path) -> None:
    sets = ["--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.serviceMonitor.enabled=true"]
    proc = subprocess.run(
        [str(helm_bin), "template", "rel", str(CHART), *sets], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode != 0
    assert "monitoring.podMonitor or monitoring.serviceMonitor, not both" in proc.stderr


def test_the_dashboard_is_off_by_default_and_labelled_for_grafanas_sidecar_when_on(helm_bin: Path) -> None:
    assert DASHBOARD not in by_kind_name(render(helm_bin))
    sets = ("monitoring.grafanaDashboard.enabled=true", "monitoring.grafanaDashboard.namespace=monitoring")
    config_map = by_kind_name(render(helm_bin, *sets))[DASHBOARD]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert json.loads(config_map["data"]["triptych.json"]) == dashboard()


def test_the_dashboard_file_is_what_its_declaration_generates() -> None:
    assert DASHBOARD_FILE.read_text() == render_dashboard(), "stale: run `make dashboard`"


def metric_names(expr: str) -> set[str]:
    """The metrics a dashboard query reads, from its syntax tree (promql-parser); raises ValueError when
    it is not PromQL. Grafana's range variables are given a duration first, as Grafana does."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
    names: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(str(node.name))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def exported_series() -> set[str]:
    """Every series name the head's registry exposes at /metrics (counters with _total, histograms'
    _bucket/_count/_sum), labelled or not yet observed included."""
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
    return {family.name + s for family in HeadMetrics().registry.collect() for s in suffixes[family.type]}


def queries(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    variables = [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs + [re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", q) for q in variables]


def test_every_metric_the_dashboard_queries_is_one_the_head_exports() -> None:
    board = json.loads(DASHBOARD_FILE.read_text())
    exported = exported_series()
    used: set[str] = set()
    for expr in queries(board):
        names = metric_names(expr)
        assert names, f"no metric found in {expr!r}"
        assert names <= exported, f"{expr!r} reads {sorted(names - exported)}, which the head does not export"
        used |= names
    missing = {what for metric, what in REQUIRED.items() if metric not in used}
    assert not missing, f"the dashboard shows no {sorted(missing)}"


def test_the_metric_check_reads_metrics_from_the_syntax_tree_and_rejects_what_is_not_promql() -> None:
    expr = 'sum by (role) (rate(kube_pod_info{namespace=~"$ns"}[$__rate_interval])) / triptych_active_requests'
    names = metric_names(expr)
    assert names == {"kube_pod_info", "triptych_active_requests"} and not names <= exported_series()
    with pytest.raises(ValueError):
        metric_names("sum(rate(triptych_requests_total[5m])")


def test_what_every_head_reports_of_the_same_workers_is_not_summed_over_the_heads() -> None:
    # With replicated heads each head exports the instances, slots and pools it sees, the same ones.
    board = json.loads(DASHBOARD_FILE.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for metric in ("triptych_role_ready_instances", "triptych_instance_up", "triptych_free_slots",
                   "triptych_transfer_pool_free_bytes"):  # fmt: skip
        (expr,) = [e for e in exprs if metric in e]
        assert expr.startswith("max by ("), expr


def groupings(expr: str) -> list[set[str]]:
    """The labels each aggregation in a query keeps (`by`), from its syntax tree."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
    kept: list[set[str]] = []

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.AggregateExpr):
            assert node.modifier is not None and str(node.modifier).startswith("by"), expr
            kept.append(set(node.modifier.labels))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return kept


def test_every_panel_keeps_the_selected_pipelines_apart_and_says_which_is_which() -> None:
    # The pipeline variable takes several values: a per-role sum over all of them would hide one's outage.
    # `instance` is the scraped head's address (Prometheus's target label), never a worker.
    board = json.loads(DASHBOARD_FILE.read_text())
    for target in [t for p in board["panels"] for t in p.get("targets", [])]:
        for labels in groupings(target["expr"]):
            assert {"namespace", "app_kubernetes_io_instance"} <= labels and "instance" not in labels, target
        assert target["legendFormat"].startswith("{{app_kubernetes_io_instance}}"), target


def relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str]:
    """`labels` after Prometheus's `replace` relabelings: the source labels' values joined by the separator,
    the regex matched against the whole string, ${n} in the replacement the n-th group's text."""
    out = dict(labels)
    for rule in rules:
        assert rule.get("action", "replace") == "replace", rule
        value = rule.get("separator", ";").join(out.get(name, "") for name in rule["sourceLabels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if match is None:
            continue
        groups = match.groups()

        def group(ref: re.Match[str], groups: tuple[str | None, ...] = groups) -> str:
            return groups[int(ref.group(1) or ref.group(2)) - 1] or ""

        result = re.sub(r"\$\{(\d+)\}|\$(\d+)", group, rule.get("replacement", "$1"))
        if result:
            out[rule["targetLabel"]] = result
        else:
            out.pop(rule["targetLabel"], None)
    return out


def test_the_relabel_mimic_follows_prometheus() -> None:
    rule = {"sourceLabels": ["a", "b"], "regex": "(.+);(.+)", "targetLabel": "t", "replacement": "${1}-${2}"}
    assert relabel([rule], {"a": "x", "b": "y"})["t"] == "x-y"
    assert "t" not in relabel([rule], {"a": "x"})  # "x;" does not match the whole regex: left alone
    assert "t" not in relabel([{**rule, "regex": "(.)"}], {"a": "xy", "b": "z"})  # anchored, as Prometheus's


@pytest.mark.parametrize("value", sorted(MONITORS))
@pytest.mark.parametrize(
    "spec",
    [minimal_spec(), minimal_spec(promptEncoder={}, imageEncoder={})],
    ids=["combined-encoder", "split-encoders"],
)
def test_per_role_series_are_labelled_with_the_roles_real_deployment_name(
    helm_bin: Path, value: str, spec: dict[str, Any]
) -> None:
    """The adapter finds a Deployment by the `deployment` label: it must be the name the operator gives it."""
    kind, key = MONITORS[value], "podMetricsEndpoints" if value == "podMonitor" else "endpoints"
    monitor = by_kind_name(render(helm_bin, f"monitoring.{value}.enabled=true", api_versions=[PROMETHEUS_OPERATOR]))
    flux = pipeline(spec, name="flux")
    deployments = {m["metadata"]["name"] for m in manifests.render(flux).apply if m["kind"] == "Deployment"} - {
        "flux-head"
    }
    for endpoint in monitor[(kind, "rel-triptych-heads")]["spec"][key]:
        # What the head exports per role (label role=<Role.value>), with the pipeline's name copied on.
        labelled = {
            relabel(endpoint["metricRelabelings"], {"app_kubernetes_io_instance": "flux", "role": role.value})[
                "deployment"
            ]
            for role in flux.roles
        }
        assert labelled == deployments
        assert "deployment" not in relabel(endpoint["metricRelabelings"], {"app_kubernetes_io_instance": "flux"})


def adapter_rules(helm_bin: Path) -> list[dict[str, Any]]:
    sets = ("metricsApi.enabled=false", "metricsApi.prometheus.adapterRules.enabled=true")
    config_map = by_kind_name(render(helm_bin, *sets))[("ConfigMap", "rel-triptych-prometheus-adapter-rules")]
    rules: list[dict[str, Any]] = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    return rules


def test_the_adapter_combines_each_metric_over_the_heads_as_the_metrics_api_does(helm_bin: Path) -> None:
    """Every head sees the same workers (ready instances: the max), but counts only its own requests (summed)."""
    rules = adapter_rules(helm_bin)
    for metric, gauge in HEAD_GAUGES.items():
        matching = [r for r in rules if series_matcher(r["seriesQuery"]).fullmatch(gauge)]
        assert len(matching) == 1, f"{gauge} is in {len(matching)} rules"
        # The adapter's template placeholders stand for a selector and labels: give it some, parse it.
        query = (
            matching[0]["metricsQuery"]
            .replace("<<.Series>>", gauge)
            .replace("<<.LabelMatchers>>", 'namespace="ml",deployment="flux-denoiser"')
            .replace("<<.GroupBy>>", "deployment")
        )
        tree = promql_parser.parse(query)
        assert isinstance(tree, promql_parser.AggregateExpr), query
        assert str(tree.op) == ("max" if metric in SHARED_VIEW_METRICS else "sum"), query
        assert metric_names(query) == {gauge}
