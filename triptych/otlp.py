"""triptych.tracing's exporter: the OpenTelemetry SDK, a BatchSpanProcessor and the OTLP/HTTP
(protobuf) span exporter. Imported only by a process given an OTLP endpoint."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from triptych.tracing import Attributes
from triptych.urls import shown_url

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 5.0  # one export's bound
SHUTDOWN_S = 5.0  # an unreachable collector delays a process's exit at most this; the spans left are lost


class OtlpTracing:
    def __init__(self, url: str, service: str):
        # Its own provider, not the global one: nothing else in the process is traced through it.
        # No shutdown at exit of its own (it would wait for the collector up to 30 s): `shutdown`'s, bounded.
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}), shutdown_on_exit=False)
        self._shown = shown_url(url)  # in logs: its user part may hold the collector's credentials
        exporter = OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)
        self._provider.add_span_processor(BatchSpanProcessor(exporter, export_timeout_millis=EXPORT_TIMEOUT_S * 1000))
        self._tracer = self._provider.get_tracer("triptych")
        self._propagator = TraceContextTextMapPropagator()
        log.info("tracing: spans of %s go to %s (OTLP/HTTP)", service, self._shown)

    def start_request(self, name: str, start_ns: int, attributes: Attributes) -> Any:
        return self._tracer.start_span(name, start_time=start_ns, attributes=attributes)

    def traceparent(self, root: Any) -> str:
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(root))
        return carrier.get("traceparent", "")

    def end_request(
        self, root: Any, parts: Sequence[tuple[str, int, int, Attributes]], end_ns: int, error: str | None
    ) -> None:
        context = trace.set_span_in_context(root)
        for name, start_ns, part_end_ns, attributes in parts:
            span = self._tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes)
            span.end(end_time=part_end_ns)
        if error is not None:
            root.set_status(Status(StatusCode.ERROR, error))
        root.end(end_time=end_ns)

    def record(self, traceparent: str, name: str, start_ns: int, end_ns: int, attributes: Attributes) -> None:
        try:
            context = self._propagator.extract({"traceparent": traceparent})
        except Exception:  # a peer's malformed value: this span starts its own trace
            context = None
        span = self._tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes)
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Export the spans still buffered, for at most SHUTDOWN_S: a collector that does not answer must
        not hold the process past its grace period (the kubelet's SIGKILL would lose more than spans)."""
        exporting = threading.Thread(target=self._provider.shutdown, name="otlp-shutdown", daemon=True)
        exporting.start()
        exporting.join(SHUTDOWN_S)
        if exporting.is_alive():
            log.warning(
                "tracing: %s took no spans within %.0f s; exiting without the last ones", self._shown, SHUTDOWN_S
            )
