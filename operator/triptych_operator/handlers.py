"""kopf handlers: they only apply what `spec` + `manifests` + `status` compute.

One reconcile, level-triggered and idempotent, runs when a DiffusionPipeline is created, changed
or found on start-up, and whenever one of its children changes or is deleted (so a child edited
or deleted by hand is restored within seconds). Children are watched with event handlers rather
than a timer: kopf puts a finalizer on objects with timers, and a finalizer would make deleting a
pipeline depend on the operator running.

A reconcile costs what changed, not what exists. The live pipelines, children and pods are kept in
kopf indexes, fed by the watches kopf runs anyway, so no reconcile lists or re-reads them; a child
is applied only when its manifest changed or a field the operator sets was edited (`drift`); the
spec is parsed once per generation and the status written only when it differs from the last one
written (`pipeline_state`). With nothing changing, the operator sends the API server nothing.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import os
from collections.abc import Mapping
from typing import Any, cast

import kopf

from triptych.security import new_key_set, public_fingerprint
from triptych_operator import drift, kube, wake
from triptych_operator.constants import (
    API_TIME_FORMAT,
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
from triptych_operator.fields import FieldError
from triptych_operator.leading import Leadership
from triptych_operator.manifests import control_keys_secret, render
from triptych_operator.pipeline_state import PipelineKey, PipelineState, PipelineStates
from triptych_operator.spec.model import PipelineSpec
from triptych_operator.spec.rules import parse_pipeline
from triptych_operator.status import (
    PHASE_READY,
    components_scaling_to_zero,
    compute_status,
    pipeline_components,
    status_patch,
)

OWNED = {LABEL_MANAGED_BY: MANAGER}
CHILD_FILTER: dict[str, Any] = {**OWNED, LABEL_INSTANCE: kopf.PRESENT}
APPLY_RETRY_S = 30
STATUS_DELAY_S = 1.0  # status changes within this long go out as one patch
STATUS_RETRY_S = 10
# With peering (main.py --peering): how long a silent replica counts as alive (kopf's keep-alive lifetime).
PEERING_LIFETIME_S = 60
# This replica among its peers (main.py sets it with --peering): whether the scale-to-zero loop acts.
LEADERSHIP = Leadership()
# The folders a hostPath model volume must lie under (main.py sets them: --allowed-host-path); none: any.
ALLOWED_HOST_PATHS: tuple[str, ...] = ()

# The watched kinds, by the (apiVersion, kind) of the manifests, and the kopf index holding each.
CHILD_KINDS: dict[tuple[str, str], tuple[str, str, str, str]] = {
    # (apiVersion, kind): (group, version, plural, index name)
    ("apps/v1", "Deployment"): ("apps", "v1", "deployments", "deployment_index"),
    ("v1", "Service"): ("", "v1", "services", "service_index"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): ("autoscaling", "v2", "horizontalpodautoscalers", "hpa_index"),
    ("networking.k8s.io/v1", "Ingress"): ("networking.k8s.io", "v1", "ingresses", "ingress_index"),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networking.k8s.io", "v1", "networkpolicies", "networkpolicy_index"),
    ("policy/v1", "PodDisruptionBudget"): ("policy", "v1", "poddisruptionbudgets", "pdb_index"),
    ("v1", "ConfigMap"): ("", "v1", "configmaps", "configmap_index"),  # spec.model.loras, the adapter catalogue
}
# What kopf keeps on the pipeline with the storages `configure` sets (its handler-progress keys
# appear only while a handler is retried).
KOPF_ANNOTATIONS = frozenset({f"{GROUP}/kopf-managed", f"{GROUP}/last-handled-configuration"})
POD_INDEX = "pod_index"
DEPLOYMENT_INDEX = CHILD_KINDS[("apps/v1", "Deployment")][3]
# (what an apply did, whether the reconcile was for a child changed by someone else) -> Event reason
CHANGE_REASONS = {
    (kube.ApplyResult.CREATED, False): "Created",
    (kube.ApplyResult.CREATED, True): "Restored",
    (kube.ApplyResult.UPDATED, False): "Updated",
    (kube.ApplyResult.UPDATED, True): "DriftCorrected",
}
CHANGE_MESSAGES = {
    "Created": "created",
    "Restored": "deleted by hand; recreated",
    "Updated": "updated to the new spec",
    "DriftCorrected": "edited by hand; restored to the spec",
}
PIPELINE_INDEX = "pipeline_index"
Indexes = Mapping[str, Any]  # the handler's kwargs: kopf passes every index by its name


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations: the status schema is ours and strict.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # our own kopf.info/warn events are the ones worth reading
    settings.watching.server_timeout = 300
    settings.peering.lifetime = PEERING_LIFETIME_S
    settings.peering.stealth = True  # keep-alives are not worth a log line each
    memo.pipelines = PipelineStates()


@kopf.on.startup()
async def start_waking(memo: kopf.Memo, **indexes: Any) -> None:
    """The roles that scale to zero: taken down when idle, up when a request needs them (wake.py).

    kopf hands a startup handler its indexes too: live views, which the loop reads on every pass."""
    memo.waking = asyncio.create_task(
        wake.run(memo.pipelines, indexes[DEPLOYMENT_INDEX], LEADERSHIP), name="scale to zero"
    )


@kopf.on.cleanup()
async def stop_waking(memo: kopf.Memo, **_: Any) -> None:
    task = getattr(memo, "waking", None)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


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


def _trim(body: kopf.Body) -> dict[str, Any]:
    """The object as the index keeps it: without managedFields, which are large and never read."""
    obj = dict(body)
    obj["metadata"] = {k: v for k, v in body["metadata"].items() if k != "managedFields"}
    return obj


def _index_by_pipeline(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[LABEL_INSTANCE]): _trim(body)}


for _group, _version, _plural, _index in [*CHILD_KINDS.values(), ("", "v1", "pods", POD_INDEX)]:
    kopf.index(_group, _version, _plural, labels=CHILD_FILTER, id=_index)(_index_by_pipeline)


@kopf.index(GROUP, VERSION, PLURAL, id=PIPELINE_INDEX)
def _index_pipeline(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): _trim(body)}


def _live(indexes: Indexes, index: str, key: PipelineKey) -> list[dict[str, Any]]:
    store = indexes[index].get(key)
    return list(store) if store is not None else []


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def pipeline_changed(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any) -> None:
    """The pipeline was created, edited, or found on start-up: make its children match."""
    pipeline = _trim(body)
    apply_error = await reconcile(pipeline, memo.pipelines, kwargs, trigger="pipeline", logger=logger)
    if apply_error:
        raise kopf.TemporaryError(apply_error, delay=APPLY_RETRY_S)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def pipeline_event(
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    name: str | None,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """A deleted pipeline's state is dropped; new annotations re-read its key Secret.

    kopf's update handler ignores annotations under the operator's own prefix (its storage), and the
    documented way to rotate keys is to delete the Secret and annotate the pipeline.
    """
    if not namespace or not name:
        return
    if event.get("type") == "DELETED":
        memo.pipelines.forget((namespace, name))
        return
    state = memo.pipelines.by_key.get((namespace, name))
    if event.get("type") != "MODIFIED" or state is None or state.annotations is None:
        return
    if _annotations(body) != state.annotations and not body["metadata"].get("deletionTimestamp"):
        await reconcile(_trim(body), memo.pipelines, kwargs, trigger="pipeline", logger=logger)


def _annotations(pipeline: Mapping[str, Any]) -> str:
    """Digest of the annotations a person sets; kopf's own (written after every handled spec) do not count."""
    annotations = pipeline["metadata"].get("annotations") or {}
    return drift.digest({k: v for k, v in annotations.items() if k not in KOPF_ANNOTATIONS})


