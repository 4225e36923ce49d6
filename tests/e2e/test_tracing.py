"""One trace per request across the head and worker processes, exported over OTLP/HTTP (protobuf) to
a receiver this test runs: the head's root span, a span per hop (each queue, each role's stage, each
transfer), and each worker's span of its stages under the context the control messages carried
(triptych/tracing.py; docs/serving.md, "Where the time goes")."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.e2e.harness import deployment
from tests.e2e.test_server_timing import PARTS, ROLE_FLAGS
from triptych_dev.otlp_receiver import otlp_server

pytestmark = pytest.mark.slow


class Receiver:
    """The collector's side of OTLP/HTTP: POST /v1/traces, an ExportTraceServiceRequest in protobuf."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def take(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        own = {a.key: a.value.string_value for a in span.attributes}
                        self.spans.append({
                            "service": attrs.get("service.name"), "name": span.name,
                            "trace": span.trace_id.hex(), "id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                            "request_id": own.get("triptych.request_id"),
                        })  # fmt: skip


@contextmanager
def otlp_receiver() -> Iterator[tuple[Receiver, str]]:
    receiver = Receiver()
    server = otlp_server(receiver.take)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_request_s_trace_has_a_span_per_hop_from_the_head_and_every_worker(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export every 200 ms, not every 5 s
    with otlp_receiver() as (receiver, url):
        flags = ("--otlp-endpoint", url)
        with deployment(
            tiny_models["tiny-flux"], tmp_path, simulate=True, role_flags=ROLE_FLAGS, head_flags=flags,
            worker_flags=flags,
        ) as dep, dep.client(timeout=30) as c:  # fmt: skip
            body = {"prompt": "x", "size": "64x32", "num_inference_steps": 2, "seed": 1}
            answer = c.post("/v1/images/generations", json=body)
            assert answer.status_code == 200, answer.text
            wanted = {"triptych-head", "triptych-encoder", "triptych-denoiser", "triptych-decoder"}
            deadline = time.monotonic() + 20
            while {s["service"] for s in receiver.spans} != wanted or len(receiver.spans) < 1 + len(PARTS) + 3:
                assert time.monotonic() < deadline, receiver.spans
                time.sleep(0.1)
    spans = receiver.spans
    assert len({s["trace"] for s in spans}) == 1, spans  # one request, one trace
    (root,) = [s for s in spans if s["parent"] == ""]
    assert (root["service"], root["name"]) == ("triptych-head", "request")
    assert root["request_id"] == answer.headers["x-request-id"]  # the answer names its trace's request
    head_hops = [s for s in spans if s["service"] == "triptych-head" and s is not root]
    assert sorted(s["name"] for s in head_hops) == sorted(PARTS)
    for role in ("encoder", "denoiser", "decoder"):
        (stages,) = [s for s in spans if s["service"] == f"triptych-{role}"]
        assert stages["name"] == role and stages["parent"] == root["id"]  # the context the head sent it
        assert stages["end"] - stages["start"] >= 0.9 * 50e6  # its simulated 50 ms
    for span in spans:
        assert root["start"] <= span["start"] <= span["end"] <= root["end"] + 10e6, span  # within 10 ms of clocks
