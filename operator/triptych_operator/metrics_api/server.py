"""The HTTP side: discovery documents and metric values in the custom.metrics.k8s.io format.

    GET /apis/custom.metrics.k8s.io/v1beta2/namespaces/NS/deployments.apps/NAME/METRIC
    GET /apis/custom.metrics.k8s.io/v1beta2/namespaces/NS/deployments.apps/*/METRIC

return a MetricValueList (one item per Deployment). NAME is `<pipeline>-<role>` (source.deployment_role
finds which pipeline's, when it splits two ways); METRIC one of
prometheus.HEAD_GAUGES. `metricLabelSelector` is accepted and ignored: each metric has one
series per Deployment. v1beta1 is served too (the HPA prefers v1beta2).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from triptych_operator.constants import API_TIME_FORMAT, CUSTOM_METRICS_GROUP
from triptych_operator.metrics_api.auth import Authorizer, RequestHeaderConfig, authenticate, resource_attributes
from triptych_operator.metrics_api.prometheus import HEAD_GAUGES
from triptych_operator.metrics_api.source import HeadMetricsSource, role_deployment_name

log = logging.getLogger(__name__)

VERSIONS = ("v1beta2", "v1beta1")  # preferred first
DEPLOYMENTS = "deployments.apps"
HEALTH_PATHS = ("/healthz", "/livez", "/readyz")

_source_key = web.AppKey("source", HeadMetricsSource)
_authorizer_key = web.AppKey("authorizer", Authorizer)
_auth_config_key = web.AppKey("auth_config", RequestHeaderConfig)


def status(code: int, reason: str, message: str) -> web.Response:
    """A metav1.Status body, as kubectl and the HPA controller expect from an API server."""
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return web.json_response(body, status=code)


def quantity(value: float) -> str:
    """A resource.Quantity string: whole numbers as such, else in thousandths (`1500m`)."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def api_group(version: str | None = None) -> dict[str, Any]:
    versions = [{"groupVersion": f"{CUSTOM_METRICS_GROUP}/{v}", "version": v} for v in VERSIONS]
    return {"name": CUSTOM_METRICS_GROUP, "versions": versions, "preferredVersion": versions[0]}


def resource_list(version: str) -> dict[str, Any]:
    resources = [
        {
            "name": f"{DEPLOYMENTS}/{metric}",
            "singularName": "",
            "namespaced": True,
            "kind": "MetricValueList",
            "verbs": ["get"],
        }
        for metric in HEAD_GAUGES
    ]
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{CUSTOM_METRICS_GROUP}/{version}",
        "resources": resources,
    }


def metric_value(version: str, namespace: str, name: str, metric: str, value: float, at: float) -> dict[str, Any]:
    described = {"kind": "Deployment", "namespace": namespace, "name": name, "apiVersion": "apps/v1"}
    stamp = datetime.datetime.fromtimestamp(at, datetime.UTC).strftime(API_TIME_FORMAT)
    if version == "v1beta1":
        return {"describedObject": described, "metricName": metric, "timestamp": stamp, "value": quantity(value)}
    return {"describedObject": described, "metric": {"name": metric}, "timestamp": stamp, "value": quantity(value)}


@web.middleware
async def authn_authz(request: web.Request, handler: Any) -> web.StreamResponse:
    """Front-proxy authentication and SubjectAccessReview authorization for everything but health."""
    if request.path in HEALTH_PATHS:
        return await handler(request)
    peercert = request.transport.get_extra_info("peercert") if request.transport else None
    user = authenticate(peercert, request.headers, request.app[_auth_config_key])
    if user is None:
        return status(401, "Unauthorized", "this API is served through the kube-apiserver's aggregation layer")
    resource = request.match_info.get("resource")
    authorizer = request.app[_authorizer_key]
    try:
        if resource:
            attrs = resource_attributes(
                CUSTOM_METRICS_GROUP,
                request.match_info["version"],
                request.match_info["namespace"],
                resource,
                request.match_info["name"],
                request.match_info["metric"],
            )
            allowed = await authorizer.allowed(user, resource=attrs)
        else:
            allowed = await authorizer.allowed(user, path=request.path)
    except Exception as exc:  # the API server did not answer the review: refuse, and say why
        log.warning("SubjectAccessReview for %s failed: %s", user.name, exc)
        return status(503, "ServiceUnavailable", f"cannot authorize the request: {exc}")
    if not allowed:
        return status(403, "Forbidden", f'user "{user.name}" cannot get {request.path}')
    return await handler(request)