def _child_event_handler(group: str, version: str, plural: str) -> None:
    @kopf.on.event(group, version, plural, labels=CHILD_FILTER, id=f"child-{plural}")
    async def child_changed(
        event: kopf.RawEvent,
        body: kopf.Body,
        namespace: str | None,
        labels: kopf.Labels,
        memo: kopf.Memo,
        logger: kopf.Logger,
        **kwargs: Any,
    ) -> None:
        """A child was edited or deleted: reconcile its pipeline, which restores what drifted.

        Deployment status changes arrive here too, which is what keeps the pipeline's status current.
        """
        if event.get("type") not in ("MODIFIED", "DELETED") or not namespace:
            return  # None is the initial listing (resume covers it); ADDED is our own apply
        key = (namespace, labels[LABEL_INSTANCE])
        pipeline = _pipeline(kwargs, key)
        if pipeline is None:
            return  # the pipeline is gone or going; garbage collection is removing its children
        if event["type"] == "DELETED":
            memo.pipelines.get(key).applied.pop((body["kind"], body["metadata"]["name"]), None)
        await reconcile(pipeline, memo.pipelines, kwargs, trigger=f"child-{str(event['type']).lower()}", logger=logger)


for _group, _version, _plural, _index in CHILD_KINDS.values():
    _child_event_handler(_group, _version, _plural)


