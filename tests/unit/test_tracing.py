"""Tracing is off by default and costs nothing then, and nothing a peer or a collector does can fail a
request (triptych/tracing.py, triptych/otlp.py). The trace itself, across processes and over
OTLP/HTTP, is tests/e2e/test_tracing.py's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.unit.core_harness import Harness
from triptych.otlp import OtlpTracing
from triptych.protocol import RequestResult, TransferReady, Work
from triptych.roles import Role
from triptych.tracing import start_tracing, traces_url

THREE_ROLES = {Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1}
UNREACHABLE = "http://127.0.0.1:9/v1/traces"  # the discard port: nothing listens


def test_the_flag_names_the_collector_and_the_standard_variables_stand_in_for_it() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318/"}
    assert traces_url("http://flag:4318", env) == "http://flag:4318/v1/traces"
    assert traces_url("", env) == "http://env:4318/v1/traces"
    assert traces_url("", {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"}) == "http://t:1/x"
    assert traces_url("", {}) == "" and start_tracing("", "triptych-head") is None


def test_without_an_endpoint_the_head_and_a_worker_never_load_opentelemetry(tiny_models) -> None:
    """A request through the head's core and a simulated worker's stages, with a traceparent on the
    work as a tracing head would send it: no module of OpenTelemetry is imported."""
    code = f"""
import sys
from tests.unit.core_harness import Harness
from triptych.cli import build_parser
from triptych.config import ServeArgs
from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_head import server
from triptych_worker import compute
from triptych_worker.runtime import Job, Worker
h = Harness({{Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1}})
h.submit("r")
while h.pending:
    h.deliver()
    h.answer()
argv = ["serve", "--model-path", {str(tiny_models["tiny-flux"])!r}, "--disagg-role", "encoder", "--simulate",
        "--disagg-server-addr", "tcp://127.0.0.1:1", "--disagg-transfer-pool-size", "4MiB"]
worker = Worker(ServeArgs.from_namespace(build_parser().parse_args(argv)))
class Link:
    def send(self, msg, frames=()):
        print(msg.TYPE)
traced = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
compute.compute(worker, Link(), [Job("r1", GenerationParams("x", 64, 48), traceparent=traced)])
worker.transport.close()
print(sorted(h.endings()), worker.tracing, [m for m in sys.modules if m.startswith("opentelemetry")])
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-3:] == ["transfer_staged", "['r'] None []", ""], out.stdout


def test_a_traced_request_carries_its_context_to_every_hop_and_an_unreachable_collector_fails_nothing() -> None:
    h = Harness(THREE_ROLES)
    h.core.tracing = start_tracing(UNREACHABLE, "triptych-head")
    assert h.core.tracing is not None
    h.submit("r")
    carried = []
    while h.pending:
        carried += [m.traceparent for _, m in h.pending if isinstance(m, (Work, TransferReady))]
        h.deliver()
        h.answer()
    assert [type(m) for m in h.endings()["r"]] == [RequestResult]
    assert len(carried) == 3 and len(set(carried)) == 1 and carried[0].startswith("00-"), carried
    started = time.monotonic()
    h.core.tracing.shutdown()
    assert time.monotonic() - started < 15  # the exporter gives up on the collector, the process goes on


def test_a_malformed_traceparent_from_a_peer_starts_a_new_trace() -> None:
    tracing = OtlpTracing(UNREACHABLE, "triptych-denoiser")
    memory = InMemorySpanExporter()
    tracing._provider.add_span_processor(SimpleSpanProcessor(memory))
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for traceparent in ("garbage", "00-" + "z" * 32 + "-" + "0" * 16 + "-01", "\x00" * 300, good):
        tracing.record(traceparent, "denoiser", 1_000, 2_000, {"triptych.request_id": "r"})
    spans = memory.get_finished_spans()
    assert [s.parent is None for s in spans] == [True, True, True, False]
    assert f"{spans[-1].context.trace_id:032x}" == good.split("-")[1]
    tracing.shutdown()


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
@pytest.mark.parametrize("url", ["garbage-not-a-url", "http://c:abc", "http://c:99999", "ftp://c:4318", "http://["])
def test_an_endpoint_from_the_environment_is_checked_as_the_flag_is(variable, url):
    """It was taken as given and every export failed later, naming no variable."""
    from triptych.config import ConfigError

    with pytest.raises(ConfigError, match=f"{variable} '{re.escape(url)}' is not an http"):
        traces_url("", {variable: url})


def test_a_collector_that_never_answers_holds_a_process_exit_for_at_most_the_shutdown_bound() -> None:
    """The spans still buffered at exit are exported for at most SHUTDOWN_S (5 s), then dropped: a hung
    collector must not keep a draining worker or head past its grace period (it took ~25 s before: 30 s
    of the SDK's own shutdown, each batch's export waited out, and its exit hook after that)."""
    code = """
import socket, sys, threading, time
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(64)
held = []
threading.Thread(target=lambda: [held.append(server.accept()) for _ in iter(int, 1)], daemon=True).start()
from triptych.tracing import start_tracing
tracing = start_tracing(f"http://127.0.0.1:{server.getsockname()[1]}/v1/traces", "triptych-head")
for i in range(3000):
    root = tracing.start_request("request", time.time_ns(), {"triptych.request_id": f"r{i}"})
    tracing.end_request(root, [("queue", time.time_ns(), time.time_ns(), {})] * 3, time.time_ns(), None)
tracing.shutdown()
"""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "took no spans within 5 s" in done.stderr, done.stderr
    assert took < 15, f"the process took {took:.1f} s to exit"


def test_the_collector_s_credentials_are_never_logged(caplog, monkeypatch) -> None:
    """An endpoint's user part (`http://user:password@collector`) or query reached the head's and the
    workers' logs whole: at start (INFO) and when the collector took no spans at exit (WARNING)."""
    from triptych import otlp

    monkeypatch.setattr(otlp, "SHUTDOWN_S", 0.05)
    caplog.set_level("INFO", logger="triptych.otlp")
    tracing = OtlpTracing("http://tracer:s3cretpass@127.0.0.1:9/v1/traces?token=s3crettoken", "triptych-head")
    monkeypatch.setattr(tracing._provider, "shutdown", lambda: time.sleep(1))  # a collector that never answers
    tracing.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "triptych.otlp"]
    assert len(lines) == 2 and "took no spans" in lines[1], lines
    for line in lines:
        assert "http://127.0.0.1:9/v1/traces" in line, line
        assert "s3cret" not in line and "tracer" not in line, line
