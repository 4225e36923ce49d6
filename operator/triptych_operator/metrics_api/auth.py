"""Who is asking, and may they: the extension API server convention.

The kube-apiserver's aggregator proxies a request here over TLS with its front-proxy client
certificate and names the real user in headers (`X-Remote-User`, `X-Remote-Group`,
`X-Remote-Extra-*`). Those headers are trusted only when that certificate chains to the
requestheader CA the cluster publishes in kube-system/extension-apiserver-authentication (the
TLS layer checks the chain) and its common name is an allowed one. The user is then authorized
with a SubjectAccessReview, as the kube-apiserver would, and the decision is cached briefly.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

AUTH_CONFIGMAP_NAMESPACE = "kube-system"
AUTH_CONFIGMAP = "extension-apiserver-authentication"
DECISION_CACHE_S = 10.0
AUTHENTICATED_GROUP = "system:authenticated"


class AuthConfigError(RuntimeError):
    """The cluster does not publish what a front proxy needs (no aggregation layer configured)."""


@dataclass(frozen=True)
class RequestHeaderConfig:
    client_ca_pem: str
    allowed_names: tuple[str, ...]
    username_headers: tuple[str, ...]
    group_headers: tuple[str, ...]
    extra_prefixes: tuple[str, ...]

    @classmethod
    def from_configmap(cls, data: Mapping[str, str]) -> RequestHeaderConfig:
        ca = data.get("requestheader-client-ca-file")
        if not ca:
            raise AuthConfigError(
                f"{AUTH_CONFIGMAP_NAMESPACE}/{AUTH_CONFIGMAP} has no requestheader-client-ca-file: the "
                "kube-apiserver needs --requestheader-client-ca-file (the aggregation layer) for aggregated APIs"
            )

        def names(key: str) -> tuple[str, ...]:
            return tuple(json.loads(data.get(key) or "[]"))

        return cls(
            client_ca_pem=ca,
            allowed_names=names("requestheader-allowed-names"),
            username_headers=names("requestheader-username-headers") or ("X-Remote-User",),
            group_headers=names("requestheader-group-headers") or ("X-Remote-Group",),
            extra_prefixes=names("requestheader-extra-headers-prefix") or ("X-Remote-Extra-",),
        )


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def _common_name(peercert: Mapping[str, Any]) -> str | None:
    for rdn in peercert.get("subject") or ():
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def authenticate(peercert: Mapping[str, Any] | None, headers: Any, config: RequestHeaderConfig) -> User | None:
    """The user the front proxy names, or None when the request did not come through it.

    `peercert` is the client certificate as `ssl` returns it after verifying its chain against
    the requestheader CA (empty or None when the client sent none). `headers` is a multidict.
    """
    if not peercert:
        return None
    if config.allowed_names and _common_name(peercert) not in config.allowed_names:
        return None
    name = next((headers[h] for h in config.username_headers if headers.get(h)), None)
    if not name:
        return None
    groups = tuple(g for h in config.group_headers for g in headers.getall(h, ()))
    if AUTHENTICATED_GROUP not in groups:  # as every API server adds it (discovery is granted to it)
        groups += (AUTHENTICATED_GROUP,)
    extra: dict[str, tuple[str, ...]] = {}
    for key in headers:
        for prefix in config.extra_prefixes:
            if key.lower().startswith(prefix.lower()):
                extra_key = urllib.parse.unquote(key[len(prefix) :]).lower()  # keys are percent-encoded
                extra[extra_key] = tuple(headers.getall(key))
    return User(name=name, groups=groups, extra=extra)


def resource_attributes(
    group: str, version: str, namespace: str, resource: str, name: str, metric: str
) -> dict[str, str]:
    """What the kube-apiserver would authorize for this path: the metric is the subresource, `*` a list."""
    attrs = {"verb": "get" if name != "*" else "list", "group": group, "version": version, "resource": resource}
    if name != "*":
        attrs["name"] = name
    if namespace:
        attrs["namespace"] = namespace
    attrs["subresource"] = metric
    return attrs


class Authorizer:
    """SubjectAccessReview, cached for `ttl` seconds per (user, attributes)."""

    def __init__(
        self,
        review: Callable[[dict[str, Any]], bool],
        *,
        ttl: float = DECISION_CACHE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.review = review
        self.ttl = ttl
        self.clock = clock
        self._cache: dict[tuple[Any, ...], tuple[bool, float]] = {}

    async def allowed(self, user: User, *, resource: Mapping[str, str] | None = None, path: str | None = None) -> bool:
        attrs = tuple(sorted((resource or {}).items())) if resource else (("path", path or ""),)
        key = (user.name, user.groups, tuple(sorted(user.extra.items())), attrs)
        hit = self._cache.get(key)
        now = self.clock()
        if hit and now - hit[1] < self.ttl:
            return hit[0]
        spec: dict[str, Any] = {"user": user.name, "groups": list(user.groups)}
        if user.extra:
            spec["extra"] = {k: list(v) for k, v in user.extra.items()}
        if resource:
            spec["resourceAttributes"] = dict(resource)
        else:
            spec["nonResourceAttributes"] = {"path": path, "verb": "get"}
        allowed = await asyncio.to_thread(self.review, spec)
        if len(self._cache) > 10_000:  # bounded: users x objects is small, but never let it grow unchecked
            self._cache.clear()
        self._cache[key] = (allowed, now)
        return allowed


def kube_review(api_client: Any) -> Callable[[dict[str, Any]], bool]:
    """A SubjectAccessReview call through the kubernetes client."""
    from kubernetes import client

    api = client.AuthorizationV1Api(api_client)

    def review(spec: dict[str, Any]) -> bool:
        body: Any = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
        result = api.create_subject_access_review(body)
        return bool(result.status and result.status.allowed)

    return review


def read_request_header_config(api_client: Any) -> RequestHeaderConfig:
    from kubernetes import client

    try:
        cm = client.CoreV1Api(api_client).read_namespaced_config_map(AUTH_CONFIGMAP, AUTH_CONFIGMAP_NAMESPACE)
    except client.ApiException as exc:
        raise AuthConfigError(
            f"cannot read {AUTH_CONFIGMAP_NAMESPACE}/{AUTH_CONFIGMAP} ({exc.status} {exc.reason}): bind the "
            "service account to the Role extension-apiserver-authentication-reader in kube-system"
        ) from None
    return RequestHeaderConfig.from_configmap(cm.data or {})
