"""The operator's only door to the API server: server-side apply, delete, read, status patch.

Only writes and the few reads a cache cannot answer go through here: the handlers keep the live
children and pods in kopf indexes (fed by the watches kopf runs anyway), so nothing here lists.

Server-side apply makes reconciling idempotent: re-applying an unchanged object is a no-op (its
resourceVersion and generation stay), and fields edited by hand are taken back (force=True).

The client is synchronous; handlers run its calls through `run`, on a pool of API_CONCURRENCY
threads with as many pooled connections. asyncio's default pool has cores + 4 threads: with 200
pipelines created at once, their requests queued behind each other there.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import enum
import functools
import json
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import DynamicApiError, NotFoundError
from kubernetes.utils import quantity

from triptych_operator.constants import GROUP, KIND, LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGER, PLURAL, VERSION

API_CONCURRENCY = 16  # requests in flight at once
PEERING_GROUP, PEERING_VERSION = "kopf.dev", "v1"  # kopf's peering objects, as the chart creates them
HANDOVER_MANAGER = f"{MANAGER}-handover"  # holds a Deployment's replicas from the operator's last apply to its HPA
_lock = threading.Lock()
_clients: dict[str, DynamicClient] = {}
_executor = ThreadPoolExecutor(API_CONCURRENCY, thread_name_prefix="kube")
P = ParamSpec("P")
R = TypeVar("R")


async def run(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Call one of this module's functions from a handler, without blocking the event loop.

    As asyncio.to_thread does, the call sees the handler's context variables (kopf.event needs kopf's).
    """
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_executor, call)


class ApplyError(RuntimeError):
    """The API server refused an object; the message names it and quotes the server."""


class ApplyResult(enum.Enum):
    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"


def dynamic_client() -> DynamicClient:
    """One client per kubeconfig (in-cluster when there is none); discovery is cached with it."""
    key = os.environ.get("KUBECONFIG", "")
    with _lock:
        if key not in _clients:
            configuration = client.Configuration()
            if os.environ.get("KUBERNETES_SERVICE_HOST") and not key:
                config.load_incluster_config(client_configuration=configuration)
            else:
                config.load_kube_config(config_file=key or None, client_configuration=configuration)
            configuration.connection_pool_maxsize = API_CONCURRENCY
            _clients[key] = DynamicClient(client.ApiClient(configuration))
        return _clients[key]


def _resource(api_version: str, kind: str) -> Any:
    return dynamic_client().resources.get(api_version=api_version, kind=kind)


def _get(api_version: str, kind: str, name: str, namespace: str, *, cached: bool = False) -> dict[str, Any] | None:
    # cached: from the API server's watch cache (resourceVersion=0), no etcd read; may lag it by moments.
    version = "0" if cached else None
    try:
        found = _resource(api_version, kind).get(name=name, namespace=namespace, resource_version=version)
        return dict(found.to_dict())
    except NotFoundError:
        return None


def get_managed(api_version: str, kind: str, name: str, namespace: str, pipeline: str) -> dict[str, Any] | None:
    """The live object, or None; ApplyError when one exists that the operator does not manage, or
    manages for another pipeline than `pipeline`.

    Read from the API server's cache: a new pipeline asks this of every child, and the answer only
    decides whether a name is taken by someone else's object (and whether the apply creates).
    """
    live = _get(api_version, kind, name, namespace, cached=True)
    labels = (live or {}).get("metadata", {}).get("labels") or {}
    if live is not None and labels.get(LABEL_MANAGED_BY) != MANAGER:
        # Never take over someone else's object that happens to have the name we need.
        raise ApplyError(
            f"{kind} {name} already exists and is not managed by {MANAGER}; rename the pipeline or remove that object"
        )
    owner = labels.get(LABEL_INSTANCE)
    if live is not None and owner != pipeline:
        # Two names can render one object: svc's split prompt encoder and svc-prompt's combined encoder are
        # both svc-prompt-encoder. The pipeline that has it keeps it; two applying it would fight over it.
        raise ApplyError(
            f"{kind} {name} already belongs to DiffusionPipeline {owner}: metadata.name {pipeline!r} renders the "
            f"same name for one of its objects; rename this pipeline"
        )
    return live