async def _apis(request: web.Request) -> web.Response:
    return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": [api_group()]})


async def _group(request: web.Request) -> web.Response:
    return web.json_response({"kind": "APIGroup", "apiVersion": "v1", **api_group()})


async def _resources(request: web.Request) -> web.Response:
    version = request.match_info["version"]
    if version not in VERSIONS:
        return status(404, "NotFound", f"{CUSTOM_METRICS_GROUP}/{version} is not served")
    return web.json_response(resource_list(version))


async def _metric(request: web.Request) -> web.Response:
    info: Mapping[str, str] = request.match_info
    version, namespace, resource, name, metric = (
        info["version"],
        info["namespace"],
        info["resource"],
        info["name"],
        info["metric"],
    )
    if version not in VERSIONS:
        return status(404, "NotFound", f"{CUSTOM_METRICS_GROUP}/{version} is not served")
    if resource != DEPLOYMENTS:
        return status(404, "NotFound", f"metrics are served for {DEPLOYMENTS} only, not {resource}")
    if metric not in HEAD_GAUGES:
        return status(404, "NotFound", f"no metric {metric}; served: {', '.join(HEAD_GAUGES)}")
    source = request.app[_source_key]
    targets: list[tuple[str, str | None]]
    if name == "*":
        try:
            targets = [(p, None) for p in await source.pipelines(namespace)]
        except Exception as exc:  # the API server did not answer the list: say so, as for a failed review
            log.warning("listing the DiffusionPipelines of %s failed: %s", namespace, exc)
            return status(503, "ServiceUnavailable", f"cannot list the DiffusionPipelines of {namespace}: {exc}")
    else:
        owner = await source.deployment_role(namespace, name)
        if owner is None:
            return status(404, "NotFound", f"deployments.apps/{name} is not a DiffusionPipeline role's Deployment")
        targets = [owner]
    items = []
    for pipeline, only_role in targets:
        found = await source.role_values(namespace, pipeline)
        if found is None:
            continue
        values, at = found
        for role, metrics in sorted(values.items()):
            if (only_role is None or role == only_role) and metric in metrics:
                deployment = role_deployment_name(pipeline, role)
                items.append(metric_value(version, namespace, deployment, metric, metrics[metric], at))
    if name != "*" and not items:
        return status(
            404, "NotFound", f"the server could not find the metric {metric} for deployments.apps {name} (no head data)"
        )
    body = {
        "kind": "MetricValueList",
        "apiVersion": f"{CUSTOM_METRICS_GROUP}/{version}",
        "metadata": {},
        "items": items,
    }
    return web.json_response(body)


async def _openapi(request: web.Request) -> web.Response:
    """An empty OpenAPI v2 document: the aggregator fetches one from every APIService (and retries
    forever on a 404); metric values have no schema worth publishing."""
    info = {"title": "triptych-metrics-api", "version": VERSIONS[0]}
    return web.json_response({"swagger": "2.0", "info": info, "paths": {}})


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def build_app(source: HeadMetricsSource, authorizer: Authorizer, auth_config: RequestHeaderConfig) -> web.Application:
    app = web.Application(middlewares=[authn_authz])
    app[_source_key] = source
    app[_authorizer_key] = authorizer
    app[_auth_config_key] = auth_config
    group = f"/apis/{CUSTOM_METRICS_GROUP}"
    app.router.add_get("/apis", _apis)
    app.router.add_get(group, _group)
    app.router.add_get(group + "/{version}", _resources)
    app.router.add_get(group + "/{version}/namespaces/{namespace}/{resource}/{name}/{metric}", _metric)
    app.router.add_get("/openapi/v2", _openapi)
    for path in HEALTH_PATHS:
        app.router.add_get(path, _health)
    return app
