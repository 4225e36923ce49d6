"""Tracing benchmark: what OpenTelemetry tracing (--otlp-endpoint) costs a request, against off.

Two deployments up side by side, as head_bench.py's CURVE comparison: real head and worker
processes with zero-compute stages (triptych_worker.null_pipeline) and real Mooncake hops, one
without an endpoint (tracing off: the OpenTelemetry SDK is never imported) and one whose head and
workers export every request's spans over OTLP/HTTP to a receiver in a process of its own (this
script with --receiver: it decodes each ExportTraceServiceRequest and counts the spans, as a
collector would take them). Blocks of sequential requests alternate between the two (off, on, on,
off, ...), so the host's drift falls on both.

    python bench/tracing_bench.py [--blocks 8] [--block-requests 100] [--json bench/results/tracing.json]

Prints the median latency per request with tracing off and on, the control overhead (latency less
the Mooncake writes and the workers' stages they report), the on / off ratio of each, and the spans
the receiver took.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from head_bench import sequential  # noqa: E402

from triptych_dev.localdeploy import local_deployment  # noqa: E402
from triptych_dev.tiny_models import write_tiny_models  # noqa: E402


def receive(count_file: Path) -> None:
    """The receiver process: an OTLP/HTTP endpoint on a free port (written to `count_file` first), then
    the running count of spans received, rewritten after each export."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from triptych_dev.otlp_receiver import otlp_server

    spans = 0

    def count(request: ExportTraceServiceRequest) -> None:
        nonlocal spans
        spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        count_file.write_text(str(spans))

    server = otlp_server(count)
    count_file.write_text(f"port {server.server_address[1]}")
    server.serve_forever()


def start_receiver(count_file: Path) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen([sys.executable, __file__, "--receiver", str(count_file)])
    deadline = time.monotonic() + 30
    while not (count_file.exists() and count_file.read_text().startswith("port ")):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("the OTLP receiver did not start")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{count_file.read_text().split()[1]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8, help="alternating blocks per deployment")
    parser.add_argument("--block-requests", type=int, default=100, help="sequential requests per block")
    parser.add_argument("--payload-bytes", type=int, default=65536, help="bytes each hop hands on")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "tracing.json")
    parser.add_argument("--receiver", type=Path, help=argparse.SUPPRESS)  # run as the receiver process
    args = parser.parse_args()
    if args.receiver is not None:
        receive(args.receiver)
        return 0
    flux = next(p for p in write_tiny_models(ROOT / ".models") if p.name == "tiny-flux")
    figures: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        count_file = Path(tmp) / "spans"
        receiver, url = start_receiver(count_file)
        stack.callback(receiver.wait)
        stack.callback(receiver.send_signal, signal.SIGTERM)
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "500"  # export twice a second: the on figures pay for it
        deps = {}
        for on in (False, True):
            flags = ("--otlp-endpoint", url) if on else ()
            deps[on] = stack.enter_context(
                local_deployment(
                    flux, Path(tmp) / ("on" if on else "off"), head_flags=flags,
                    worker_flags=("--device", "cpu", *flags), null_payload_bytes=args.payload_bytes,
                )
            )  # fmt: skip
        endpoints = {on: f"tcp://127.0.0.1:{dep.scheduler_port}" for on, dep in deps.items()}
        for endpoint in endpoints.values():
            sequential(endpoint, 20)  # warm up
        for i in range(args.blocks):
            for on in (False, True) if i % 2 == 0 else (True, False):
                figures[on].append(sequential(endpoints[on], args.block_requests))
        time.sleep(1.5)  # the last batches of spans reach the receiver
        spans = int(count_file.read_text()) if count_file.read_text().isdigit() else 0
    out: dict[str, float] = {"requests_each": args.blocks * args.block_requests, "spans_received": spans}
    for on, name in ((False, "off"), (True, "on")):
        for key in ("latency_ms", "control_overhead_ms"):
            out[f"{name}_{key}"] = statistics.median(f[key] for f in figures[on])
    out["latency_ratio"] = out["on_latency_ms"] / out["off_latency_ms"]
    out["overhead_ratio"] = out["on_control_overhead_ms"] / out["off_control_overhead_ms"]
    print(f"tracing off vs on: two deployments side by side, {args.blocks} alternating blocks of "
          f"{args.block_requests} sequential requests each (medians of blocks)")  # fmt: skip
    print(f"{'':24}{'off':>10}{'on':>10}{'on / off':>10}")
    print(f"{'latency per request':24}{out['off_latency_ms']:>8.2f}ms{out['on_latency_ms']:>8.2f}ms"
          f"{out['latency_ratio']:>10.3f}")  # fmt: skip
    print(f"{'control overhead':24}{out['off_control_overhead_ms']:>8.2f}ms{out['on_control_overhead_ms']:>8.2f}ms"
          f"{out['overhead_ratio']:>10.3f}")  # fmt: skip
    print(f"spans received over OTLP/HTTP: {spans} (a request: the head's 1 + 8 hops, and 3 workers' 1 each)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
