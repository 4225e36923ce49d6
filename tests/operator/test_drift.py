"""When a child needs an apply: only a new manifest or an edit of a field the operator sets."""

from __future__ import annotations

import copy
from typing import Any

from tests.operator.helpers import OWNER, pipeline
from triptych_operator.drift import digest, needs_apply, projection, record, stamp, unchanged
from triptych_operator.manifests import render


def deployment() -> dict[str, Any]:
    children = render(pipeline(), owner=OWNER, keys_fingerprint="abc")
    return next(m for m in children.apply if m["kind"] == "Deployment")


def as_served(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the API server answers: defaults filled in, a quantity normalized, status and bookkeeping."""
    live = copy.deepcopy(manifest)
    live["metadata"].update(
        resourceVersion="7", generation=1, uid="u", annotations={"deployment.kubernetes.io/revision": "1"}
    )
    live["spec"]["revisionHistoryLimit"] = 10
    pod = live["spec"]["template"]["spec"]
    pod["dnsPolicy"] = "ClusterFirst"
    pod["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    live["status"] = {"readyReplicas": 1}
    return live


def test_a_missing_child_needs_an_apply() -> None:
    assert needs_apply(deployment(), None, None)


def test_defaults_status_and_controller_annotations_need_no_apply_after_one() -> None:
    desired = deployment()
    live = as_served(desired)
    applied = record(desired, live)
    live["status"] = {"readyReplicas": 2, "observedGeneration": 1}
    live["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "2"
    live["metadata"]["resourceVersion"] = "9"
    assert not needs_apply(desired, live, applied)


def test_a_hand_edit_of_an_operator_field_needs_an_apply() -> None:
    desired = deployment()
    live = as_served(desired)
    applied = record(desired, live)
    scaled = copy.deepcopy(live)
    scaled["spec"]["replicas"] = 5
    assert needs_apply(desired, scaled, applied)
    more_env = copy.deepcopy(live)
    more_env["spec"]["template"]["spec"]["containers"][0].setdefault("env", []).append({"name": "X", "value": "1"})
    assert needs_apply(desired, more_env, applied)


def test_a_new_manifest_needs_an_apply() -> None:
    desired = deployment()
    live = as_served(desired)
    applied = record(desired, live)
    changed = copy.deepcopy(desired)
    changed["spec"]["replicas"] = 3
    assert needs_apply(changed, live, applied)


def test_without_a_record_only_an_exact_projection_counts_as_applied() -> None:
    desired = deployment()
    live = as_served(desired)
    assert not needs_apply(desired, live, None)
    assert projection(desired, live) == desired  # defaults the operator does not set are not compared
    exact = copy.deepcopy(desired)
    exact["status"] = {"readyReplicas": 1}
    exact["metadata"]["resourceVersion"] = "3"
    assert not needs_apply(desired, exact, None)
    exact["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:1"
    assert needs_apply(desired, exact, None)


def test_the_version_last_recorded_needs_no_comparison_and_any_other_does() -> None:
    desired = deployment()
    live = as_served(desired)
    applied = record(desired, live)
    assert unchanged(applied, digest(desired), live)
    edited = copy.deepcopy(live)
    edited["metadata"]["resourceVersion"] = "8"  # the API server gives every change a new version
    assert not unchanged(applied, digest(desired), edited)
    changed_spec = copy.deepcopy(desired)
    changed_spec["spec"]["template"]["spec"]["containers"][0]["args"].append("--verbose")
    assert not unchanged(applied, digest(changed_spec), live)
    assert not unchanged(None, digest(desired), live) and not unchanged(applied, digest(desired), None)


def test_a_field_the_new_manifest_no_longer_sets_needs_an_apply_with_or_without_a_record() -> None:
    """Removing a head's nodeSelector (or an Ingress's TLS) left it on the live object for good: the
    projection of the live object onto the new manifest, which lacks the field, equalled the manifest."""
    old = stamp(deployment())
    old["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "cpu"}
    old = stamp(old)
    live = as_served(old)
    live["metadata"]["annotations"].update(old["metadata"]["annotations"])
    new = stamp(deployment())
    assert "nodeSelector" not in new["spec"]["template"]["spec"]
    assert needs_apply(new, live, record(old, live))  # the operator applied the old manifest
    assert needs_apply(new, live, None)  # an operator started since: the live object's stamp is the old one's
    again = as_served(new)
    again["metadata"]["annotations"].update(new["metadata"]["annotations"])
    assert not needs_apply(new, again, None)  # the new manifest applied: nothing more to do
    assert stamp(copy.deepcopy(new)) == new  # stamping twice changes nothing
