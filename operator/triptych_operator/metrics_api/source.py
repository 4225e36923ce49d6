"""Where the numbers come from: each pipeline's head(s), scraped on demand and cached briefly.

A metric request names a Deployment `<pipeline>-<role>`: of the ways to split its name (`svc-prompt-encoder`
is svc's prompt encoder or svc-prompt's combined encoder), the pipeline that exists and runs that role
is the one meant. The pipeline's heads are found at the
endpoints of its `<pipeline>-head` Service (EndpointSlices), or at the URLs of the
`triptych.ai/head-metrics-url` annotation (at most MAX_HEAD_URLS). Values are summed over the heads.
When a head that serves cannot be scraped the metrics are absent (the HPA then holds its replica
count) and this is logged once until it recovers. The Service publishes heads that are not ready
too (a draining head still holds work that counts): their EndpointSlice entries say `ready` whatever
the pod's state, and `serving` is the pod's readiness. A head that is not serving (draining,
starting, crash-looping) counts when it answers and is skipped when it does not, so one head that
never started does not blind the HPA to the others.

Heads of a pipeline with `spec.head.tls` serve HTTPS and are scraped over it: with --head-ca-file
their certificate is verified against that CA and the name `<pipeline>-head.<namespace>.svc`
(they are reached by pod address); without it the scrape is encrypted but not verified.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import aiohttp

from triptych_operator.constants import (
    GROUP,
    HEAD_COMPONENT,
    HEAD_HTTP_PORT,
    HEAD_METRICS_URL_ANNOTATION,
    PIPELINE_ROLES,
    PLURAL,
    VERSION,
)
from triptych_operator.metrics_api.prometheus import RoleValues, add, parse_role_gauges
from triptych_operator.serve_args import object_name
from triptych_operator.spec.rules import pool_roles

log = logging.getLogger(__name__)

DEFAULT_CACHE_SECONDS = 5.0
DEFAULT_SCRAPE_TIMEOUT_S = 2.0
METRICS_PATH = "/metrics"
MAX_CACHED_PIPELINES = 1000


@dataclass(frozen=True)
class HeadEndpoint:
    """Where one head's /metrics page is; `required`: a head that serves (its page must be read for
    the pipeline's values), else one that may not answer (draining, starting): read if it does."""

    address: str
    required: bool = True


class PipelineReader(Protocol):
    """The API reads the metrics server needs (a fake in unit tests, kubernetes client in production)."""

    def get_pipeline(self, namespace: str, name: str) -> Mapping[str, Any] | None: ...

    def list_pipelines(self, namespace: str) -> list[Mapping[str, Any]]: ...

    def head_endpoints(self, namespace: str, service: str) -> list[HeadEndpoint]:
        """The endpoints of `service` (its EndpointSlices): each address and whether it serves."""
        ...


# GET a /metrics page: (url, the name a HTTPS head's certificate must carry or None for the URL's host).
Fetch = Callable[[str, str | None], Awaitable[str]]


def deployment_name_splits(name: str) -> list[tuple[str, str]]:
    """Every (pipeline, role) whose Deployment `name` may be, the role as the head's metrics label it:
    `flux-denoiser` -> [(`flux`, `denoiser`)]; `svc-prompt-encoder` -> [(`svc`, `prompt_encoder`),
    (`svc-prompt`, `encoder`)] (svc's split prompt encoder, or svc-prompt's combined encoder)."""
    splits = []
    for role in PIPELINE_ROLES:
        suffix = f"-{role.dns_name}"
        if name.endswith(suffix) and len(name) > len(suffix):
            splits.append((name.removesuffix(suffix), role.value))
    return splits


def role_deployment_name(pipeline: str, role: str) -> str:
    """The Deployment of a role the head's metrics label `prompt_encoder`: `<pipeline>-prompt-encoder`."""
    return object_name(pipeline, role.replace("_", "-"))


def _head_spec(pipeline: Mapping[str, Any]) -> Mapping[str, Any]:
    return (pipeline.get("spec") or {}).get("head") or {}