def apply(obj: Mapping[str, Any], before: Mapping[str, Any] | None) -> tuple[ApplyResult, dict[str, Any]]:
    """Server-side apply `obj` as the operator's field manager; `before` is the live object the caller
    read (from its cache or `get_managed`). Returns whether anything changed, and the object now."""
    meta = obj["metadata"]
    if obj["kind"] == "Deployment" and "replicas" not in obj["spec"] and before is not None:
        _hand_over_replicas(obj, before)
    try:
        after = (
            dynamic_client()
            .server_side_apply(
                _resource(obj["apiVersion"], obj["kind"]),
                body=dict(obj),
                name=meta["name"],
                namespace=meta["namespace"],
                field_manager=MANAGER,
                force_conflicts=True,
            )
            .to_dict()
        )
    except DynamicApiError as exc:
        raise ApplyError(f"{obj['kind']} {meta['name']}: {_server_message(exc)}") from exc
    if before is None:
        return ApplyResult.CREATED, after
    if before["metadata"].get("resourceVersion") != after["metadata"]["resourceVersion"]:
        return ApplyResult.UPDATED, after
    return ApplyResult.UNCHANGED, after


def _hand_over_replicas(obj: Mapping[str, Any], before: Mapping[str, Any]) -> None:
    """Keep a Deployment's live replicas through an apply that leaves them to its HPA (autoscaling turned on).

    Server-side apply resets a field that the applier alone owned and no longer sets: the operator's
    earlier applies own spec.replicas, so dropping it would take a busy role to 1 (the default) before
    its HPA exists. Applying the live value first as HANDOVER_MANAGER makes that manager co-own it, so
    the field stays (Kubernetes' documented hand-over to an HPA); the HPA's first scale takes it from
    there. Not forced: a conflict means another manager (the HPA) owns a newer value, so nothing is
    left for the operator to drop. One more request per apply of an autoscaled Deployment, which is rare.
    """
    replicas = (before.get("spec") or {}).get("replicas")
    if replicas is None:
        return
    meta = obj["metadata"]
    keep = {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": {"name": meta["name"]}}
    keep["spec"] = {"replicas": replicas}
    try:
        dynamic_client().server_side_apply(
            _resource(obj["apiVersion"], obj["kind"]),
            body=keep,
            name=meta["name"],
            namespace=meta["namespace"],
            field_manager=HANDOVER_MANAGER,
        )
    except DynamicApiError as exc:
        if exc.status != 409:
            raise ApplyError(f"{obj['kind']} {meta['name']}: {_server_message(exc)}") from exc


def create_once(obj: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the live object of `obj`'s name, whether it was created now from `obj`); an existing one is
    never changed (a Secret of generated keys must not be rewritten by a later reconcile)."""
    meta = obj["metadata"]
    what = f"{obj['kind']} {meta['name']}"
    for _ in range(2):  # a second reconcile may create it between our read and our create: read it then
        live = _get(obj["apiVersion"], obj["kind"], meta["name"], meta["namespace"])
        if live is not None:
            if (live["metadata"].get("labels") or {}).get(LABEL_MANAGED_BY) != MANAGER:
                raise ApplyError(f"{what} already exists and is not managed by {MANAGER}; remove or rename it")
            return live, False
        resource = _resource(obj["apiVersion"], obj["kind"])
        try:
            return dict(resource.create(body=dict(obj), namespace=meta["namespace"]).to_dict()), True
        except DynamicApiError as exc:
            if exc.status != 409:
                raise ApplyError(f"{what}: {_server_message(exc)}") from exc
    raise ApplyError(f"{what} could not be created or read")


def delete(api_version: str, kind: str, name: str, namespace: str) -> bool:
    """Delete an object the caller knows the operator manages; True when something was deleted.
    A refusal (403 without the RBAC, an admission webhook) raises ApplyError, which the status reports."""
    try:
        _resource(api_version, kind).delete(name=name, namespace=namespace)
    except NotFoundError:
        return False
    except DynamicApiError as exc:
        raise ApplyError(f"the deletion of {kind} {name}: {_server_message(exc)}") from exc
    return True


def patch_pipeline_status(name: str, namespace: str, status: Mapping[str, Any]) -> None:
    """Replace the pipeline's status fields (merge patch: lists such as conditions are replaced whole,
    a field set to None is removed)."""
    api = client.CustomObjectsApi(dynamic_client().client)
    try:
        api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)})
    except client.ApiException as exc:
        if exc.status != 404:
            raise
        # Deleted while we reconciled: nothing to report on.


def scale_deployment(name: str, namespace: str, replicas: int, manager: str) -> None:
    """Set a Deployment's replicas through its scale subresource, as the HPA does (`manager` names the writer)."""
    api = client.AppsV1Api(dynamic_client().client)
    api.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": replicas}}, field_manager=manager)


def annotate_deployment(name: str, namespace: str, annotations: Mapping[str, str | None], manager: str) -> None:
    """Set (or, with None, remove) annotations of a Deployment with a merge patch as `manager`."""
    api = client.AppsV1Api(dynamic_client().client)
    body = {"metadata": {"annotations": dict(annotations)}}
    api.patch_namespaced_deployment(name, namespace, body, field_manager=manager)


def peering_status(name: str, namespace: str | None) -> dict[str, Any] | None:
    """The status of kopf's peering object `name` (its peers: identity -> priority, lifetime, lastseen):
    the ClusterKopfPeering with `namespace` None, else that namespace's KopfPeering; None when absent."""
    api = client.CustomObjectsApi(dynamic_client().client)
    body: Any
    try:
        if namespace is None:
            body = api.get_cluster_custom_object(PEERING_GROUP, PEERING_VERSION, "clusterkopfpeerings", name)
        else:
            body = api.get_namespaced_custom_object(PEERING_GROUP, PEERING_VERSION, namespace, "kopfpeerings", name)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return dict(body.get("status") or {})


def deployment_metric(name: str, namespace: str, metric: str) -> float | None:
    """The custom metrics API's value of `metric` describing Deployment `name` (what an HPA's Object
    metric reads); None when the API has none for it now (no server, no head to scrape). A refusal
    (401, 403: the operator's RBAC lacks the metric) raises: that is a setup to fix, not a quiet signal."""
    path = f"/apis/custom.metrics.k8s.io/v1beta2/namespaces/{namespace}/deployments.apps/{name}/{metric}"
    try:
        response = dynamic_client().request("get", path, serialize=False, _request_timeout=10)
        items = json.loads(response.data).get("items") or []
    except DynamicApiError as exc:
        if exc.status in (401, 403):
            raise
        return None
    except (ValueError, OSError, urllib3.exceptions.HTTPError):
        return None
    if not items:
        return None
    return float(quantity.parse_quantity(items[0]["value"]))


def pipeline_event(name: str, namespace: str, uid: str, reason: str, message: str) -> None:
    """A Normal Event on a pipeline (what `kubectl describe` lists), from outside a kopf handler."""
    now = datetime.datetime.now(datetime.UTC)
    pipeline = client.V1ObjectReference(
        api_version=f"{GROUP}/{VERSION}", kind=KIND, name=name, namespace=namespace, uid=uid
    )
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name=f"{name}.", namespace=namespace),
        involved_object=pipeline,
        reason=reason,
        message=message[:1024],
        type="Normal",
        source=client.V1EventSource(component=MANAGER),
        first_timestamp=now,
        last_timestamp=now,
        count=1,
    )
    client.CoreV1Api(dynamic_client().client).create_namespaced_event(namespace, event)


def _server_message(exc: DynamicApiError) -> str:
    try:
        return str(json.loads(exc.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return f"{exc.status} {exc.reason}"
