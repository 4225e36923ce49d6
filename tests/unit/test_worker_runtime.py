"""The worker runtime: kept receive slots across requests and heads, step reports (no sockets),
and the leader/follower threads over real ZMQ sockets."""

from __future__ import annotations

import threading
import time

import torch
import zmq

from triptych.cli import build_parser
from triptych.config import ServeArgs
from triptych.localdeploy import free_port_block
from triptych.params import GenerationParams
from triptych.protocol import (
    CancelWork,
    Failed,
    Heartbeat,
    Ping,
    Progress,
    Submit,
    TransferAlloc,
    TransferAllocated,
    TransferStaged,
    Work,
    decode,
    encode,
)
from triptych.roles import Role
from triptych_worker.null_pipeline import NullPipeline
from triptych_worker.runtime import Job, Worker


class RecordingLink:
    """Stands in for the worker's socket to the head; records what the worker says."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object, frames: object = ()) -> None:
        self.sent.append(msg)


def make_worker() -> Worker:
    argv = ["serve", "--model-path", "m", "--disagg-role", "denoiser", "--disagg-server-addr", "tcp://127.0.0.1:1",
            "--device", "cpu", "--disagg-transfer-pool-size", "4MiB"]  # fmt: skip
    args = ServeArgs.from_namespace(build_parser().parse_args(argv))
    return Worker(args, pipeline=NullPipeline(Role.DENOISER, 1024))  # type: ignore[arg-type]


def test_kept_slot_survives_its_request_and_is_dropped_when_the_head_changes():
    worker = make_worker()
    link = RecordingLink()
    try:
        worker._follow_head("head-1")
        worker._allocate(link, TransferAlloc("r1", "w", 1 << 20, keep=True))  # type: ignore[arg-type]
        allocated = link.sent[-1]
        assert isinstance(allocated, TransferAllocated) and allocated.kept
        worker._on_message(link, _encoded(CancelWork("r1", "w")))  # type: ignore[arg-type]
        assert worker.pool.free_bytes == worker.pool.pool_bytes - (1 << 20), "a kept slot outlives its request"
        worker._follow_head("head-1")
        assert worker.pool.free_bytes < worker.pool.pool_bytes
        worker._follow_head("head-2")  # a restarted head never heard of it
        assert worker.pool.free_bytes == worker.pool.pool_bytes
        assert worker._heartbeat().standing_bytes == 0
    finally:
        worker.transport.close()


def _encoded(msg: object) -> list[bytes]:
    return encode(msg)


def test_a_message_the_worker_cannot_act_on_fails_its_request_and_the_worker_goes_on(monkeypatch):
    worker = make_worker()
    link = RecordingLink()
    try:
        worker._on_message(link, _encoded(Submit("stray", GenerationParams("x", 8, 8))))  # type: ignore[arg-type]
        assert link.sent == [] and worker.instance == ""  # not a head message: dropped, nothing learned from it

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("pool bookkeeping broke")

        monkeypatch.setattr(worker.pool, "allocate", broken)
        worker._on_message(link, _encoded(TransferAlloc("r1", "w", 1024)))  # type: ignore[arg-type]
        (failed,) = link.sent
        assert isinstance(failed, Failed) and failed.request_id == "r1"
        assert "transfer_alloc could not be handled: pool bookkeeping broke" in failed.error
        worker._on_message(link, _encoded(Ping("w", head_id="h")))  # type: ignore[arg-type]
        assert isinstance(link.sent[-1], Heartbeat)  # still answering
    finally:
        worker.transport.close()


def test_steps_are_reported_only_when_the_head_asks_for_them():
    worker = make_worker()
    params = GenerationParams("x", width=16, height=16, num_inference_steps=3)
    try:
        for progress, expected_steps in ((False, []), (True, [1, 2, 3])):
            link = RecordingLink()
            worker._run_job(link, Job(f"r-{progress}", params, progress=progress))  # type: ignore[arg-type]
            assert [m.step for m in link.sent if isinstance(m, Progress)] == expected_steps
            assert isinstance(link.sent[-1], TransferStaged)
    finally:
        worker.transport.close()


class GatedPipeline:
    """A denoiser whose every job blocks until the test opens its gate; records who ran what."""

    family = "gated"
    loaded_components: set[str] = set()

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.runs: list[tuple[str, str]] = []  # (request id, thread name), in the order jobs started
        self.running = 0
        self.max_running = 0

    def validate(self, params: object) -> None:
        pass

    def run(self, batch: object) -> object:
        rid = batch.params.prompt  # type: ignore[attr-defined]
        self.runs.append((rid, threading.current_thread().name))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            assert self.gates[rid].wait(30), f"gate of {rid} never opened"
        finally:
            self.running -= 1
        batch.tensors = {"latents": torch.zeros(16, dtype=torch.uint8)}  # type: ignore[attr-defined]
        return batch


def test_a_computing_worker_keeps_answering_and_runs_queued_work_in_order_one_at_a_time():
    """Real sockets: while one job runs, the other thread leads (answers pings and allocations);
    work that arrives meanwhile runs after it, in order, never two at once."""
    base = free_port_block(8)
    argv = ["serve", "--model-path", "m", "--disagg-role", "denoiser", "--device", "cpu",
            "--disagg-server-addr", f"tcp://127.0.0.1:{base}", "--scheduler-port", str(base + 6),
            "--disagg-transfer-pool-size", "4MiB"]  # fmt: skip
    args = ServeArgs.from_namespace(build_parser().parse_args(argv))
    pipeline = GatedPipeline()
    worker = Worker(args, pipeline=pipeline)  # type: ignore[arg-type]
    ctx = zmq.Context.instance()
    results = ctx.socket(zmq.PULL)
    results.setsockopt(zmq.RCVTIMEO, 10_000)
    results.bind(f"tcp://127.0.0.1:{base + 2}")  # the denoiser result port of a head at `base`
    work = ctx.socket(zmq.PUSH)
    work.setsockopt(zmq.LINGER, 0)
    work.connect(f"tcp://127.0.0.1:{base + 6}")
    serving = threading.Thread(target=worker.serve, daemon=True)
    serving.start()

    def next_message(kind: type) -> object:
        while True:
            msg, _ = decode(results.recv_multipart())  # zmq.Again after 10 s fails the test
            if isinstance(msg, kind):
                return msg

    params = {"width": 16, "height": 16, "num_inference_steps": 1}
    try:
        for rid in ("r1", "r2", "r3"):
            pipeline.gates[rid] = threading.Event()
        work.send_multipart(encode(Work("r1", "w", {**params, "prompt": "r1"})))
        deadline = time.monotonic() + 10
        while not pipeline.runs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r for r, _ in pipeline.runs] == ["r1"]
        # r1 blocks its thread; the other one leads: pings and allocations are answered at once.
        work.send_multipart(encode(Ping("w", "head-1")))
        assert isinstance(next_message(Heartbeat), Heartbeat)
        work.send_multipart(encode(TransferAlloc("r9", "w", 4096)))
        assert next_message(TransferAllocated).request_id == "r9"  # type: ignore[attr-defined]
        work.send_multipart(encode(Work("r2", "w", {**params, "prompt": "r2"})))
        work.send_multipart(encode(Work("r3", "w", {**params, "prompt": "r3"})))
        time.sleep(0.2)
        assert [r for r, _ in pipeline.runs] == ["r1"], "queued work must wait for the running job"
        for rid in ("r1", "r2", "r3"):
            pipeline.gates[rid].set()
            assert next_message(TransferStaged).request_id == rid  # type: ignore[attr-defined]
        assert [r for r, _ in pipeline.runs] == ["r1", "r2", "r3"]
        assert pipeline.max_running == 1
        # The thread that finished r1 ran the queue; the one that led meanwhile never computed.
        assert len({thread for _, thread in pipeline.runs}) == 1
    finally:
        for gate in pipeline.gates.values():
            gate.set()
        worker.stop()
        serving.join(timeout=10)
        work.close()
        results.close()
    assert not serving.is_alive()