def head_metrics_urls(pipeline: Mapping[str, Any], reader: PipelineReader) -> list[HeadEndpoint]:
    """The /metrics URLs of a pipeline's heads (as HeadEndpoint addresses): the annotation's (each
    required), else its head Service's endpoints (https:// when the heads serve HTTPS, spec.head.tls)."""
    meta = pipeline["metadata"]
    override = (meta.get("annotations") or {}).get(HEAD_METRICS_URL_ANNOTATION)
    if override:
        urls = [url.strip() for url in override.split(",") if url.strip()]
        if len(urls) > MAX_HEAD_URLS:
            named = f"annotation {HEAD_METRICS_URL_ANNOTATION} names {len(urls)} URLs"
            raise ValueError(f"{named}; at most {MAX_HEAD_URLS} heads are read: name fewer")
        return [HeadEndpoint(url) for url in urls]
    head = _head_spec(pipeline)
    scheme = "https" if head.get("tls") else "http"
    service = object_name(meta["name"], HEAD_COMPONENT)
    port = head.get("port", HEAD_HTTP_PORT)
    return [
        HeadEndpoint(
            f"{scheme}://{f'[{h.address}]' if ':' in h.address else h.address}:{port}{METRICS_PATH}", h.required
        )
        for h in reader.head_endpoints(meta["namespace"], service)
    ]


def head_server_name(pipeline: Mapping[str, Any]) -> str | None:
    """The name a HTTPS head's certificate is checked against when it is reached by pod address: its
    internal Service's (`<pipeline>-head.<namespace>.svc`); None for the annotation's URLs (their host)."""
    meta = pipeline["metadata"]
    if (meta.get("annotations") or {}).get(HEAD_METRICS_URL_ANNOTATION) or not _head_spec(pipeline).get("tls"):
        return None
    return f"{object_name(meta['name'], HEAD_COMPONENT)}.{meta['namespace']}.svc"


@dataclass
class _Entry:
    values: RoleValues | None
    at: float
    timestamp: float
    roles: frozenset[str]  # the roles its spec runs pools for (labels: prompt_encoder); none when it is absent
    created: str  # its metadata.creationTimestamp: of two pipelines rendering one name, the older has it


