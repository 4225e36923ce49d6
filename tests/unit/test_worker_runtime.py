"""The worker runtime without sockets: kept receive slots across requests and heads, step reports."""

from __future__ import annotations

from triptych.cli import build_parser
from triptych.config import ServeArgs
from triptych.protocol import CancelWork, TransferAlloc, TransferAllocated
from triptych.roles import Role
from triptych_worker.null_pipeline import NullPipeline
from triptych_worker.runtime import Worker


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
    from triptych.protocol import encode

    return encode(msg)


def test_steps_are_reported_only_when_the_head_asks_for_them():
    from triptych.protocol import Progress, TransferStaged
    from triptych_worker.runtime import Job

    worker = make_worker()
    params = {"prompt": "x", "width": 16, "height": 16, "num_inference_steps": 3}
    try:
        for progress, expected_steps in ((False, []), (True, [1, 2, 3])):
            link = RecordingLink()
            worker._run_job(link, Job(f"r-{progress}", params, progress=progress))  # type: ignore[arg-type]
            assert [m.step for m in link.sent if isinstance(m, Progress)] == expected_steps
            assert isinstance(link.sent[-1], TransferStaged)
    finally:
        worker.transport.close()
