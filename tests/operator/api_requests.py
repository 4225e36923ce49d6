"""Count the API requests one user sends, on a shared API server, from the server's own metrics.

`apiserver_request_total` has no user label, but API Priority and Fairness counts every request per
FlowSchema (`apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}`), and a FlowSchema
can match one ServiceAccount and some verbs and resources. So a few FlowSchemas that match only the
operator's ServiceAccount split its requests into categories, untouched by anyone else's traffic:

    status  patch/update of diffusionpipelines/status
    events  Events it posts
    writes  every other create/update/patch/delete (children, Secrets, kopf's annotations)
    reads   everything else: get, list, watch, discovery

Counters are cumulative, so callers diff two snapshots. The FlowSchemas share the `workload-low`
priority level with every other ServiceAccount's requests (what the `service-accounts` FlowSchema
gives them), so matching changes nothing about how the requests are served.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any, Protocol

CATEGORIES = ("status", "events", "writes", "reads")
WRITE_VERBS = ["create", "update", "patch", "delete", "deletecollection"]
METRIC = "apiserver_flowcontrol_dispatched_requests_total"
PRECEDENCE = 1000  # before service-accounts (9000), after the system's own schemas (<= 900)


class Kubectl(Protocol):
    def kubectl(self, *args: str, check: bool = ..., timeout: float = ..., input: str | None = ...) -> Any: ...


def _rules(category: str) -> dict[str, Any]:
    if category == "status":
        return {"verbs": ["patch", "update"], "apiGroups": ["triptych.ai"], "resources": ["diffusionpipelines/status"]}
    if category == "events":
        return {"verbs": ["create", "patch", "update"], "apiGroups": ["", "events.k8s.io"], "resources": ["events"]}
    if category == "writes":
        return {"verbs": WRITE_VERBS, "apiGroups": ["*"], "resources": ["*"]}
    return {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}


class RequestCounter:
    """Per-category request counts of the ServiceAccount `namespace/name`."""

    def __init__(self, cluster: Kubectl, namespace: str, name: str) -> None:
        self.cluster = cluster
        self.subject = {"kind": "ServiceAccount", "serviceAccount": {"name": name, "namespace": namespace}}
        self.names = {c: f"triptych-count-{namespace}-{c}"[:253] for c in CATEGORIES}

    def install(self) -> None:
        items = []
        for offset, category in enumerate(CATEGORIES):
            rule: dict[str, Any] = {
                "subjects": [self.subject],
                "resourceRules": [{**_rules(category), "namespaces": ["*"], "clusterScope": True}],
            }
            if category == "reads":
                rule["nonResourceRules"] = [{"verbs": ["*"], "nonResourceURLs": ["*"]}]
            items.append(
                {
                    "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
                    "kind": "FlowSchema",
                    "metadata": {"name": self.names[category], "labels": {"triptych.test/ephemeral": "true"}},
                    "spec": {
                        "priorityLevelConfiguration": {"name": "workload-low"},
                        "matchingPrecedence": PRECEDENCE + offset,
                        "distinguisherMethod": {"type": "ByUser"},
                        "rules": [rule],
                    },
                }
            )
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))

    def remove(self) -> None:
        self.cluster.kubectl("delete", "flowschema", *self.names.values(), "--ignore-not-found", check=False)

    def snapshot(self) -> dict[str, int]:
        text = self.cluster.kubectl("get", "--raw", "/metrics", timeout=30).stdout
        counts = dict.fromkeys(CATEGORIES, 0)
        by_name = {v: k for k, v in self.names.items()}
        for match in re.finditer(rf'^{METRIC}{{flow_schema="([^"]+)",[^}}]*}} ([0-9.e+]+)$', text, re.M):
            category = by_name.get(match.group(1))
            if category is not None:
                counts[category] += int(float(match.group(2)))
        return counts

    def wait_quiet(self, *, quiet_s: float = 5.0, timeout: float = 120.0) -> dict[str, int]:
        """Snapshot once the counts have not moved for `quiet_s` seconds."""
        deadline = time.monotonic() + timeout
        last, since = self.snapshot(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(1.0)
            now = self.snapshot()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return now
        return last


def delta(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    return {c: after[c] - before[c] for c in CATEGORIES}
