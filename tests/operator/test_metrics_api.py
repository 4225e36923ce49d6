"""The custom metrics API server without a cluster: real HTTPS, real client certificates, real
head-like /metrics pages over HTTP; the Kubernetes reads and the SubjectAccessReview are fakes."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.certs import der
from tests.operator.tls import make_ca, make_cert
from triptych_operator.constants import HEAD_METRICS_URL_ANNOTATION
from triptych_operator.metrics_api.auth import Authorizer, RequestHeaderConfig
from triptych_operator.metrics_api.main import server_tls
from triptych_operator.metrics_api.prometheus import add, parse_role_gauges
from triptych_operator.metrics_api.server import build_app, quantity
from triptych_operator.metrics_api.source import (
    MAX_HEAD_URLS,
    MAX_KEPT_BYTES,
    MAX_LINE_BYTES,
    HeadEndpoint,
    HeadMetricsSource,
    RoleLines,
    deployment_name_splits,
    head_endpoints,
    heads_tls,
    http_fetcher,
)

HEAD_PAGE = """\
# HELP triptych_role_pending_work_seconds Estimated device-seconds of queued and running work
# TYPE triptych_role_pending_work_seconds gauge
triptych_role_pending_work_seconds{role="encoder"} 0.25
triptych_role_pending_work_seconds{role="denoiser"} 42.5
triptych_role_pending_work_seconds{role="decoder"} NaN
triptych_role_queued_requests{role="denoiser"} 7.0
triptych_role_running_requests{role="denoiser"} 2.0
triptych_role_ready_instances{role="denoiser"} 1.0
triptych_queue_depth{role="denoiser"} 7.0
triptych_role_something_else{role="denoiser"} 9.0
"""


def test_reads_the_role_gauges_and_nothing_else() -> None:
    values = parse_role_gauges(HEAD_PAGE)
    assert values == {
        "encoder": {"triptych_pending_work_seconds": 0.25},
        "denoiser": {
            "triptych_pending_work_seconds": 42.5,
            "triptych_queued_requests": 7.0,
            "triptych_running_requests": 2.0,
            "triptych_ready_instances": 1.0,
        },
    }


def test_several_heads_sum_their_own_requests_but_not_the_workers_they_all_see() -> None:
    one = parse_role_gauges(HEAD_PAGE)
    other = parse_role_gauges(
        'triptych_role_queued_requests{role="denoiser"} 3.0\ntriptych_role_ready_instances{role="denoiser"} 2.0\n'
    )
    total = add(add({}, one), other)
    assert total["denoiser"]["triptych_queued_requests"] == 10.0  # each request is one head's
    assert total["denoiser"]["triptych_ready_instances"] == 2.0  # every worker serves every head


def test_quantities_are_kubernetes_quantities() -> None:
    assert [quantity(v) for v in (0, 3, 42.5, 0.0004, 1234.5678)] == ["0", "3", "42500m", "0", "1234568m"]


def test_deployment_names_split_every_way_a_pipeline_and_role_render_them() -> None:
    assert deployment_name_splits("flux-denoiser") == [("flux", "denoiser")]
    assert deployment_name_splits("my-flux-encoder") == [("my-flux", "encoder")]
    assert sorted(deployment_name_splits("svc-prompt-encoder")) == [
        ("svc", "prompt_encoder"),
        ("svc-prompt", "encoder"),
    ]
    assert deployment_name_splits("flux-head") == []
    assert deployment_name_splits("-decoder") == []


def test_heads_that_serve_are_required_and_the_others_read_if_they_answer() -> None:
    """The head Service publishes heads that are not ready (a draining head's work counts), so their
    `ready` says true whatever the pod's state: `serving` is the pod's readiness."""
    slices = [
        {"endpoints": [{"addresses": ["198.19.0.5"], "conditions": {"ready": True, "serving": True}}]},
        {
            "endpoints": [
                {"addresses": ["198.19.0.6"], "conditions": {"ready": True, "serving": False}},  # starting, draining
                {"addresses": ["198.19.0.7"]},  # unknown: serving, as the API documents
                {"addresses": ["198.19.0.8"], "conditions": {"ready": False}},  # no serving condition: ready's
                {"addresses": ["198.19.0.9"], "conditions": {"ready": False, "serving": True, "terminating": True}},
            ]
        },
        {"endpoints": None},
        {"endpoints": [{"addresses": ["198.19.0.6"], "conditions": {"serving": True}}]},  # in two slices: serving
    ]
    assert head_endpoints(slices) == [
        HeadEndpoint("198.19.0.5", True),
        HeadEndpoint("198.19.0.6", True),
        HeadEndpoint("198.19.0.7", True),
        HeadEndpoint("198.19.0.8", False),
        HeadEndpoint("198.19.0.9", False),
    ]


class FakeReader:
    def __init__(
        self, pipelines: dict[str, dict[str, Any]], endpoints: dict[str, list[str | HeadEndpoint]] | None = None
    ) -> None:
        self.pipelines = pipelines
        self.endpoints = endpoints or {}
        self.gets = 0

    def get_pipeline(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        self.gets += 1
        return self.pipelines.get(name)

    def list_pipelines(self, namespace: str) -> list[Mapping[str, Any]]:
        if "unlistable" in self.pipelines:
            raise ConnectionError("the API server did not answer")
        return list(self.pipelines.values())

    def head_endpoints(self, namespace: str, service: str) -> list[HeadEndpoint]:
        """`endpoints`' addresses: a plain one serves."""
        return [e if isinstance(e, HeadEndpoint) else HeadEndpoint(e) for e in self.endpoints.get(service, [])]


def pipeline(
    name: str,
    url: str | None = None,
    port: int | None = None,
    tls: bool = False,
    *,
    pools: tuple[str, ...] = (),
    created: str = "2025-01-01T00:00:00Z",
) -> dict[str, Any]:
    """A stored DiffusionPipeline; `pools`: the role fields its spec declares (promptEncoder, ...)."""
    meta: dict[str, Any] = {"name": name, "namespace": "ml", "creationTimestamp": created}
    if url:
        meta["annotations"] = {HEAD_METRICS_URL_ANNOTATION: url}
    spec: dict[str, Any] = {"head": {"port": port}} if port else {}
    spec.update({field: {"replicas": 1} for field in pools})
    if tls:
        spec["head"]["tls"] = {"secretName": f"{name}-head-tls"}
    return {"metadata": meta, "spec": spec}


class Heads:
    """Real HTTP servers on loopback serving a settable /metrics page."""

    def __init__(self) -> None:
        self.pages: dict[int, str] = {}
        self.hits = 0
        self.servers: list[http.server.ThreadingHTTPServer] = []

    def start(self, page: str, tls: ssl.SSLContext | None = None) -> int:
        """A head serving `page` at /metrics, over HTTPS with `tls`; its port."""
        heads = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                heads.hits += 1
                body = heads.pages[self.server.server_address[1]].encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            server.socket = tls.wrap_socket(server.socket, server_side=True)
        port = server.server_address[1]
        self.pages[port] = page
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers.append(server)
        return port

    def stop(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def heads() -> Iterator[Heads]:
    h = Heads()
    yield h
    h.stop()


async def _values(source: HeadMetricsSource, name: str) -> Any:
    found = await source.role_values("ml", name)
    return None if found is None else found[0]


def test_a_pipelines_heads_are_scraped_summed_and_cached(heads: Heads) -> None:
    a = heads.start(HEAD_PAGE)
    b = heads.start('triptych_role_pending_work_seconds{role="denoiser"} 7.5\n')
    reader = FakeReader({"flux": pipeline("flux", port=a)}, {"flux-head": ["127.0.0.1"]})
    reader.pipelines["two"] = pipeline("two", url=f"http://127.0.0.1:{a}/metrics, http://127.0.0.1:{b}/metrics")
    now = [0.0]

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            source = HeadMetricsSource(reader, http_fetcher(session), cache_seconds=5, clock=lambda: now[0])
            flux = await _values(source, "flux")  # found through the head Service's endpoints
            assert flux["denoiser"]["triptych_pending_work_seconds"] == 42.5
            two = await _values(source, "two")  # two heads by annotation: summed
            assert two["denoiser"]["triptych_pending_work_seconds"] == 50.0
            assert two["denoiser"]["triptych_queued_requests"] == 7.0
            hits = heads.hits
            await _values(source, "flux")
            assert heads.hits == hits  # cached
            now[0] = 6.0
            await _values(source, "flux")
            assert heads.hits == hits + 1

    asyncio.run(run())


def test_an_unreachable_head_makes_the_metric_absent_and_is_logged_once(
    heads: Heads, caplog: pytest.LogCaptureFixture
) -> None:
    port = heads.start(HEAD_PAGE)
    heads.stop()  # nothing listens there any more
    reader = FakeReader({"flux": pipeline("flux", url=f"http://127.0.0.1:{port}/metrics")})
    now = [0.0]

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            source = HeadMetricsSource(reader, http_fetcher(session, 1.0), cache_seconds=1, clock=lambda: now[0])
            for i in range(3):
                now[0] = 2.0 * i
                assert await source.role_values("ml", "flux") is None
            assert await source.role_values("ml", "gone") is None  # not a pipeline: absent, not logged

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    warnings = [r for r in caplog.records if "cannot read its head's metrics" in r.getMessage()]
    assert len(warnings) == 1 and "ml/flux" in warnings[0].getMessage()


def test_heads_serving_https_are_scraped_over_it_and_checked_against_the_ca_and_their_service_name(
    heads: Heads, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca = make_ca(tmp_path, "heads-ca")
    tls = {}
    for name, san in (("flux", "DNS:flux-head.ml.svc"), ("other", "DNS:other-head.elsewhere.svc")):
        cert, key = make_cert(tmp_path, name, ca, cn=name, san=san, usage="serverAuth")
        tls[name] = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls[name].load_cert_chain(cert, key)
    good, wrong_name = heads.start(HEAD_PAGE, tls["flux"]), heads.start(HEAD_PAGE, tls["other"])
    reader = FakeReader(
        {"flux": pipeline("flux", port=good, tls=True), "impostor": pipeline("impostor", port=wrong_name, tls=True),
         "plain": pipeline("plain", port=good)},
        {"flux-head": ["127.0.0.1"], "impostor-head": ["127.0.0.1"], "plain-head": ["127.0.0.1"]},
    )  # fmt: skip

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            verified = HeadMetricsSource(reader, http_fetcher(session, 5.0, heads_tls(str(ca[0]))))
            flux = await _values(verified, "flux")
            assert flux["denoiser"]["triptych_pending_work_seconds"] == 42.5
            assert await _values(verified, "impostor") is None, "a certificate for another name is refused"
            assert await _values(verified, "plain") is None, "plain HTTP to a HTTPS head gets nothing"
            unverified = HeadMetricsSource(reader, http_fetcher(session, 5.0))
            assert (await _values(unverified, "impostor"))["denoiser"]["triptych_pending_work_seconds"] == 42.5

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    refused = [r.getMessage() for r in caplog.records if "ml/impostor" in r.getMessage()]
    assert len(refused) == 1 and "certificate" in refused[0].lower(), refused


def test_a_head_that_is_not_serving_counts_when_it_answers_and_is_skipped_when_it_does_not(heads: Heads) -> None:
    """One head serves; another (127.0.0.2, same port) is published but not serving: nothing listens
    there (a head that never started), then it answers (a draining head, whose work counts). A head
    that serves and does not answer still makes the metric absent."""
    port = heads.start(HEAD_PAGE)
    published = ["127.0.0.1", HeadEndpoint("127.0.0.2", required=False)]
    reader = FakeReader({"flux": pipeline("flux", port=port)}, {"flux-head": published})
    reader.pipelines["down"] = pipeline("down", port=port)
    reader.endpoints["down-head"] = [HeadEndpoint("127.0.0.2", required=True)]
    reader.pipelines["starting"] = pipeline("starting", port=port)
    reader.endpoints["starting-head"] = [HeadEndpoint("127.0.0.2", required=False)]

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            source = HeadMetricsSource(reader, http_fetcher(session, 2.0), cache_seconds=0)
            flux = await _values(source, "flux")
            assert flux is not None and flux["denoiser"]["triptych_pending_work_seconds"] == 42.5
            assert await _values(source, "down") is None  # a serving head that does not answer: absent
            assert await _values(source, "starting") is None  # no head answered at all: absent, not zero
            draining = http.server.ThreadingHTTPServer(("127.0.0.2", port), _page_handler(HEAD_PAGE))
            threading.Thread(target=draining.serve_forever, daemon=True).start()
            try:
                both = await _values(source, "flux")
                assert both["denoiser"]["triptych_pending_work_seconds"] == 85.0  # the draining head's work too
            finally:
                draining.shutdown()
                draining.server_close()

    asyncio.run(run())


def _page_handler(page: str) -> type[http.server.BaseHTTPRequestHandler]:
    """A head answering `page`, encoded once (what it costs is not the reader's)."""
    body = page.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def test_only_a_page_s_role_lines_are_kept_as_it_is_read() -> None:
    """A page of 15 MiB of short lines (under the page cap) costs the process little: only its
    triptych_role_ lines are kept as the chunks arrive, whatever the chunking."""
    import tracemalloc

    filler = "ab\n" * (5 << 19)  # 7.5 MiB each side
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _page_handler(filler + HEAD_PAGE + filler))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    reader = FakeReader({"flux": pipeline("flux", url=f"http://127.0.0.1:{port}/metrics")})

    async def run() -> Any:
        async with aiohttp.ClientSession() as session:
            return await _values(HeadMetricsSource(reader, http_fetcher(session, 30.0)), "flux")

    tracemalloc.start()
    try:
        values = asyncio.run(run())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        server.shutdown()
        server.server_close()
    assert values["denoiser"]["triptych_pending_work_seconds"] == 42.5
    assert peak < 8 << 20, f"reading the page peaked at {peak >> 20} MiB"

    role = b'triptych_role_queued_requests{role="denoiser"} 3\n'
    for size in (1, 2, 7, 64):
        lines = RoleLines("u")
        page = b"x" * 9000 + b"\n# HELP\n" + role + b"triptych_rolex 1\n" + role[:-1]  # the last without \n
        for i in range(0, len(page), size):
            lines.feed(page[i : i + size])
        assert lines.text() == (role + role).decode(), size  # not the long line, the comment, triptych_rolex


def test_a_page_whose_role_lines_are_too_long_or_too_many_is_refused() -> None:
    long_line = RoleLines("http://h/metrics")
    with pytest.raises(ValueError, match=f"line over {MAX_LINE_BYTES} bytes"):
        long_line.feed(b"triptych_role_x{" + b"a" * MAX_LINE_BYTES + b"}\n")
    many = RoleLines("http://h/metrics")
    with pytest.raises(ValueError, match=f"over {MAX_KEPT_BYTES} bytes of triptych_role_ lines"):
        for _ in range(MAX_KEPT_BYTES // 20 + 1):
            many.feed(b"triptych_role_x 1.0\n")


def test_an_annotation_naming_too_many_heads_is_refused_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    urls = ", ".join(f"http://127.0.0.1:{1000 + i}/metrics" for i in range(MAX_HEAD_URLS + 1))
    reader = FakeReader({"flux": pipeline("flux", url=urls)})

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            assert await HeadMetricsSource(reader, http_fetcher(session)).role_values("ml", "flux") is None

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"names {MAX_HEAD_URLS + 1} URLs; at most {MAX_HEAD_URLS}" in said, said


def test_a_pipeline_without_a_ready_head_has_no_metrics() -> None:
    reader = FakeReader({"flux": pipeline("flux")}, {})

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            assert await HeadMetricsSource(reader, http_fetcher(session)).role_values("ml", "flux") is None

    asyncio.run(run())


# ---------------------------------------------------------------- the HTTPS API itself

PROXY_NAME = "front-proxy-client"
HPA_USER = "system:serviceaccount:kube-system:horizontal-pod-autoscaler"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    server_ca = make_ca(d, "serving-ca")
    proxy_ca = make_ca(d, "front-proxy-ca")
    other_ca = make_ca(d, "other-ca")
    serving = make_cert(d, "serving", server_ca, cn="metrics", san="DNS:localhost,IP:127.0.0.1", usage="serverAuth")
    proxy = make_cert(d, "proxy", proxy_ca, cn=PROXY_NAME, san=None, usage="clientAuth")
    wrong_name = make_cert(d, "wrong-name", proxy_ca, cn="someone-else", san=None, usage="clientAuth")
    forged = make_cert(d, "forged", other_ca, cn=PROXY_NAME, san=None, usage="clientAuth")
    return {
        "server_ca": server_ca[0],
        "proxy_ca": proxy_ca[0],
        "serving_crt": serving[0],
        "serving_key": serving[1],
        **{f"{n}_crt": c for n, (c, _) in (("proxy", proxy), ("wrong", wrong_name), ("forged", forged))},
        **{f"{n}_key": k for n, (_, k) in (("proxy", proxy), ("wrong", wrong_name), ("forged", forged))},
    }


def header_config(pki: dict[str, Path]) -> RequestHeaderConfig:
    """What extension-apiserver-authentication would say: the front proxy's CA and name."""
    return RequestHeaderConfig(
        client_ca_pem=pki["proxy_ca"].read_text(),
        allowed_names=(PROXY_NAME,),
        username_headers=("X-Remote-User",),
        group_headers=("X-Remote-Group",),
        extra_prefixes=("X-Remote-Extra-",),
    )


class Api:
    """The app on loopback HTTPS, with a recorded, scriptable SubjectAccessReview."""

    def __init__(self, pki: dict[str, Path], reader: FakeReader) -> None:
        self.pki = pki
        self.reader = reader
        self.reviews: list[dict[str, Any]] = []
        self.deny_users: set[str] = set()

    def review(self, spec: dict[str, Any]) -> bool:
        self.reviews.append(spec)
        if spec["user"] == "unreviewable":
            raise ConnectionError("the API server did not answer")
        return spec["user"] not in self.deny_users

    async def get(self, path: str, *, cert: str | None = "proxy", user: str = HPA_USER) -> tuple[int, Any]:
        config = header_config(self.pki)
        tls, _reloader = server_tls(str(self.pki["serving_crt"]), str(self.pki["serving_key"]), config.client_ca_pem)
        client = ssl.create_default_context(cafile=str(self.pki["server_ca"]))
        if cert:
            client.load_cert_chain(str(self.pki[f"{cert}_crt"]), str(self.pki[f"{cert}_key"]))
        async with aiohttp.ClientSession() as session:
            source = HeadMetricsSource(self.reader, http_fetcher(session))
            runner = web.AppRunner(build_app(source, Authorizer(self.review), config))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
            await site.start()
            port = runner.addresses[0][1]
            headers = {"X-Remote-User": user, "X-Remote-Group": "system:serviceaccounts"}
            try:
                async with session.get(f"https://localhost:{port}{path}", ssl=client, headers=headers) as resp:
                    text = await resp.text()
                    return resp.status, json.loads(text) if text.startswith("{") else text
            finally:
                await runner.cleanup()


GROUP_PATH = "/apis/custom.metrics.k8s.io"
METRIC_PATH = GROUP_PATH + "/v1beta2/namespaces/ml/deployments.apps/flux-denoiser/triptych_pending_work_seconds"


@pytest.fixture
def api(pki: dict[str, Path], heads: Heads) -> Api:
    port = heads.start(HEAD_PAGE)
    return Api(pki, FakeReader({"flux": pipeline("flux", url=f"http://127.0.0.1:{port}/metrics")}))


def test_the_hpa_gets_the_denoisers_pending_work_as_an_object_metric(api: Api) -> None:
    code, body = asyncio.run(api.get(METRIC_PATH + "?metricLabelSelector=x%3Dy"))
    assert code == 200, body
    assert body["kind"] == "MetricValueList" and body["apiVersion"] == "custom.metrics.k8s.io/v1beta2"
    [item] = body["items"]
    assert item["describedObject"] == {
        "kind": "Deployment",
        "namespace": "ml",
        "name": "flux-denoiser",
        "apiVersion": "apps/v1",
    }
    assert item["metric"] == {"name": "triptych_pending_work_seconds"}
    assert item["value"] == "42500m"
    [review] = api.reviews
    assert review["user"] == HPA_USER and review["groups"] == ["system:serviceaccounts", "system:authenticated"]
    assert review["resourceAttributes"] == {
        "verb": "get",
        "group": "custom.metrics.k8s.io",
        "version": "v1beta2",
        "resource": "deployments.apps",
        "namespace": "ml",
        "name": "flux-denoiser",
        "subresource": "triptych_pending_work_seconds",
    }


def test_v1beta1_and_a_list_over_all_deployments(api: Api) -> None:
    path = GROUP_PATH + "/v1beta1/namespaces/ml/deployments.apps/*/triptych_queued_requests"
    code, body = asyncio.run(api.get(path))
    assert code == 200, body
    assert [(i["describedObject"]["name"], i["metricName"], i["value"]) for i in body["items"]] == [
        ("flux-denoiser", "triptych_queued_requests", "7")
    ]
    assert api.reviews[0]["resourceAttributes"]["verb"] == "list"


SPLIT_HEAD_PAGE = """\
triptych_role_pending_work_seconds{role="prompt_encoder"} 3.0
triptych_role_pending_work_seconds{role="image_encoder"} 1.5
triptych_role_pending_work_seconds{role="denoiser"} 40.0
"""
COMBINED_HEAD_PAGE = """\
triptych_role_pending_work_seconds{role="encoder"} 2.0
triptych_role_pending_work_seconds{role="denoiser"} 20.0
"""


def _pending_work(api: Api, deployment: str) -> tuple[int, Any]:
    path = GROUP_PATH + f"/v1beta2/namespaces/ml/deployments.apps/{deployment}/triptych_pending_work_seconds"
    return asyncio.run(api.get(path))


def test_a_combined_encoder_of_a_pipeline_named_like_a_split_encoder_is_found(
    pki: dict[str, Path], heads: Heads
) -> None:
    """`svc-prompt-encoder` is svc-prompt's combined encoder when no pipeline svc runs a prompt encoder."""
    url = f"http://127.0.0.1:{heads.start(COMBINED_HEAD_PAGE)}/metrics"
    api = Api(pki, FakeReader({"svc-prompt": pipeline("svc-prompt", url=url)}))
    code, body = _pending_work(api, "svc-prompt-encoder")
    assert code == 200, body
    [item] = body["items"]
    assert (item["describedObject"]["name"], item["value"]) == ("svc-prompt-encoder", "2")


def test_of_two_pipelines_rendering_one_deployment_name_the_one_running_that_role_and_older_has_it(
    pki: dict[str, Path], heads: Heads
) -> None:
    split = f"http://127.0.0.1:{heads.start(SPLIT_HEAD_PAGE)}/metrics"
    combined = f"http://127.0.0.1:{heads.start(COMBINED_HEAD_PAGE)}/metrics"
    svc = pipeline("svc", url=split, pools=("promptEncoder", "imageEncoder"), created="2025-01-01T00:00:00Z")
    # A pipeline svc without split encoders does not run svc-prompt-encoder: svc-prompt's encoder is meant.
    plain_svc = pipeline("svc", url=split, created="2025-01-01T00:00:00Z")
    svc_prompt = pipeline("svc-prompt", url=combined, created="2025-01-02T00:00:00Z")
    api = Api(pki, FakeReader({"svc": plain_svc, "svc-prompt": svc_prompt}))
    code, body = _pending_work(api, "svc-prompt-encoder")
    assert code == 200 and body["items"][0]["value"] == "2", body
    # Both run it: the operator gave the name to the older pipeline (the newer one is Degraded).
    api = Api(pki, FakeReader({"svc": svc, "svc-prompt": svc_prompt}))
    code, body = _pending_work(api, "svc-prompt-encoder")
    assert code == 200 and body["items"][0]["value"] == "3", body
    older_combined = pipeline("svc-prompt", url=combined, created="2024-12-31T00:00:00Z")
    api = Api(pki, FakeReader({"svc": svc, "svc-prompt": older_combined}))
    code, body = _pending_work(api, "svc-prompt-encoder")
    assert code == 200 and body["items"][0]["value"] == "2", body


def test_a_list_names_split_encoders_by_their_deployments(pki: dict[str, Path], heads: Heads) -> None:
    url = f"http://127.0.0.1:{heads.start(SPLIT_HEAD_PAGE)}/metrics"
    api = Api(pki, FakeReader({"flux": pipeline("flux", url=url, pools=("promptEncoder", "imageEncoder"))}))
    code, body = _pending_work(api, "*")
    assert code == 200, body
    assert sorted(i["describedObject"]["name"] for i in body["items"]) == [
        "flux-denoiser",
        "flux-image-encoder",
        "flux-prompt-encoder",
    ]
    code, body = _pending_work(api, "flux-prompt-encoder")
    assert code == 200 and body["items"][0]["value"] == "3", body


def test_when_the_pipelines_cannot_be_listed_a_list_is_refused_with_a_503_status(pki: dict[str, Path]) -> None:
    api = Api(pki, FakeReader({"unlistable": pipeline("unlistable")}))
    code, body = _pending_work(api, "*")
    assert code == 503, body
    assert body["kind"] == "Status" and body["reason"] == "ServiceUnavailable", body
    assert "cannot list the DiffusionPipelines of ml" in body["message"]


def test_discovery_lists_the_metrics_per_deployment(api: Api) -> None:
    code, group = asyncio.run(api.get(GROUP_PATH))
    assert code == 200 and group["preferredVersion"]["version"] == "v1beta2"
    code, resources = asyncio.run(api.get(GROUP_PATH + "/v1beta2"))
    assert code == 200 and resources["kind"] == "APIResourceList"
    names = {r["name"] for r in resources["resources"]}
    assert "deployments.apps/triptych_pending_work_seconds" in names
    assert api.reviews[-1]["nonResourceAttributes"] == {"path": GROUP_PATH + "/v1beta2", "verb": "get"}


def test_the_aggregator_finds_an_openapi_document(api: Api) -> None:
    code, body = asyncio.run(api.get("/openapi/v2", user="system:kube-aggregator"))
    assert code == 200 and body["swagger"] == "2.0"


@pytest.mark.parametrize(
    "path",
    [
        GROUP_PATH + "/v1beta2/namespaces/ml/deployments.apps/other-denoiser/triptych_pending_work_seconds",
        GROUP_PATH + "/v1beta2/namespaces/ml/deployments.apps/flux-denoiser/triptych_unknown",
        GROUP_PATH + "/v1beta2/namespaces/ml/pods/flux-denoiser/triptych_pending_work_seconds",
        GROUP_PATH + "/v1beta2/namespaces/ml/deployments.apps/flux-decoder/triptych_pending_work_seconds",  # NaN
    ],
    ids=["no-such-pipeline", "unknown-metric", "not-a-deployment", "no-value"],
)
def test_what_is_not_there_is_a_404_status(api: Api, path: str) -> None:
    code, body = asyncio.run(api.get(path))
    assert code == 404 and body["kind"] == "Status" and body["reason"] == "NotFound", body


@pytest.mark.parametrize("cert", [None, "wrong", "forged"], ids=["no-cert", "not-an-allowed-name", "other-ca"])
def test_only_the_front_proxy_may_name_the_user(api: Api, cert: str | None) -> None:
    try:
        code, body = asyncio.run(api.get(METRIC_PATH, cert=cert))
    except aiohttp.ClientError:
        assert cert == "forged"  # a certificate of another CA fails the TLS handshake itself
        return
    assert code == 401, body
    assert not api.reviews


def test_a_user_the_cluster_does_not_authorize_is_refused(api: Api) -> None:
    api.deny_users.add("mallory")
    code, body = asyncio.run(api.get(METRIC_PATH, user="mallory"))
    assert code == 403 and body["reason"] == "Forbidden"


def test_when_the_review_cannot_be_made_the_request_is_refused_with_503(api: Api) -> None:
    code, body = asyncio.run(api.get(METRIC_PATH, user="unreviewable"))
    assert code == 503 and body["kind"] == "Status", body


def test_health_needs_no_credentials(api: Api) -> None:
    code, body = asyncio.run(api.get("/healthz", cert=None))
    assert (code, body) == (200, "ok")


# ---------------------------------------------------------------- a renewed serving certificate

RELOAD_S = 0.05  # the reload interval the test gives the server (RECHECK_S, 5 s, in production)
WITHIN_S = 5.0  # bound on every wait (the server should take a few RELOAD_S)


def kubelet_publish(mount: Path, files: Mapping[str, bytes], version: int) -> None:
    """Write a Secret volume as the kubelet does (its AtomicWriter): the files go into a new timestamped
    folder, the `..data` symlink is swapped to it by one rename and the old folder removed; tls.crt and
    tls.key are symlinks to ..data/tls.crt and ..data/tls.key, which never change themselves."""
    mount.mkdir(exist_ok=True)
    folder = mount / f"..2025_01_01_00_00_00.{version:09d}"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    data_link = mount / "..data"
    old = os.readlink(data_link) if data_link.is_symlink() else None
    os.symlink(folder.name, mount / "..data_tmp")
    os.replace(mount / "..data_tmp", data_link)
    for name in files:
        if not (mount / name).is_symlink():
            os.symlink(f"..data/{name}", mount / name)
    if old is not None:
        shutil.rmtree(mount / old)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_renewed_serving_certificate_is_served_without_a_restart(
    pki: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """metricsApi.tls.secretName (cert-manager's Secret) is renewed under the running server and the
    chart's checksum does not change, so nothing restarts it: the real server (main.serve, its
    Kubernetes reads faked) serves the renewed pair to new connections within a few reload intervals
    of the kubelet's ..data swap. A half-written pair is logged once and the pair in use kept."""
    from triptych_operator.metrics_api import main as metrics_main

    ca = make_ca(tmp_path, "renewing-ca")
    made = [
        make_cert(tmp_path, f"serving-{i}", ca, cn="metrics", san="DNS:localhost,IP:127.0.0.1", usage="serverAuth")
        for i in range(3)
    ]
    pairs = [{"tls.crt": crt.read_bytes(), "tls.key": key.read_bytes()} for crt, key in made]
    mount = tmp_path / "tls"
    kubelet_publish(mount, pairs[0], 1)
    config = header_config(pki)
    monkeypatch.setattr(metrics_main, "api_client", lambda kubeconfig: object())
    monkeypatch.setattr(metrics_main, "read_request_header_config", lambda kube: config)
    monkeypatch.setattr(metrics_main, "KubePipelineReader", lambda kube: FakeReader({}))
    monkeypatch.setattr(metrics_main, "kube_review", lambda kube: lambda spec: True)
    port = free_port()
    cert_flags = ["--tls-cert-file", str(mount / "tls.crt"), "--tls-private-key-file", str(mount / "tls.key")]
    args = metrics_main.build_parser().parse_args(
        [*cert_flags, "--bind-address", "127.0.0.1", "--secure-port", str(port)]
    )
    verified = ssl.create_default_context(cafile=str(ca[0]))  # as the kube-apiserver checks it (caBundle)
    names = {der(crt): f"pair {i}" for i, (crt, _key) in enumerate(made)}

    async def presented() -> bytes | None:
        """The certificate a new connection is shown; None while nothing listens."""
        unverified = ssl.create_default_context()
        unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
        try:
            _reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, ssl=unverified), WITHIN_S
            )
        except ConnectionRefusedError:
            return None
        cert = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        await writer.wait_closed()
        return cert

    async def until_presented(want: bytes, server: asyncio.Task[None], what: str) -> None:
        deadline = asyncio.get_running_loop().time() + WITHIN_S
        while (got := await presented()) != want:
            if server.done():
                server.result()  # its exception, if it failed
                raise AssertionError("the server stopped")
            assert asyncio.get_running_loop().time() < deadline, f"{what}: still served {names.get(got or b'', got)}"
            await asyncio.sleep(0.02)

    async def healthz() -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"https://localhost:{port}/healthz", ssl=verified) as resp:
                return resp.status, await resp.text()

    def refusals() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "triptych.tls_reload" and r.levelno >= logging.ERROR]

    async def scenario() -> None:
        server = asyncio.create_task(metrics_main.serve(args, tls_recheck_s=RELOAD_S))
        try:
            await until_presented(der(made[0][0]), server, "the first pair at start")
            assert await healthz() == (200, "ok")

            kubelet_publish(mount, pairs[1], 2)  # the renewal
            await until_presented(der(made[1][0]), server, "the renewed pair")
            assert await healthz() == (200, "ok"), "a client that verifies the server accepts the renewed pair"

            caplog.clear()
            half = {"tls.crt": pairs[2]["tls.crt"][: len(pairs[2]["tls.crt"]) // 2], "tls.key": pairs[2]["tls.key"]}
            kubelet_publish(mount, half, 3)
            deadline = asyncio.get_running_loop().time() + WITHIN_S
            while not refusals():
                assert asyncio.get_running_loop().time() < deadline, "a half-written pair is never logged"
                await asyncio.sleep(0.02)
            await asyncio.sleep(10 * RELOAD_S)  # ten more checks of the same bad pair
            assert len(refusals()) == 1, "a bad pair is logged once, not at every check"
            assert "does not load" in refusals()[0].getMessage()
            assert await presented() == der(made[1][0]), "the pair in use is kept"
            assert await healthz() == (200, "ok")

            kubelet_publish(mount, pairs[2], 4)  # the whole pair, written again
            await until_presented(der(made[2][0]), server, "a good pair after a bad one")
            assert await healthz() == (200, "ok")
        finally:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(server, WITHIN_S)

    with caplog.at_level(logging.INFO, logger="triptych.tls_reload"):
        asyncio.run(scenario())


def test_the_server_imports_nothing_the_operator_image_lacks() -> None:
    """The operator image has kopf, kubernetes and PyYAML (aiohttp with kopf), no torch or head code."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'torch', 'diffusers', 'transformers', 'prometheus_client', 'fastapi',\n"
        "                                  'zmq', 'msgspec', 'triptych_head', 'triptych_worker'}:\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import triptych_operator.metrics_api.main\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_the_cache_forgets_expired_pipelines(monkeypatch: pytest.MonkeyPatch) -> None:
    from triptych_operator.metrics_api import source as source_module

    monkeypatch.setattr(source_module, "MAX_CACHED_PIPELINES", 2)
    reader = FakeReader({})  # nobody's pipeline: cached as absent
    now = [0.0]

    async def run() -> HeadMetricsSource:
        async with aiohttp.ClientSession() as session:
            source = HeadMetricsSource(reader, http_fetcher(session), cache_seconds=1, clock=lambda: now[0])
            for i in range(5):
                now[0] = 2.0 * i
                await source.role_values("ml", f"p{i}")
            return source

    source = asyncio.run(run())
    assert len(source._cache) <= 3


def test_a_page_too_large_or_a_redirect_is_no_metric(heads: Heads, monkeypatch: pytest.MonkeyPatch) -> None:
    """A URL an annotation gives could lead anywhere: a redirect is not followed, and a page is read up
    to MAX_PAGE_BYTES (this process serves every HPA: it must not be made to hold an endless answer)."""
    from triptych_operator.metrics_api import source as source_module

    good = heads.start(HEAD_PAGE)

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{good}/metrics")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    mover = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=mover.serve_forever, daemon=True).start()
    reader = FakeReader({"moved": pipeline("moved", url=f"http://127.0.0.1:{mover.server_address[1]}/metrics")})
    reader.pipelines["big"] = pipeline("big", url=f"http://127.0.0.1:{good}/metrics")

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            source = HeadMetricsSource(reader, http_fetcher(session, 5.0))
            assert await source.role_values("ml", "moved") is None
            monkeypatch.setattr(source_module, "MAX_PAGE_BYTES", len(HEAD_PAGE) - 1)
            assert await source.role_values("ml", "big") is None
            monkeypatch.setattr(source_module, "MAX_PAGE_BYTES", len(HEAD_PAGE))
            source = HeadMetricsSource(reader, http_fetcher(session, 5.0))
            assert await source.role_values("ml", "big") is not None  # at the limit: read

    try:
        asyncio.run(run())
    finally:
        mover.shutdown()
        mover.server_close()
