"""An OTLP/HTTP trace receiver for tests and benchmarks: the collector's side of the protocol
(POST /v1/traces, an ExportTraceServiceRequest in protobuf), each export handed to a callback."""

from __future__ import annotations

from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"


def otlp_server(on_export: Callable[[ExportTraceServiceRequest], None]) -> ThreadingHTTPServer:
    """A server on a free loopback port (`server_address[1]`; run `serve_forever`) that decodes each
    export and passes it to `on_export`; anything but a protobuf POST to /v1/traces gets a 400."""
    answer = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            ok = self.path == TRACES_PATH and self.headers["Content-Type"] == PROTOBUF
            if ok:
                on_export(ExportTraceServiceRequest.FromString(body))
            self.send_response(200 if ok else 400)
            self.send_header("Content-Type", PROTOBUF)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)
