"""OpenTelemetry traces of requests across the head and the workers, off unless configured.

With `--otlp-endpoint URL` (or the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT /
OTEL_EXPORTER_OTLP_ENDPOINT environment variables) a process exports spans over OTLP/HTTP
(protobuf): the head one trace per request, a root span and a span per hop (each queue, each role's
stage, each transfer: triptych_head.timeline), the workers a span for their stages under the
context the head carries to them (the W3C `traceparent` of Work and TransferReady). Without an
endpoint, start_tracing returns None, nothing of the OpenTelemetry SDK is imported, and a request
costs one `is None` branch per place that would record.

Nothing a peer sends can fail a request here: a malformed traceparent starts a new trace, and an
unreachable collector only loses spans (the SDK exports them in the background, and logs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

TRACES_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"  # the traces URL itself
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"  # a collector's base URL; traces go to its /v1/traces
TRACES_PATH = "/v1/traces"

Attributes = Mapping[str, str | int | float | bool]


class Tracing(Protocol):
    """What the head and the workers record (triptych.otlp.OtlpTracing is the one implementation)."""

    def start_request(self, name: str, start_ns: int, attributes: Attributes) -> Any:
        """A request's root span, started at `start_ns` (epoch nanoseconds)."""
        ...

    def traceparent(self, root: Any) -> str:
        """The W3C traceparent naming `root`, for the control messages."""
        ...

    def end_request(
        self, root: Any, parts: Sequence[tuple[str, int, int, Attributes]], end_ns: int, error: str | None
    ) -> None:
        """The hop spans (name, start, end, attributes) under `root`, then `root` ends at `end_ns`."""
        ...

    def record(self, traceparent: str, name: str, start_ns: int, end_ns: int, attributes: Attributes) -> None:
        """A finished span under the context `traceparent` names (a new trace when it names none)."""
        ...

    def shutdown(self) -> None:
        """Export what is buffered (bounded by the exporter's timeout)."""
        ...


def traces_url(endpoint: str, environ: Mapping[str, str] = os.environ) -> str:
    """Where spans go: `--otlp-endpoint` (a collector's base URL, as OTEL_EXPORTER_OTLP_ENDPOINT),
    else the environment's; "" when none is set (tracing off)."""
    if endpoint:
        return endpoint.rstrip("/") + TRACES_PATH
    if environ.get(TRACES_ENV):
        return _checked(TRACES_ENV, environ[TRACES_ENV])
    if environ.get(ENDPOINT_ENV):
        return _checked(ENDPOINT_ENV, environ[ENDPOINT_ENV]).rstrip("/") + TRACES_PATH
    return ""


def _checked(variable: str, url: str) -> str:
    """An endpoint from the environment, refused at start-up as --otlp-endpoint is (not at every export)."""
    from triptych.config import ConfigError
    from triptych.config_checks import http_endpoint

    if http_endpoint(url) is None:
        raise ConfigError(f"{variable} {url!r} is not an http(s)://HOST:PORT URL of an OTLP/HTTP collector")
    return url


def start_tracing(url: str, service: str) -> Tracing | None:
    """An exporter to `url` for the process named `service` (service.name), or None when `url` is ""."""
    if not url:
        return None
    from triptych.otlp import OtlpTracing  # only now: a process without an endpoint never loads the SDK

    return OtlpTracing(url, service)