class HeadMetricsSource:
    """Per-pipeline role values, scraped when asked and reused for `cache_seconds`."""

    def __init__(
        self,
        reader: PipelineReader,
        fetch: Fetch,
        *,
        cache_seconds: float = DEFAULT_CACHE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reader = reader
        self.fetch = fetch
        self.cache_seconds = cache_seconds
        self.clock = clock
        self._cache: dict[tuple[str, str], _Entry] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._failing: dict[tuple[str, str], str] = {}

    async def role_values(self, namespace: str, pipeline: str) -> tuple[RoleValues, float] | None:
        """(role -> metric -> value, unix time of the scrape), or None when the pipeline or its heads are not there."""
        entry = await self._entry(namespace, pipeline)
        return None if entry.values is None else (entry.values, entry.timestamp)

    async def deployment_role(self, namespace: str, name: str) -> tuple[str, str] | None:
        """The (pipeline, role label) whose Deployment `name` is: of its splits (deployment_name_splits), the
        one whose pipeline exists and runs that role. Should two (`svc`'s split prompt encoder and
        `svc-prompt`'s combined encoder) the older pipeline's: the operator refuses the name to the newer."""
        owners = []
        for pipeline, role in deployment_name_splits(name):
            entry = await self._entry(namespace, pipeline)
            if role in entry.roles:
                owners.append((entry.created, pipeline, role))
        return min(owners)[1:] if owners else None

    async def _entry(self, namespace: str, pipeline: str) -> _Entry:
        key = (namespace, pipeline)
        if len(self._cache) > MAX_CACHED_PIPELINES:
            self._forget_stale()
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # one scrape per pipeline at a time; the others reuse its result
            entry = self._cache.get(key)
            if entry is None or self.clock() - entry.at >= self.cache_seconds:
                values, roles, created = await self._scrape(namespace, pipeline)
                entry = _Entry(values, self.clock(), time.time(), roles, created)
                self._cache[key] = entry
        return entry

    def _forget_stale(self) -> None:
        """Drop expired entries (deleted pipelines, names nobody asks about any more)."""
        now = self.clock()
        for key in [k for k, e in self._cache.items() if now - e.at >= self.cache_seconds]:
            del self._cache[key]
            lock = self._locks.get(key)
            if lock is not None and not lock.locked():
                del self._locks[key]

    async def pipelines(self, namespace: str) -> list[str]:
        listing = await asyncio.to_thread(self.reader.list_pipelines, namespace)
        return [p["metadata"]["name"] for p in listing]

    async def _scrape(self, namespace: str, name: str) -> tuple[RoleValues | None, frozenset[str], str]:
        """(its heads' values summed or None, the roles its spec runs, its creationTimestamp)."""
        roles: frozenset[str] = frozenset()
        created = ""
        try:
            pipeline = await asyncio.to_thread(self.reader.get_pipeline, namespace, name)
            if pipeline is None:
                return None, roles, created  # not a pipeline's Deployment: nothing to report, nothing to log
            roles = frozenset(role.value for role in pool_roles(pipeline.get("spec") or {}))
            created = str(pipeline["metadata"].get("creationTimestamp") or "")
            heads = await asyncio.to_thread(head_metrics_urls, pipeline, self.reader)
            if not heads:
                raise LookupError(f"no head endpoint for {object_name(name, HEAD_COMPONENT)}")
            server_name = head_server_name(pipeline)
            read = await asyncio.gather(*(self._page(head, server_name) for head in heads))
            pages = [page for page in read if page is not None]
            if not pages:
                raise LookupError(f"no head of {object_name(name, HEAD_COMPONENT)} answered (none is serving)")
        except Exception as exc:  # any failure means "no metric": the HPA holds rather than acts on a guess
            self._report_failure((namespace, name), f"{type(exc).__name__}: {exc}")
            return None, roles, created
        if self._failing.pop((namespace, name), None) is not None:
            log.info("pipeline %s/%s: head metrics are back", namespace, name)
        total: RoleValues = {}
        for page in pages:
            add(total, parse_role_gauges(page))
        return total, roles, created

    async def _page(self, head: HeadEndpoint, server_name: str | None) -> str | None:
        """A head's page; None for one that is not serving and did not answer (a required one raises)."""
        try:
            return await self.fetch(head.address, server_name)
        except Exception as exc:
            if head.required:
                raise
            log.debug("%s is not serving and did not answer (%s): skipped", head.address, exc)
            return None

    def _report_failure(self, key: tuple[str, str], reason: str) -> None:
        """Log once per failure streak, not on every request of every HPA."""
        if key not in self._failing:
            log.warning(
                "pipeline %s/%s: cannot read its head's metrics (%s); its metrics are absent until it can",
                *key,
                reason,
            )
        self._failing[key] = reason


MAX_PAGE_BYTES = 16 << 20  # a head's /metrics page is tens of KB with hundreds of workers
# What a page may hold: only its per-role gauges are kept as it is read (this process's memory is
# every HPA's: a page of short lines would be hundreds of MiB as strings), each line at most
# MAX_LINE_BYTES, and at most MAX_KEPT_BYTES of them (a head has a few lines per role).
ROLE_LINE_PREFIX = b"triptych_role_"
MAX_LINE_BYTES = 4096
MAX_KEPT_BYTES = 256 << 10
MAX_HEAD_URLS = 64  # URLs the annotation may name: the heads of one pipeline, each read at once


def heads_tls(ca_file: str | None) -> ssl.SSLContext | None:
    """How HTTPS heads are checked: against the CA in `ca_file` (PEM); None: not at all (encrypted only)."""
    return None if ca_file is None else ssl.create_default_context(cafile=ca_file)


def http_fetcher(
    session: aiohttp.ClientSession, timeout_s: float = DEFAULT_SCRAPE_TIMEOUT_S, tls: ssl.SSLContext | None = None
) -> Fetch:
    """GET a /metrics page; a non-2xx answer, a timeout or (with `tls`) a certificate that its CA did
    not sign for the server name raises."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def fetch(url: str, server_name: str | None) -> str:
        if not url.startswith("https:"):
            checks: dict[str, Any] = {}
        elif tls is None:
            checks = {"ssl": False}
        else:
            checks = {"ssl": tls, "server_hostname": server_name}
        # A head answers its own page: a redirect is not followed (a URL an annotation gives could lead
        # anywhere), and the page is read up to MAX_PAGE_BYTES (this process's memory is every HPA's).
        async with session.get(url, timeout=timeout, allow_redirects=False, **checks) as resp:
            if resp.status != 200:
                raise ValueError(f"{url} answered {resp.status}, not the metrics page")
            lines = RoleLines(url)
            async for chunk in resp.content.iter_chunked(1 << 16):
                lines.feed(chunk)
            return lines.text()

    return fetch


class RoleLines:
    """The per-role gauge lines of a /metrics page, kept as it arrives (everything else is dropped
    chunk by chunk, the lines found by a regular expression in C): the page's bytes, each kept line
    and all kept lines are bounded (ValueError past one)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.read = 0
        self.kept = bytearray()
        self._carry = b""  # the start of a line the next chunk ends
        self._skipping = False  # the line being read is too long to carry and not one to keep

    def feed(self, chunk: bytes) -> None:
        self.read += len(chunk)
        if self.read > MAX_PAGE_BYTES:
            raise ValueError(f"{self.url}: a metrics page over {MAX_PAGE_BYTES} bytes")
        if self._skipping:
            end = chunk.find(b"\n")
            if end < 0:
                return
            chunk, self._skipping = chunk[end + 1 :], False
        data = self._carry + chunk
        last = data.rfind(b"\n")
        self._keep(data[: last + 1])
        self._carry = data[last + 1 :]
        if len(self._carry) > MAX_LINE_BYTES:
            self._too_long(self._carry)
            self._carry, self._skipping = b"", True

    def text(self) -> str:
        self._keep(self._carry + b"\n")  # the last line, without its newline
        self._carry = b""
        return self.kept.decode("utf-8", errors="replace")

    def _keep(self, lines: bytes) -> None:
        for line in _ROLE_LINE.findall(lines):
            self._too_long(line)
            self.kept += line + b"\n"
        if len(self.kept) > MAX_KEPT_BYTES:
            raise ValueError(f"{self.url}: over {MAX_KEPT_BYTES} bytes of triptych_role_ lines")

    def _too_long(self, line: bytes) -> None:
        if len(line) > MAX_LINE_BYTES and line.startswith(ROLE_LINE_PREFIX):
            raise ValueError(f"{self.url}: a triptych_role_ line over {MAX_LINE_BYTES} bytes")


_ROLE_LINE = re.compile(rb"^" + re.escape(ROLE_LINE_PREFIX) + rb"[^\n]*", re.MULTILINE)


class KubePipelineReader:
    """PipelineReader over the kubernetes client (DiffusionPipelines and EndpointSlices, read only)."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self._client = client
        self.custom = client.CustomObjectsApi(api_client)
        self.discovery = client.DiscoveryV1Api(api_client)

    def get_pipeline(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        try:
            found: Any = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            return cast(Mapping[str, Any], found)
        except self._client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list_pipelines(self, namespace: str) -> list[Mapping[str, Any]]:
        listing: Any = self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        return list(listing.get("items") or [])

    def head_endpoints(self, namespace: str, service: str) -> list[HeadEndpoint]:
        slices = self.discovery.list_namespaced_endpoint_slice(
            namespace, label_selector=f"kubernetes.io/service-name={service}"
        )
        return head_endpoints(slice_.to_dict() for slice_ in slices.items)


def head_endpoints(slices: Any) -> list[HeadEndpoint]:
    """The endpoints across EndpointSlices (dicts in the client's snake_case), deduplicated: each
    required when it serves. `serving` is the pod's readiness even where the Service publishes pods
    that are not ready (whose `ready` then says true); without it, `ready`; unknown counts as serving,
    as the API documents. A terminating head is not required (it is draining)."""
    seen: dict[str, bool] = {}
    for slice_ in slices:
        for endpoint in slice_.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            serving = conditions.get("serving")
            if serving is None:
                serving = conditions.get("ready")
            required = serving is not False and conditions.get("terminating") is not True
            for address in endpoint.get("addresses") or []:
                seen[address] = seen.get(address, False) or required
    return [HeadEndpoint(address, required) for address, required in seen.items()]