@kopf.on.event("v1", "pods", labels=CHILD_FILTER)
async def pod_changed(
    event: kopf.RawEvent,
    namespace: str | None,
    labels: kopf.Labels,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """A pipeline's pod changed (scheduled, ready, crash-looping): refresh the status, apply nothing."""
    if event.get("type") is None or not namespace:
        return
    key = (namespace, labels[LABEL_INSTANCE])
    if _pipeline(kwargs, key) is None:
        return
    state = memo.pipelines.get(key)
    if state.parsed_for is None:
        return  # not reconciled yet in this process: the reconcile will write the status
    _status_soon(key, state, kwargs, logger=logger)


def _pipeline(indexes: Indexes, key: PipelineKey) -> dict[str, Any] | None:
    """The pipeline as last seen by the watch; None when it is gone or being deleted."""
    found = _live(indexes, PIPELINE_INDEX, key)
    if not found or found[0]["metadata"].get("deletionTimestamp"):
        return None
    return found[0]


def _parse(pipeline: Mapping[str, Any]) -> PipelineSpec:
    meta = pipeline["metadata"]
    return parse_pipeline(
        meta["name"],
        meta["namespace"],
        pipeline.get("spec") or {},
        worker_image=os.environ.get(WORKER_IMAGE_ENV, DEFAULT_WORKER_IMAGE),
        head_image=os.environ.get(HEAD_IMAGE_ENV, DEFAULT_HEAD_IMAGE),
        allowed_host_paths=ALLOWED_HOST_PATHS,
    )


def _validate(pipeline: Mapping[str, Any], state: PipelineState, *, logger: kopf.Logger) -> None:
    """Parse and render once per (uid, generation); an invalid spec creates nothing, not even keys.

    The outcome is recorded with its generation only once it is known: a check that fails in an
    unexpected way is an Invalid spec too (the operator's bug, logged with its traceback), never a
    pipeline left without objects and without a word in its status."""
    meta = pipeline["metadata"]
    parsed_for = (str(meta.get("uid")), int(meta.get("generation") or 0))
    if state.parsed_for == parsed_for:
        return
    spec: PipelineSpec | None = None
    error: str | None = None
    deletions: list[Any] = []
    try:
        parsed = _parse(pipeline)
        deletions = render(parsed).delete
        spec = parsed
    except FieldError as exc:  # SpecError, or a declaration check's own: both name the field
        # Nothing is applied: the objects of the last valid spec keep running untouched.
        error = str(exc)
    except Exception as exc:  # any failure of a check must reach the status, not kopf's retries
        logger.exception("checking the spec of %s/%s failed", meta.get("namespace"), meta.get("name"))
        error = (
            f"spec: the operator failed to check this spec ({type(exc).__name__}: {exc}), so nothing was applied; "
            "this is an operator bug, and the operator's log has its traceback"
        )
    state.parsed_for, state.spec, state.spec_error, state.deletions = parsed_for, spec, error, deletions
    if spec is not None:
        state.last_valid_spec = spec


async def reconcile(
    pipeline: dict[str, Any], states: PipelineStates, indexes: Indexes, *, trigger: str, logger: kopf.Logger
) -> str | None:
    """Make the children of `pipeline` match its spec, then write its status.

    Returns the API server's refusal of a child, if any (the status says so as well).
    """
    meta = pipeline["metadata"]
    key = (meta["namespace"], meta["name"])
    state = states.get(key)
    async with state.lock:
        _validate(pipeline, state, logger=logger)
        if state.spec is not None:
            try:
                if trigger == "pipeline" or state.keys_fingerprint is None:
                    state.annotations = _annotations(pipeline)
                    # The Secret is read on pipeline events only: deleting it and touching the pipeline rotates keys.
                    state.keys_fingerprint = await kube.run(_ensure_control_keys, pipeline, state.spec, logger=logger)
                rendered_for = (*state.parsed_for, state.keys_fingerprint)  # type: ignore[misc]
                if state.rendered_for != rendered_for:
                    state.children = render(state.spec, owner=pipeline, keys_fingerprint=state.keys_fingerprint)
                    for manifest in state.children.apply:
                        drift.stamp(manifest)
                    state.digests = {(m["kind"], m["metadata"]["name"]): drift.digest(m) for m in state.children.apply}
                    state.rendered_for = rendered_for
                assert state.children is not None
                await _apply_children(pipeline, state, indexes, trigger=trigger, logger=logger)
                if trigger == "pipeline":  # a spec change may leave a role asleep that no longer scales to zero
                    await wake.wake_left_asleep(state.spec, key[0], _live(indexes, DEPLOYMENT_INDEX, key))
                state.apply_error = None
            except kube.ApplyError as exc:
                state.apply_error = str(exc)
            try:  # after a refused apply the old shape's pools stay: they serve until the new shape is applied
                await _delete_unwanted(pipeline, state, indexes, keep_pools=state.apply_error is not None)
            except kube.ApplyError as exc:  # reported like a refused apply, not left to kopf's retries alone
                state.apply_error = state.apply_error or str(exc)
        else:
            state.apply_error = None  # nothing was applied for this spec
        _status_soon(key, state, indexes, logger=logger)
        return state.apply_error


def _ensure_control_keys(pipeline: dict[str, Any], spec: PipelineSpec, *, logger: kopf.Logger) -> str:
    """The pipeline's control-plane key Secret, created with new keys if there is none (first
    reconcile, or deleted to rotate them); returns its public fingerprint for the pod templates."""
    secret = control_keys_secret(spec, new_key_set())
    kopf.append_owner_reference(secret, owner=kopf.Body(cast(kopf.RawBody, pipeline)))
    live, created = kube.create_once(secret)
    _check_keys_owner(pipeline, live)
    files = {name: base64.b64decode(value).decode() for name, value in (live.get("data") or {}).items()}
    fingerprint = public_fingerprint(files)
    if created:
        message = f"Secret {secret['metadata']['name']}: new control-plane keys (fingerprint {fingerprint})"
        _post(pipeline, "Normal", reason="KeysCreated", message=message)
        logger.info("%s", message)
    return fingerprint


def _check_keys_owner(pipeline: dict[str, Any], secret: Mapping[str, Any]) -> None:
    """ApplyError for a key Secret of an earlier pipeline of this name (deleted, then created again
    before the garbage collector came): its pods would mount a Secret about to be deleted, and new
    pods then fail to start. The reconcile is retried; once the collector has removed it, new keys."""
    uid = pipeline["metadata"].get("uid")
    owners = [ref for ref in secret["metadata"].get("ownerReferences") or [] if ref.get("kind") == pipeline.get("kind")]
    if uid and owners and all(ref.get("uid") != uid for ref in owners):
        raise kube.ApplyError(
            f"Secret {secret['metadata']['name']} belongs to an earlier DiffusionPipeline of this name "
            f"(uid {owners[0].get('uid')}), deleted; waiting for the garbage collector to remove it"
        )


def _live_child(indexes: Indexes, key: PipelineKey, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
    for obj in _live(indexes, CHILD_KINDS[(api_version, kind)][3], key):
        if obj["metadata"]["name"] == name:
            return obj
    return None


async def _apply_children(
    pipeline: dict[str, Any], state: PipelineState, indexes: Indexes, *, trigger: str, logger: kopf.Logger
) -> None:
    """Apply each child whose manifest changed or that drifted; the others cost no request.

    Each child applied gets a log line; the pipeline gets one Event per kind of change (Created,
    Updated, Restored, DriftCorrected) naming every child it concerns, not one Event per child.
    """
    assert state.children is not None
    meta = pipeline["metadata"]
    key = (meta["namespace"], meta["name"])
    by_hand = trigger.startswith("child")
    changed: dict[str, list[str]] = {}
    try:
        for manifest in state.children.apply:
            kind, name = manifest["kind"], manifest["metadata"]["name"]
            desired = state.digests[(kind, name)]
            applied = state.applied.get((kind, name))
            live = _live_child(indexes, key, manifest["apiVersion"], kind, name)
            if drift.unchanged(applied, desired, live):
                continue
            if live is None:
                if applied is not None and applied.desired == desired:
                    continue  # applied by us and not deleted since (that drops the record): the watch lags
                # Not ours to know: someone else's object, or another pipeline's, may hold the name.
                live = await kube.run(
                    kube.get_managed, manifest["apiVersion"], kind, name, meta["namespace"], meta["name"]
                )
            if not drift.needs_apply(manifest, live, applied):
                if live is not None:  # as it should be: remember this version, so its next look is free
                    state.applied[(kind, name)] = drift.record(manifest, live, desired)
                continue
            result, after = await kube.run(kube.apply, manifest, live)
            state.applied[(kind, name)] = drift.record(manifest, after, desired)
            if result is not kube.ApplyResult.UNCHANGED:
                reason = CHANGE_REASONS[(result, by_hand)]
                changed.setdefault(reason, []).append(f"{kind} {name}")
                logger.info("%s: %s %s", reason, kind, name)
    finally:
        for reason, children in changed.items():
            _post(pipeline, "Normal", reason=reason, message=f"{CHANGE_MESSAGES[reason]}: {', '.join(children)}")


POOL_KINDS = frozenset({"Deployment", "Service"})  # what a role's pool is made of


async def _delete_unwanted(
    pipeline: dict[str, Any], state: PipelineState, indexes: Indexes, keep_pools: bool = False
) -> None:
    """Remove optional children the spec no longer asks for (a disabled HPA or Ingress, the heads' budget
    when one head is left, the pools of an encoder shape left behind). `keep_pools`: not the pools'
    Deployments and Services (the new shape's were not all applied)."""
    meta = pipeline["metadata"]
    key = (meta["namespace"], meta["name"])
    for ref in state.deletions:
        if keep_pools and ref.kind in POOL_KINDS:
            continue
        if _live_child(indexes, key, ref.api_version, ref.kind, ref.name) is None:
            continue  # the index holds only objects we manage: absent means nothing to delete
        state.applied.pop((ref.kind, ref.name), None)
        if await kube.run(kube.delete, ref.api_version, ref.kind, ref.name, meta["namespace"]):
            _post(pipeline, "Normal", reason="Deleted", message=f"{ref.kind} {ref.name} is no longer in the spec")


def _status_soon(
    key: PipelineKey, state: PipelineState, indexes: Indexes, *, logger: kopf.Logger, delay: float = STATUS_DELAY_S
) -> None:
    """Write the pipeline's status `delay` seconds from now, once for every change until then.

    Its children and pods change in bursts (a rollout moves every pod through several states); one
    patch after the burst says what a patch per event would, at a fraction of the requests.
    """
    if state.status_writer is None:
        state.status_writer = asyncio.create_task(_write_status_later(key, state, indexes, logger, delay))


async def _write_status_later(
    key: PipelineKey, state: PipelineState, indexes: Indexes, logger: kopf.Logger, delay: float
) -> None:
    await asyncio.sleep(delay)
    async with state.lock:
        state.status_writer = None  # a change from now on schedules the next write
        pipeline = _pipeline(indexes, key)
        if pipeline is None:
            return
        try:
            await _write_status(pipeline, state, indexes)
        except Exception as exc:  # the API server refused or was unreachable: retry, as kopf does for a handler
            logger.warning("status not written (%s); retrying in %s s", exc, STATUS_RETRY_S)
            _status_soon(key, state, indexes, logger=logger, delay=STATUS_RETRY_S)


async def _write_status(pipeline: dict[str, Any], state: PipelineState, indexes: Indexes) -> None:
    """Compute the status from the watched Deployments and pods; patch it (and announce changes) if it changed."""
    meta = pipeline["metadata"]
    key = (meta["namespace"], meta["name"])
    deployments = {d["metadata"]["labels"].get(LABEL_COMPONENT): d for d in _live(indexes, DEPLOYMENT_INDEX, key)}
    pods: dict[str, list[dict[str, Any]]] = {}
    for pod in _live(indexes, POD_INDEX, key):
        pods.setdefault(pod["metadata"]["labels"].get(LABEL_COMPONENT), []).append(pod)
    # What this process wrote last is newer than the watched pipeline until its own update arrives.
    old = state.status if state.status is not None else (pipeline.get("status") or {})
    status = compute_status(
        int(meta.get("generation") or 0),
        deployments,
        pods,
        spec_error=state.spec_error,
        apply_error=state.apply_error,
        previous_conditions=old.get("conditions") or [],
        now=datetime.datetime.now(datetime.UTC).strftime(API_TIME_FORMAT),
        # While the spec is invalid, the objects of the last valid one run on: their roles are reported.
        components=pipeline_components(state.spec or state.last_valid_spec),
        scaling_to_zero=components_scaling_to_zero(state.spec or state.last_valid_spec),
    )
    if status == old:
        state.status = status
        return
    _announce(pipeline, old, status)
    await kube.run(kube.patch_pipeline_status, meta["name"], meta["namespace"], status_patch(status))
    state.status = status


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
