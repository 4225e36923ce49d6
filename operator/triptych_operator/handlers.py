"""kopf handlers: they only apply what `spec` + `manifests` + `status` compute.

One reconcile, level-triggered and idempotent, runs when a DiffusionPipeline is created, changed
or found on start-up, and whenever one of its children changes or is deleted (so a child edited
or deleted by hand is restored within seconds). Children are watched with event handlers rather
than a timer: kopf puts a finalizer on objects with timers, and a finalizer would make deleting a
pipeline depend on the operator running.
"""

from __future__ import annotations

import base64
import datetime
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, cast

import kopf

from triptych.security import new_key_set, public_fingerprint
from triptych_operator import kube
from triptych_operator.constants import (
    DEFAULT_HEAD_IMAGE,
    DEFAULT_WORKER_IMAGE,
    GROUP,
    HEAD_IMAGE_ENV,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGER,
    PLURAL,
    VERSION,
    WORKER_IMAGE_ENV,
)
from triptych_operator.manifests import control_keys_secret, render
from triptych_operator.spec import PipelineSpec, SpecError, parse_pipeline
from triptych_operator.status import PHASE_READY, compute_status

OWNED = {LABEL_MANAGED_BY: MANAGER}
APPLY_RETRY_S = 30

_locks_guard = threading.Lock()
_locks: dict[tuple[str, str], threading.Lock] = {}
# The last reconcile's refusal per pipeline, so a status refresh from a pod event keeps reporting it.
_apply_errors: dict[tuple[str, str], str | None] = {}


def _pipeline_lock(namespace: str, name: str) -> threading.Lock:
    """Child events arrive in parallel; one reconcile per pipeline at a time keeps events and status coherent."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations: the status schema is ours and strict.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # our own kopf.info/warn events are the ones worth reading
    settings.watching.server_timeout = 300


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else $KUBECONFIG read now, else the client library's own discovery.

    kopf's default goes straight to the client library, which fixes its default kubeconfig path
    when it is imported; reading $KUBECONFIG at login keeps in-process runs (tests) on the right cluster.
    """
    return (
        kopf.login_with_service_account(**kwargs)
        or kopf.login_with_kubeconfig(**kwargs)
        or kopf.login_via_client(**kwargs)
    )


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def pipeline_changed(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """The pipeline was created, edited, or found on start-up: make its children match."""
    apply_error = reconcile(dict(body), trigger="pipeline", logger=logger)
    if apply_error:
        raise kopf.TemporaryError(apply_error, delay=APPLY_RETRY_S)


CHILD_FILTER: dict[str, Any] = {**OWNED, LABEL_INSTANCE: kopf.PRESENT}


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_FILTER)
@kopf.on.event("", "v1", "services", labels=CHILD_FILTER)
@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels=CHILD_FILTER)
@kopf.on.event("networking.k8s.io", "v1", "ingresses", labels=CHILD_FILTER)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=CHILD_FILTER)
def child_changed(
    event: kopf.RawEvent, namespace: str | None, labels: kopf.Labels, logger: kopf.Logger, **_: Any
) -> None:
    """A child was edited or deleted: reconcile its pipeline, which restores what drifted.

    Deployment status changes arrive here too, which is what keeps the pipeline's status current.
    """
    if event.get("type") not in ("MODIFIED", "DELETED") or not namespace:
        return  # None is the initial listing (resume covers it); ADDED is our own apply
    pipeline = kube.get_pipeline(labels[LABEL_INSTANCE], namespace)
    if pipeline is None or pipeline["metadata"].get("deletionTimestamp"):
        return  # the pipeline is gone or going; garbage collection is removing its children
    reconcile(pipeline, trigger=f"child-{str(event['type']).lower()}", logger=logger)


@kopf.on.event("v1", "pods", labels=CHILD_FILTER)
def pod_changed(
    event: kopf.RawEvent, namespace: str | None, labels: kopf.Labels, logger: kopf.Logger, **_: Any
) -> None:
    """A pipeline's pod changed (scheduled, ready, crash-looping): refresh the status, apply nothing."""
    if event.get("type") is None or not namespace:
        return
    pipeline = kube.get_pipeline(labels[LABEL_INSTANCE], namespace)
    if pipeline is None or pipeline["metadata"].get("deletionTimestamp"):
        return
    name = pipeline["metadata"]["name"]
    with _pipeline_lock(namespace, name):
        _write_status(pipeline, _spec_error(pipeline), _apply_errors.get((namespace, name)))


def _spec_error(pipeline: dict[str, Any]) -> str | None:
    """The validation message the current spec earns (so a status refresh keeps reporting it)."""
    try:
        render(_parse(pipeline), owner=pipeline)
    except SpecError as exc:
        return str(exc)
    return None


def _parse(pipeline: dict[str, Any]) -> PipelineSpec:
    meta = pipeline["metadata"]
    return parse_pipeline(
        meta["name"],
        meta["namespace"],
        pipeline.get("spec") or {},
        worker_image=os.environ.get(WORKER_IMAGE_ENV, DEFAULT_WORKER_IMAGE),
        head_image=os.environ.get(HEAD_IMAGE_ENV, DEFAULT_HEAD_IMAGE),
    )


def reconcile(pipeline: dict[str, Any], *, trigger: str, logger: kopf.Logger) -> str | None:
    """Make the children of `pipeline` match its spec, then write its status.

    Returns the API server's refusal of a child, if any (the status says so as well).
    """
    meta = pipeline["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    with _pipeline_lock(namespace, name):
        spec_error: str | None = None
        apply_error: str | None = None
        try:
            spec = _parse(pipeline)
            deletions = render(spec).delete  # also validates: an invalid spec creates nothing, not even keys
        except SpecError as exc:
            # Nothing is applied: the objects of the last valid spec keep running untouched.
            spec_error = str(exc)
        else:
            try:
                fingerprint = _ensure_control_keys(pipeline, spec, logger=logger)
                children = render(spec, owner=pipeline, keys_fingerprint=fingerprint)
                _apply_children(pipeline, children.apply, trigger=trigger, logger=logger)
            except kube.ApplyError as exc:
                apply_error = str(exc)
            for ref in deletions:
                if kube.delete_managed(ref.api_version, ref.kind, ref.name, namespace):
                    message = f"{ref.kind} {ref.name} is no longer in the spec"
                    _post(pipeline, "Normal", reason="Deleted", message=message)
        _apply_errors[(namespace, name)] = apply_error
        _write_status(pipeline, spec_error, apply_error)
        return apply_error


def _ensure_control_keys(pipeline: dict[str, Any], spec: PipelineSpec, *, logger: kopf.Logger) -> str:
    """The pipeline's control-plane key Secret, created with new keys if there is none (first
    reconcile, or deleted to rotate them); returns its public fingerprint for the pod templates."""
    secret = control_keys_secret(spec, new_key_set())
    kopf.append_owner_reference(secret, owner=kopf.Body(cast(kopf.RawBody, pipeline)))
    live, created = kube.create_once(secret)
    files = {name: base64.b64decode(value).decode() for name, value in (live.get("data") or {}).items()}
    fingerprint = public_fingerprint(files)
    if created:
        message = f"Secret {secret['metadata']['name']}: new control-plane keys (fingerprint {fingerprint})"
        _post(pipeline, "Normal", reason="KeysCreated", message=message)
        logger.info("%s", message)
    return fingerprint


def _apply_children(
    pipeline: dict[str, Any], manifests: list[dict[str, Any]], *, trigger: str, logger: kopf.Logger
) -> None:
    by_hand = trigger.startswith("child")
    for manifest in manifests:
        result = kube.apply(manifest)
        what = f"{manifest['kind']} {manifest['metadata']['name']}"
        if result is kube.ApplyResult.CREATED:
            reason = "Restored" if by_hand else "Created"
            message = what + (" was deleted by hand; recreated" if by_hand else "")
            _post(pipeline, "Normal", reason=reason, message=message)
            logger.info("%s: %s", reason, message)
        elif result is kube.ApplyResult.UPDATED:
            reason = "DriftCorrected" if by_hand else "Updated"
            message = what + (" was edited by hand; restored to the spec" if by_hand else " updated to the new spec")
            _post(pipeline, "Normal", reason=reason, message=message)
            logger.info("%s: %s", reason, message)


def _write_status(pipeline: dict[str, Any], spec_error: str | None, apply_error: str | None) -> None:
    """Compute the status from the live Deployments and pods; patch it (and announce changes) if it changed."""
    meta = pipeline["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    # Compare with the status as stored now, not as it was when this event was queued, so a
    # change is announced once even when several events race to report it.
    live = kube.get_pipeline(name, namespace)
    if live is None:
        return
    deployments = {d["metadata"]["labels"].get(LABEL_COMPONENT): d for d in kube.pipeline_deployments(name, namespace)}
    pods: dict[str, list[dict[str, Any]]] = {}
    for pod in kube.pipeline_pods(name, namespace):
        pods.setdefault(pod["metadata"]["labels"].get(LABEL_COMPONENT), []).append(pod)
    old = live.get("status") or {}
    status = compute_status(
        int(meta.get("generation") or 0),
        deployments,
        pods,
        spec_error=spec_error,
        apply_error=apply_error,
        previous_conditions=old.get("conditions") or [],
        now=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    if status == old:
        return
    _announce(pipeline, old, status)
    kube.patch_pipeline_status(name, namespace, status)


def _announce(pipeline: dict[str, Any], old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """Events for what a person would want to know: the phase changed, or a new problem appeared."""
    degraded = next(c for c in new["conditions"] if c["type"] == "Degraded")
    old_degraded: Mapping[str, Any] = next((c for c in old.get("conditions") or [] if c.get("type") == "Degraded"), {})
    if degraded["status"] == "True" and degraded["message"] != old_degraded.get("message"):
        _post(pipeline, "Warning", reason=degraded["reason"], message=degraded["message"])
    if new["phase"] != old.get("phase"):
        message = f"phase {old.get('phase') or 'None'} -> {new['phase']}"
        if new["phase"] == PHASE_READY:
            _post(pipeline, "Normal", reason="Ready", message=message + ": every role and the head are ready")
        else:
            _post(pipeline, "Normal", reason="PhaseChanged", message=message)


def _post(pipeline: dict[str, Any], type_: str, *, reason: str, message: str) -> None:
    """A Kubernetes Event on the pipeline (`kubectl describe dp` shows it)."""
    kopf.event(kopf.Body(cast(kopf.RawBody, pipeline)), type=type_, reason=reason, message=message)
