"""The worker runtime: standing receive slots across requests and heads, step reports (no sockets),
and the leader/follower threads over real ZMQ sockets."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from triptych.cli import build_parser
from triptych.config import ServeArgs
from triptych.params import GenerationParams
from triptych.protocol import (
    BatchResized,
    CancelWork,
    Failed,
    Heartbeat,
    Ping,
    Progress,
    Submit,
    TransferAlloc,
    TransferAllocated,
    TransferPush,
    TransferPushed,
    TransferReady,
    TransferRefused,
    TransferStaged,
    Work,
    WorkRefused,
    decode,
    encode,
)
from triptych.protocol.codec import MAX_HEADER_BYTES, PROTOCOL_VERSION
from triptych.roles import Role
from triptych_dev.localdeploy import free_port_block
from triptych_dev.null_pipeline import NullPipeline
from triptych_worker import compute, drain, pushes, slots
from triptych_worker.resume import RESUME
from triptych_worker.runtime import Job, Worker
from triptych_worker.stages import StageBatch
from triptych_worker.transfer import (
    InPlaceTensors,
    MooncakeTransport,
    StagedTensors,
    TransferError,
    TransferPool,
    TransferStalled,
    stage_in_place,
)


class RecordingLink:
    """Stands in for the worker's sockets to its heads (heads.HeadLinks); records what the worker says."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object, frames: object = ()) -> None:
        self.sent.append(msg)

    def send_to(self, endpoint: object, msg: object) -> None:
        self.sent.append(msg)

    def broadcast(self, make) -> None:  # type: ignore[no-untyped-def]
        self.sent.append(make(HEAD_ENDPOINT, ""))


HEAD_ENDPOINT = "tcp://127.0.0.1:3"  # the denoiser result port of the head at tcp://127.0.0.1:1


def ping(head_id: str) -> list[bytes]:
    return encode(Ping("w", head_id=head_id))


def make_worker(*flags: str, heads: str = "tcp://127.0.0.1:1") -> Worker:
    argv = ["serve", "--model-path", "m", "--disagg-role", "denoiser", "--disagg-server-addr", heads,
            "--device", "cpu", "--disagg-transfer-pool-size", "4MiB", *flags]  # fmt: skip
    args = ServeArgs.from_namespace(build_parser().parse_args(argv))
    return Worker(args, pipeline=NullPipeline(Role.DENOISER, 1024))  # type: ignore[arg-type]


def test_a_worker_serving_several_heads_takes_work_in_the_slot_a_suspended_request_left():
    """Preemption on a worker several heads share (every operator deployment: its heads are a dns://
    name): the head frees the suspended request's slot and sends the higher-priority one there. The
    suspended state only waits in the pool; the worker must not count it. Before, it refused the new
    request at its capacity, the head asked again after every heartbeat, and both requests timed out."""
    worker = make_worker("--worker-capacity", "1", heads="dns://heads.ns.svc:5555")
    try:
        assert not worker.heads.single
        link = RecordingLink()
        job = Job("low", GenerationParams("p", width=16, height=16))
        stopped = StageBatch(job.params, {"latents": torch.randn(64)}, {RESUME: {"step": 3}})
        report = compute._deliver(worker, link, job, stopped, time.perf_counter(), 1, True, {})  # type: ignore[arg-type]
        assert report is not None and report[0].continues_at == 3
        slots.allocate(worker, link, TransferAlloc("high", "w", 1024, head_id="h"))  # type: ignore[arg-type]
        assert isinstance(link.sent[-1], TransferAllocated), link.sent[-1]
        # An output waiting for its push does hold its slot: the next request is refused.
        finished = StageBatch(job.params, {"latents": torch.randn(64)}, {})
        with worker._lock:
            worker._slots.pop("high")
        compute._deliver(worker, link, Job("done", job.params), finished, time.perf_counter(), 1, True, {})  # type: ignore[arg-type]
        slots.allocate(worker, link, TransferAlloc("next", "w", 1024, head_id="h"))  # type: ignore[arg-type]
        answer = [m for m in link.sent if not isinstance(m, Heartbeat)][-1]  # a refusal brings a heartbeat too
        assert isinstance(answer, TransferRefused) and answer.request_id == "next", answer
    finally:
        worker.transport.close()


def test_a_request_resumed_in_place_as_soon_as_its_continuation_is_reported_stays_outstanding():
    """The head may answer a suspension at once, resuming the request where its state is (an in-place
    TransferReady, handled on the leader thread) before the computing thread has finished its own
    bookkeeping: the resumed job must stay outstanding. Before, it was dropped from the worker's held
    requests, so a later HandOff was ignored and the heartbeats under-counted its load."""
    worker = make_worker()  # a null denoiser, which hands off at step boundaries
    params = GenerationParams("x", width=16, height=16, num_inference_steps=4)

    class Link(RecordingLink):
        def send(self, msg: object, frames: object = ()) -> None:
            super().send(msg, frames)
            if isinstance(msg, TransferStaged) and msg.continues_at is not None:  # the head answers at once
                ready = TransferReady("r", "w", params, msg.manifest, msg.meta, 0, in_place=True)
                slots.ready(worker, self, ready)  # type: ignore[arg-type]

    try:
        worker._enqueue(Job("r", params))
        worker._queue.clear()  # taken by this thread, as the computing thread takes it
        worker._hand_off("r")  # the head's HandOff (preempt)
        compute.compute(worker, Link(), [Job("r", params)])  # type: ignore[arg-type]
        assert [job.request_id for job in worker._queue] == ["r"]  # resumed in place
        assert "r" in worker._held_requests() and worker._heartbeat().held == 1
        worker._hand_off("r")
        assert worker.handing_off("r"), "a HandOff for the resumed request is honoured"
    finally:
        worker.transport.close()


def test_a_batch_whose_outputs_do_not_all_fit_the_pool_reports_those_staged_and_goes_on(monkeypatch):
    """A batch's reports wait until every member is staged; a member that waits for room in the pool
    must not wait on the others' unreported outputs, which only the head's pushes take away. Before,
    the computing thread waited for ever (until the head's timeout), where the requests alone ran."""
    monkeypatch.setattr(compute, "stage_in_place", lambda *_, **__: None)  # as over RDMA: into the pool
    argv = ["serve", "--model-path", "m", "--disagg-role", "encoder", "--disagg-server-addr", "tcp://127.0.0.1:1",
            "--device", "cpu", "--disagg-transfer-pool-size", "4MiB", "--batching-max-size", "2"]  # fmt: skip
    worker = Worker(ServeArgs.from_namespace(build_parser().parse_args(argv)), NullPipeline(Role.ENCODER, 3 << 20))  # type: ignore[arg-type]
    link = RecordingLink()
    params = GenerationParams("x", width=16, height=16)
    jobs = [Job("a", params, group="g", group_size=2), Job("b", params, group="g", group_size=2)]
    with worker._lock:
        worker._outstanding.update(["a", "b"])
    thread = threading.Thread(target=compute.compute, args=(worker, link, jobs), daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while not any(isinstance(m, TransferStaged) for m in link.sent) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [m.request_id for m in link.sent if isinstance(m, TransferStaged)] == ["a"]
        assert thread.is_alive()  # b waits for room
        with worker._lock:
            staged = worker._staged.pop("a")
        worker.free_staged(staged)  # the head had a's outputs pushed: their room is back
        thread.join(30)
        assert not thread.is_alive()
        assert [m.request_id for m in link.sent if isinstance(m, TransferStaged)] == ["a", "b"]
    finally:
        worker._stop.set()
        thread.join(5)
        worker.transport.close()


def test_simulated_stages_run_a_group_one_at_a_time_and_report_each_request_s_own_seconds():
    """Stages without a batched forward (simulated, --simulate; NullPipeline) run a group's requests one
    after the other, each reported alone (batch of 1): each reports its own time, not the group's so
    far. Before, the last of four reported the four's, and device-seconds and the work estimate grew
    with the group's size."""
    argv = ["serve", "--model-path", "m", "--disagg-role", "denoiser", "--disagg-server-addr", "tcp://127.0.0.1:1",
            "--device", "cpu", "--disagg-transfer-pool-size", "4MiB", "--batching-max-size", "4"]  # fmt: skip
    pipeline = NullPipeline(Role.DENOISER, 1024, step_seconds=0.2)  # 0.2 s of denoising per request
    worker = Worker(ServeArgs.from_namespace(build_parser().parse_args(argv)), pipeline=pipeline)  # type: ignore[arg-type]
    link = RecordingLink()
    params = GenerationParams("x", width=16, height=16, num_inference_steps=1)
    try:
        started = time.perf_counter()
        compute.compute(worker, link, [Job(r, params, group="g", group_size=4) for r in "abcd"])  # type: ignore[arg-type]
        group_s = time.perf_counter() - started
        reports = [m for m in link.sent if isinstance(m, TransferStaged)]
        assert [(m.request_id, m.batch_size, m.batch_leader) for m in reports] == [(r, 1, True) for r in "abcd"]
        # about a quarter of the group's time each (by ratio: a loaded machine slows them all)
        assert all(0.15 <= m.seconds < group_s / 2 for m in reports), ([round(m.seconds, 3) for m in reports], group_s)
    finally:
        worker.transport.close()


def test_standing_slots_are_reserved_at_start_up_for_a_default_request_and_listed_in_heartbeats():
    worker = make_worker()  # a null denoiser: 1024 bytes in per request
    try:
        beat = worker._heartbeat()
        capacity = beat.capacity
        assert [nbytes for _, nbytes in beat.standing_slots] == [1024] * capacity
        assert len({addr for addr, _ in beat.standing_slots}) == capacity
        assert beat.standing_bytes == 1024 * capacity == beat.pool_bytes - beat.free_bytes
    finally:
        worker.transport.close()


def test_a_transfer_engine_or_pool_that_cannot_start_stops_the_worker_in_one_line(monkeypatch):
    """What Mooncake refuses once the model has loaded (its engine's start, the pool's registration: a
    memlock limit under RDMA) is a ConfigError with Mooncake's words, printed as one line, not a traceback.
    Mooncake is made to refuse here (the real engine starts on any local address)."""
    import triptych_worker.transfer.start as start
    from triptych.config import ConfigError

    def refuses(*args: object, **kwargs: object) -> None:
        raise TransferError("Mooncake could not register 4194304 bytes at 0x1000 (return code -1)")

    monkeypatch.setattr(start, "TransferPool", refuses)
    with pytest.raises(ConfigError, match=r"^Mooncake could not register 4194304 bytes"):
        make_worker()


def test_no_start_up_slot_is_larger_than_the_pool_leaves_room_for(tmp_path):
    """A pool that cannot keep a slot and still stage outputs and take one more reserves none."""
    argv = ["serve", "--model-path", "m", "--disagg-role", "denoiser", "--disagg-server-addr", "tcp://127.0.0.1:1",
            "--device", "cpu", "--disagg-transfer-pool-size", "4MiB"]  # fmt: skip
    args = ServeArgs.from_namespace(build_parser().parse_args(argv))
    worker = Worker(args, pipeline=NullPipeline(Role.DENOISER, 3 << 20))  # type: ignore[arg-type]
    try:
        assert worker._heartbeat().standing_slots == () and worker.pool.free_bytes == worker.pool.pool_bytes
    finally:
        worker.transport.close()


def test_kept_slot_survives_its_request_and_is_dropped_when_the_head_changes():
    worker = make_worker()
    link = RecordingLink()
    startup = worker.pool.pool_bytes - worker.pool.free_bytes  # the start-up slots
    try:
        worker._on_message(link, ping("head-1"))  # type: ignore[arg-type]
        slots.allocate(worker, link, TransferAlloc("r1", "w", 1 << 20, standing=True))  # type: ignore[arg-type]
        allocated = link.sent[-1]
        assert isinstance(allocated, TransferAllocated) and allocated.standing
        worker._on_message(link, _encoded(CancelWork("r1", "w")))  # type: ignore[arg-type]
        assert worker.pool.free_bytes == worker.pool.pool_bytes - startup - (1 << 20), (
            "a standing slot outlives its request"
        )
        worker._on_message(link, ping("head-1"))  # type: ignore[arg-type]
        assert worker.pool.free_bytes < worker.pool.pool_bytes - startup
        worker._on_message(link, ping("head-2"))  # type: ignore[arg-type]  # a restarted head never heard of it
        # Everything the old head knew is dropped; the new head gets fresh start-up slots only.
        assert worker.pool.free_bytes == worker.pool.pool_bytes - startup
        assert worker._heartbeat().standing_bytes == startup
        assert allocated.addr not in {addr for addr, _ in worker._heartbeat().standing_slots}
    finally:
        worker.transport.close()


def test_a_new_head_gets_a_fully_free_pool_and_hears_which_requests_were_dropped():
    worker = make_worker()
    link = RecordingLink()
    startup = worker.pool.pool_bytes - worker.pool.free_bytes  # the start-up slots, reserved anew for head-2
    try:
        worker._on_message(link, _encoded(Ping("w", head_id="head-1")))  # type: ignore[arg-type]
        slots.allocate(worker, link, TransferAlloc("reserved", "w", 4096))  # type: ignore[arg-type]
        slots.allocate(worker, link, TransferAlloc("kept", "w", 4096, standing=True))  # type: ignore[arg-type]
        staged = worker.pool.allocate(4096, owner="staged")  # an output waiting for its transfer_push
        with worker._lock:
            worker._staged["staged"] = StagedTensors(staged, [])
        queued_input = worker.pool.allocate(4096, owner="queued")
        worker._enqueue(Job("queued", GenerationParams("x", 8, 8), (queued_input, [], {})))
        assert worker.pool.free_bytes < worker.pool.pool_bytes - startup

        link.sent.clear()
        worker._on_message(link, _encoded(Ping("w", head_id="head-2")))  # type: ignore[arg-type]

        assert worker.pool.free_bytes == worker.pool.pool_bytes - startup
        failed = sorted(m.request_id for m in link.sent if isinstance(m, Failed))
        assert failed == ["kept", "queued", "reserved", "staged"]
        beat = link.sent[-1]
        assert isinstance(beat, Heartbeat) and beat.head_id == "head-2"
        assert beat.free_bytes + beat.standing_bytes == beat.pool_bytes and beat.standing_bytes == startup
        assert not worker._queue and not worker._outstanding
    finally:
        worker.transport.close()


def test_outputs_sent_in_place_are_let_go_when_their_request_is_cancelled_or_its_head_replaced():
    """Outputs waiting for their push where they are (no pool bytes): a cancel, or a new head that
    knows nothing of them, unregisters them, so their memory is the allocator's again."""
    worker = make_worker()
    link = RecordingLink()
    try:
        worker._on_message(link, _encoded(Ping("w", head_id="head-1")))  # type: ignore[arg-type]
        free = worker.pool.free_bytes
        staged = {
            rid: stage_in_place(worker.transport, {"latents": torch.randn(4096)}, worker.pool.pool_bytes)
            for rid in ("a", "b")
        }
        with worker._lock:
            for rid, outputs in staged.items():
                assert outputs is not None
                worker._staged[rid] = outputs
        assert worker.pool.free_bytes == free
        worker._cancel("a")
        assert staged["a"].released and not staged["b"].released  # type: ignore[union-attr]
        worker._on_message(link, _encoded(Ping("w", head_id="head-2")))  # type: ignore[arg-type]
        assert staged["b"].released and not worker._staged  # type: ignore[union-attr]
        assert sorted(m.request_id for m in link.sent if isinstance(m, Failed)) == ["b"]
    finally:
        worker.transport.close()


def test_a_resume_in_place_for_outputs_sent_in_place_fails_and_leaves_them_staged():
    """TransferReady in_place names a continuation staged in the pool; outputs sent in place are not
    a slot to run on: the request fails, and they stay staged (registered, held) for their push or
    cancel to release, never dropped with their registration in place."""
    worker = make_worker()
    link = RecordingLink()
    try:
        outputs = in_place_outputs(worker, staged_as="r")
        ready = TransferReady("r", "w", GenerationParams("x", 8, 8), outputs.manifest, {}, in_place=True)
        slots.ready(worker, link, ready)  # type: ignore[arg-type]
        assert [m.error for m in link.sent if isinstance(m, Failed)] == [
            "transfer_ready for a continuation this worker has not staged"
        ]
        assert worker._staged["r"] is outputs and not outputs.released
        worker._cancel("r")
        assert outputs.released
    finally:
        worker.transport.close()


class _EndedWrite:
    """A Mooncake write as check_pushes sees it once it has ended with `error`."""

    def __init__(self, error: Exception):
        self.error = error

    def done(self) -> bool:
        raise self.error

    def elapsed(self) -> float:
        return 1.0


@pytest.mark.parametrize(
    ("error", "kept"),
    [(TransferStalled("did not finish in 120s"), True), (TransferError("the peer refused it"), False)],
    ids=["stalled: may still read", "failed: read no more"],
)
def test_outputs_sent_in_place_are_kept_while_a_failed_write_may_still_read_them(error, kept):
    """A stalled write may go on reading the tensors it was given: they stay registered and held
    (_unfinished_sends) rather than freed under the engine; a write that failed outright lets them go.
    The head hears which it was (write_pending keeps the receiver's slot out of use)."""
    worker = make_worker()
    link = RecordingLink()
    try:
        outputs = in_place_outputs(worker)
        worker._pushes.append(pushes.Push("r", outputs, _EndedWrite(error)))  # type: ignore[arg-type]
        pushes.check_pushes(worker, link)  # type: ignore[arg-type]
        (failed,) = [m for m in link.sent if isinstance(m, Failed)]
        assert failed.request_id == "r" and failed.write_pending is kept and str(error) in failed.error
        assert outputs.released is not kept
        assert (outputs in worker._unfinished_sends) is kept
        assert not worker._pushes
    finally:
        worker.transport.close()


@pytest.mark.parametrize(
    ("error", "kept"),
    [
        (TransferStalled("Mooncake tcp write could not start all its ranges, and 1 under way may still write"), True),
        (TransferError("Mooncake tcp write of 16384 bytes could not start"), False),
    ],
    ids=["a range under way: may still read", "nothing started: read no more"],
)
def test_outputs_sent_in_place_whose_write_could_not_start_are_kept_only_while_a_range_may_read_them(
    monkeypatch, error, kept
):
    """A write of several ranges can fail after its first range was submitted (TransferStalled): its
    outputs are kept. One that started nothing frees them (they used to be kept for the worker's life,
    one push's outputs per receiver gone before its write)."""
    worker = make_worker()
    link = RecordingLink()
    try:
        outputs = in_place_outputs(worker, staged_as="r")

        def refused(session: str, addr: int) -> None:
            raise error

        monkeypatch.setattr(outputs, "submit_write", refused)
        pushes.start_push(worker, link, TransferPush("r", "w", dest_session="127.0.0.1:1", dest_addr=4096))  # type: ignore[arg-type]
        (failed,) = [m for m in link.sent if isinstance(m, Failed)]
        assert failed.request_id == "r" and "could not start" in failed.error and failed.write_pending is kept
        assert outputs.released is not kept and (worker._unfinished_sends == [outputs]) is kept
        assert "r" not in worker._staged
    finally:
        worker.transport.close()


def test_a_queued_request_the_computing_thread_takes_at_once_leaves_no_load_behind(monkeypatch):
    """A request that arrives while another computes is handed to the input loader before it is
    queued: the computing thread may take it the moment it is queued (here, at once) and must find
    its load there. Handed over after, the loader would copy a slot already freed, and count that
    load ahead for ever (no more loading ahead, its tensors held)."""
    worker = make_worker()
    worker.inputs.in_place = False  # inputs copied out of their slot, as on a GPU worker
    worker.inputs.start()
    link = RecordingLink()
    try:
        slots.allocate(worker, link, TransferAlloc("r", "w", 1024))  # type: ignore[arg-type]
        worker._computing = True  # a request ahead of it computes
        taken = []
        queue = worker._enqueue

        def queued_then_taken(*jobs: Job) -> None:
            queue(*jobs)
            taken.append(worker.inputs.take(jobs[0], link))  # type: ignore[arg-type]

        monkeypatch.setattr(worker, "_enqueue", queued_then_taken)
        manifest = [{"name": "x", "dtype": "uint8", "shape": [1024], "offset": 0}]
        slots.ready(worker, link, TransferReady("r", "w", GenerationParams("x", 16, 16), manifest, {}))  # type: ignore[arg-type]
        time.sleep(0.3)  # the loader acts on whatever it was handed
        assert len(taken) == 1 and taken[0].tensors["x"].shape == (1024,)
        with worker.inputs._cond:
            assert worker.inputs._ready == 0 and "r" not in worker.inputs._loads
    finally:
        worker.inputs.stop()
        worker.transport.close()


def in_place_outputs(worker: Worker, staged_as: str | None = None) -> InPlaceTensors:
    """A latents tensor registered to be sent where it is, as compute.py stages a CPU stage's outputs
    (held as request `staged_as`'s staged outputs when given)."""
    outputs = stage_in_place(worker.transport, {"latents": torch.randn(4096)}, worker.pool.pool_bytes)
    assert outputs is not None
    if staged_as is not None:
        with worker._lock:
            worker._staged[staged_as] = outputs
    return outputs


def test_a_push_into_a_slot_smaller_than_the_outputs_fails_without_writing():
    """The head names the receiver's slot size: outputs that do not fit (a head's bug, a forged size)
    would overwrite what lies past the slot in the receiver's pool. The push fails its request and
    frees the outputs; no write starts."""
    worker = make_worker()
    link = RecordingLink()
    try:
        outputs = in_place_outputs(worker, staged_as="r")
        push = TransferPush("r", "w", worker.transport.session_id, worker.pool.base_addr, slot_bytes=outputs.nbytes - 1)
        pushes.start_push(worker, link, push)  # type: ignore[arg-type]
        (failed,) = link.sent
        assert isinstance(failed, Failed) and failed.error == (
            f"transfer_push: {outputs.nbytes} bytes staged do not fit the receiver's slot of {outputs.nbytes - 1}"
        )
        assert not worker._pushes and "r" not in worker._staged and outputs.released
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


def test_a_message_type_of_a_newer_head_is_dropped_without_failing_its_request():
    """A newer head's HandOff (a message added after this worker's release) at a worker not rolled
    yet failed the request being moved with a 500; what it adds is lost, the request goes on."""
    worker = make_worker()
    link = RecordingLink()
    try:
        newer = msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": "hand_off_v9", "request_id": "r1",
                                        "instance": "w"})  # fmt: skip
        worker._on_message(link, [newer])  # type: ignore[arg-type]
        assert link.sent == []
        garbled = msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": "cancel_work", "request_id": "r2"})
        worker._on_message(link, [garbled])  # type: ignore[arg-type]  # a known message, malformed
        (failed,) = link.sent
        assert isinstance(failed, Failed) and failed.request_id == "r2" and "malformed message" in failed.error
    finally:
        worker.transport.close()


def test_steps_are_reported_only_when_the_head_asks_for_them():
    worker = make_worker()
    params = GenerationParams("x", width=16, height=16, num_inference_steps=3)
    try:
        for progress, expected_steps in ((False, []), (True, [1, 2, 3])):
            link = RecordingLink()
            compute.compute(worker, link, [Job(f"r-{progress}", params, progress=progress)])  # type: ignore[arg-type]
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
        self.inputs: list[dict[str, torch.Tensor]] = []  # each job's incoming tensors, in that order
        self.running = 0
        self.max_running = 0

    def validate(self, params: object) -> None:
        pass

    def run(self, batch: object) -> object:
        rid = batch.params.prompt  # type: ignore[attr-defined]
        self.runs.append((rid, threading.current_thread().name))
        self.inputs.append(dict(batch.tensors))  # type: ignore[attr-defined]
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            assert self.gates[rid].wait(30), f"gate of {rid} never opened"
        finally:
            self.running -= 1
        batch.tensors = {"latents": torch.zeros(16, dtype=torch.uint8)}  # type: ignore[attr-defined]
        return batch


@dataclass
class ServedWorker:
    """A worker serving on real sockets in this process, gated stages, and the head's two ends of them."""

    worker: Worker
    pipeline: GatedPipeline
    work: zmq.Socket  # the head's PUSH to the worker's work socket
    results: zmq.Socket  # the head's denoiser result port

    def start_first(self, rid: str, params: dict[str, object]) -> None:
        """Send `rid`'s Work and return once its (gated) stage runs, holding its thread."""
        self.work.send_multipart(encode(Work(rid, "w", {**params, "prompt": rid})))  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while not self.pipeline.runs and time.monotonic() < deadline:
            time.sleep(0.01)

    def next_message(self, kind: type) -> object:
        """The next message of `kind` the worker sends the head (others skipped)."""
        while True:
            msg, _ = decode(self.results.recv_multipart())  # zmq.Again after 10 s fails the test
            if isinstance(msg, kind):
                return msg


@contextmanager
def served_worker(*flags: str, pipeline: GatedPipeline | None = None) -> Iterator[ServedWorker]:
    """A denoiser with GatedPipeline stages serving until the block ends (every gate opened then)."""
    base = free_port_block(8)
    argv = ["serve", "--model-path", "m", "--disagg-role", "denoiser", "--device", "cpu",
            "--disagg-server-addr", f"tcp://127.0.0.1:{base}", "--scheduler-port", str(base + 6),
            "--disagg-transfer-pool-size", "4MiB", *flags]  # fmt: skip
    args = ServeArgs.from_namespace(build_parser().parse_args(argv))
    pipeline = pipeline or GatedPipeline()
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
    try:
        yield ServedWorker(worker, pipeline, work, results)
    finally:
        for gate in pipeline.gates.values():
            gate.set()
        worker.stop()
        serving.join(timeout=10)
        work.close()
        results.close()
    assert not serving.is_alive()


def test_a_computing_worker_keeps_answering_and_runs_queued_work_in_order_one_at_a_time():
    """Real sockets: while one job runs, the other thread leads (answers pings and allocations);
    work that arrives meanwhile runs after it, in order, never two at once."""
    params = {"width": 16, "height": 16, "num_inference_steps": 1}
    with served_worker() as w:
        pipeline, work = w.pipeline, w.work
        for rid in ("r1", "r2", "r3"):
            pipeline.gates[rid] = threading.Event()
        w.start_first("r1", params)
        assert [r for r, _ in pipeline.runs] == ["r1"]
        # r1 blocks its thread; the other one leads: pings and allocations are answered at once.
        work.send_multipart(encode(Ping("w", "head-1")))
        assert isinstance(w.next_message(Heartbeat), Heartbeat)
        work.send_multipart(encode(TransferAlloc("r9", "w", 4096)))
        assert w.next_message(TransferAllocated).request_id == "r9"  # type: ignore[attr-defined]
        work.send_multipart(encode(Work("r2", "w", {**params, "prompt": "r2"})))
        work.send_multipart(encode(Work("r3", "w", {**params, "prompt": "r3"})))
        time.sleep(0.2)
        assert [r for r, _ in pipeline.runs] == ["r1"], "queued work must wait for the running job"
        for rid in ("r1", "r2", "r3"):
            pipeline.gates[rid].set()
            assert w.next_message(TransferStaged).request_id == rid  # type: ignore[attr-defined]
        assert [r for r, _ in pipeline.runs] == ["r1", "r2", "r3"]
        assert pipeline.max_running == 1
        # The thread that finished r1 ran the queue; the one that led meanwhile never computed.
        assert len({thread for _, thread in pipeline.runs}) == 1


@pytest.mark.parametrize("resume", [1, {}, {"step": "3"}, {"step": -1}, [2]])
def test_a_malformed_continuation_fails_its_own_request_on_a_batching_worker(resume):
    """Real sockets, --batching-max-size 2: a transfer_ready whose meta names a continuation without
    a step (another worker's message, passed on by the head) fails that request, naming the field;
    the worker goes on, the requests queued beside it run, and its slot is freed."""
    params = {"width": 16, "height": 16, "num_inference_steps": 1}
    manifest = [{"name": "x", "dtype": "uint8", "shape": [16], "offset": 0}]
    with served_worker("--batching-max-size", "2") as w:
        pipeline, work = w.pipeline, w.work
        for rid in ("r1", "bad", "r3"):
            pipeline.gates[rid] = threading.Event()
        w.start_first("r1", params)
        for rid, meta in (("bad", {"resume": resume}), ("r3", {})):  # queued behind r1
            work.send_multipart(encode(TransferAlloc(rid, "w", 4096)))
            assert w.next_message(TransferAllocated).request_id == rid  # type: ignore[attr-defined]
            ready = TransferReady(rid, "w", {**params, "prompt": rid}, manifest, meta)  # type: ignore[arg-type]
            work.send_multipart(encode(ready))
        pipeline.gates["r1"].set()
        pipeline.gates["r3"].set()
        reports: dict[str, object] = {}
        while len(reports) < 3:
            msg, _ = decode(w.results.recv_multipart())
            if isinstance(msg, (TransferStaged, Failed)):
                reports[msg.request_id] = msg
        failed = reports["bad"]
        assert isinstance(failed, Failed) and "meta.resume" in failed.error and "'step'" in failed.error
        assert isinstance(reports["r1"], TransferStaged) and isinstance(reports["r3"], TransferStaged)
        assert [r for r, _ in pipeline.runs] == ["r1", "r3"]
        deadline = time.monotonic() + 10
        while w.worker.pool.free_bytes != w.worker.pool.pool_bytes - w.worker.pool.reserved_bytes(
            list(w.worker._standing.values())
        ):
            assert time.monotonic() < deadline, "the failed request's slot was never freed"
            time.sleep(0.01)
        work.send_multipart(encode(Ping("w", "head-1")))
        assert isinstance(w.next_message(Heartbeat), Heartbeat)  # still serving


def test_a_group_the_head_resized_runs_without_waiting_for_the_member_it_lost(monkeypatch):
    """Real sockets, --batching-max-size 2: b arrives as one of a group of two; the head then says the
    group is one (a was lost on its way: BatchResized), and b runs, where it waited the assembly time
    (here made a minute: the test would end first) for a. Another head's resize changes nothing."""
    monkeypatch.setattr("triptych_worker.runtime.BATCH_ASSEMBLY_S", 60.0)
    params = {"width": 16, "height": 16, "num_inference_steps": 1, "prompt": "b"}
    manifest = [{"name": "x", "dtype": "uint8", "shape": [16], "offset": 0}]
    with served_worker("--batching-max-size", "2") as w:
        w.pipeline.gates["b"] = threading.Event()
        w.pipeline.gates["b"].set()
        w.work.send_multipart(encode(TransferAlloc("b", "w", 4096)))
        assert w.next_message(TransferAllocated).request_id == "b"  # type: ignore[attr-defined]
        ready = TransferReady("b", "w", params, manifest, {}, batch_id="a", batch_size=2)  # type: ignore[arg-type]
        w.work.send_multipart(encode(ready))
        w.work.send_multipart(encode(BatchResized("other", "w", 1)))  # another group's
        w.work.send_multipart(encode(Ping("w", "head-1")))
        assert isinstance(w.next_message(Heartbeat), Heartbeat)  # every message above was handled
        assert w.pipeline.runs == [], "b waits for the rest of its group"
        resized = time.monotonic()
        w.work.send_multipart(encode(BatchResized("a", "w", 1)))
        staged = w.next_message(TransferStaged)
        assert staged.request_id == "b" and [r for r, _ in w.pipeline.runs] == ["b"]  # type: ignore[attr-defined]
        assert time.monotonic() - resized < 30, "b waited for the assembly time, not for the resize"


class LargeMetaPipeline(GatedPipeline):
    """Outputs whose meta, for a request named "big", is as large as the control header limit."""

    def run(self, batch: object) -> object:
        super().run(batch)
        if batch.params.prompt == "big":  # type: ignore[attr-defined]
            batch.meta["blob"] = "m" * MAX_HEADER_BYTES  # type: ignore[attr-defined]
        return batch


def test_outputs_whose_report_is_over_the_header_limit_fail_their_request_and_the_worker_goes_on():
    """Real sockets: a transfer_staged over the limit (the head would drop it unread, and the request
    wait for its timeout) is not sent; the request fails at once naming its size and the meta's, its
    outputs are freed when the head cancels it, and the next request runs as usual."""
    params = {"width": 16, "height": 16, "num_inference_steps": 1}
    with served_worker(pipeline=LargeMetaPipeline()) as w:
        pool = w.worker.pool
        idle = pool.free_bytes
        for rid in ("big", "next"):
            w.pipeline.gates[rid] = threading.Event()
            w.pipeline.gates[rid].set()
        w.work.send_multipart(encode(Work("big", "w", {**params, "prompt": "big"})))  # type: ignore[arg-type]
        failed = w.next_message(Failed)  # nothing over the limit came first: decode would have refused it
        assert isinstance(failed, Failed) and failed.request_id == "big" and failed.status_code == 500
        assert failed.error.startswith("transfer_staged for request big is ")
        assert f"over the {MAX_HEADER_BYTES}-byte ({MAX_HEADER_BYTES >> 20} MiB) control header limit" in failed.error
        meta = len(msgspec.msgpack.encode({"blob": "m" * MAX_HEADER_BYTES}))
        assert re.search(rf"outputs manifest/meta is too large \(manifest \d+ bytes, meta {meta} bytes\)", failed.error)
        w.work.send_multipart(encode(CancelWork("big", "w")))  # what the head does for a failed request
        deadline = time.monotonic() + 10
        while "big" in w.worker._staged or pool.free_bytes != idle:
            assert time.monotonic() < deadline, "the failed request's outputs were never freed"
            time.sleep(0.01)

        w.work.send_multipart(encode(Work("next", "w", {**params, "prompt": "next"})))  # type: ignore[arg-type]
        staged = w.next_message(TransferStaged)
        assert staged.request_id == "next"  # type: ignore[attr-defined]


# --- drain (SIGTERM) ---------------------------------------------------------------------------


def test_a_draining_worker_says_so_in_every_heartbeat():
    worker = make_worker()
    try:
        assert worker._heartbeat().draining is False
        worker.begin_drain()  # what the SIGTERM handler does
        assert worker._heartbeat().draining is True
        assert worker._heartbeat().draining is True
    finally:
        worker.transport.close()


def test_a_drain_ends_once_acknowledged_and_the_held_request_is_computed_and_pushed(caplog):
    """Acknowledged early, the worker still runs the request it holds and pushes its output before it stops."""
    worker = make_worker()
    link = RecordingLink()
    peer = MooncakeTransport("127.0.0.1")
    peer_pool = TransferPool(1 << 20, "decoder", peer, memory="numpy")
    params = GenerationParams("x", width=16, height=16, num_inference_steps=1)
    caplog.set_level(logging.INFO, logger="triptych_worker")
    try:
        worker._on_message(link, _encoded(Ping("w", head_id="h")))  # type: ignore[arg-type]
        worker._on_message(link, _encoded(Work("r1", "w", params)))  # type: ignore[arg-type]
        worker.begin_drain()
        worker._on_message(link, _encoded(Ping("w", head_id="h", drain_acknowledged=True)))  # type: ignore[arg-type]
        assert worker._drain is not None and worker._drain.acknowledged
        assert not drain.drain_over(worker, time.monotonic())
        assert drain.held_summary(worker) == "1 job"

        jobs = worker._take_jobs()
        assert [job.request_id for job in jobs] == ["r1"]
        compute.compute(worker, link, jobs)
        assert worker._next_jobs() == []
        staged = link.sent[-1]
        assert isinstance(staged, TransferStaged) and staged.request_id == "r1"
        assert drain.held_summary(worker) == "1 staged output"
        assert not drain.drain_over(worker, time.monotonic())

        slot = peer_pool.allocate(staged.nbytes, "r1")
        assert slot is not None
        peer_pool.view(slot)[:] = 0xFF
        push = TransferPush("r1", "w", dest_session=peer.session_id, dest_addr=slot.addr)
        worker._on_message(link, _encoded(push))  # type: ignore[arg-type]
        assert drain.held_summary(worker) == "1 push"
        assert not drain.drain_over(worker, time.monotonic()), "a push under way is held"
        deadline = time.monotonic() + 10
        while worker._pushes and time.monotonic() < deadline:
            pushes.check_pushes(worker, link)
            time.sleep(0.001)
        assert isinstance(link.sent[-1], TransferPushed) and link.sent[-1].request_id == "r1"
        assert not peer_pool.view(slot).any(), "the simulated denoiser's zeros landed in the receiver's slot"
        assert drain.drain_over(worker, time.monotonic())
        assert "draining: 1 job left" in caplog.text and "draining: 1 push left" in caplog.text
    finally:
        worker.transport.close()
        peer.close()


def test_an_unacknowledged_drain_ends_when_the_idle_worker_hears_no_head_or_when_time_is_up(caplog):
    worker = make_worker()
    link = RecordingLink()
    caplog.set_level(logging.INFO, logger="triptych_worker")
    try:
        worker._on_message(link, _encoded(Ping("w", head_id="h")))  # type: ignore[arg-type]
        worker.begin_drain()
        drain.start_drain(worker)
        now = time.monotonic()
        head_gone = 3 * worker.args.disagg_heartbeat_timeout
        assert not drain.drain_over(worker, now), "idle but not acknowledged, and the head still pings"
        assert drain.drain_over(worker, now + head_gone + 0.1), "idle and no ping for three heartbeat timeouts"

        params = GenerationParams("x", width=16, height=16, num_inference_steps=1)
        worker._on_message(link, _encoded(Work("r1", "w", params)))  # type: ignore[arg-type]
        assert not drain.drain_over(worker, now + head_gone + 0.1), "a worker holding work waits for its head"
        assert worker._drain is not None
        assert drain.drain_over(worker, worker._drain.deadline)
        assert "drain timed out after 600s (--disagg-drain-timeout); abandoning 1 job" in caplog.text
    finally:
        worker.transport.close()


def test_an_acknowledgement_counts_only_for_the_head_that_gave_it():
    worker = make_worker()
    link = RecordingLink()
    try:
        worker._on_message(link, _encoded(Ping("w", head_id="h1")))  # type: ignore[arg-type]
        worker.begin_drain()
        worker._on_message(link, _encoded(Ping("w", head_id="h1", drain_acknowledged=True)))  # type: ignore[arg-type]
        assert worker._drain is not None and worker._drain.acknowledged
        worker._on_message(link, _encoded(Ping("w", head_id="h2")))  # type: ignore[arg-type]
        assert not worker._drain.acknowledged, "a restarted head has not seen the drain"
        assert not drain.drain_over(worker, time.monotonic())
    finally:
        worker.transport.close()


def test_an_acknowledgement_to_a_worker_that_is_not_draining_changes_nothing():
    worker = make_worker()
    link = RecordingLink()
    try:
        worker._on_message(link, _encoded(Ping("w", head_id="h", drain_acknowledged=True)))  # type: ignore[arg-type]
        assert worker._drain is None and not worker._heartbeat().draining
    finally:
        worker.transport.close()


@pytest.mark.parametrize("load_ahead", [1, 0])
def test_the_next_requests_inputs_leave_their_slot_while_the_current_one_computes(load_ahead):
    """Real sockets, --disagg-load-ahead: with 1, r2's inputs are copied out (its slot freed for the
    next transfer) while r1 still computes; with 0, only once r1 is done. Either way r2 gets its
    bytes exactly."""
    with served_worker("--disagg-load-ahead", str(load_ahead)) as w:
        worker, pipeline = w.worker, w.pipeline

        def deliver(rid: str, value: int) -> None:
            """What a sender and the head do: a slot, the bytes written into it, transfer_ready."""
            w.work.send_multipart(encode(TransferAlloc(rid, "w", 1 << 20)))
            allocated = w.next_message(TransferAllocated)
            assert allocated.request_id == rid  # type: ignore[attr-defined]
            offset = allocated.addr - worker.pool.base_addr  # type: ignore[attr-defined]
            worker.pool.buffer[offset : offset + 4096] = value  # the sender's Mooncake write, in place
            manifest = [{"name": "x", "dtype": "uint8", "shape": [4096], "offset": 0}]
            params = {"width": 16, "height": 16, "num_inference_steps": 1, "prompt": rid}
            w.work.send_multipart(encode(TransferReady(rid, "w", params, manifest, {})))  # type: ignore[arg-type]

        pipeline.gates.update(r1=threading.Event(), r2=threading.Event())
        deliver("r1", 1)
        deadline = time.monotonic() + 10
        while not pipeline.runs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r for r, _ in pipeline.runs] == ["r1"]
        deliver("r2", 2)  # queued behind r1, which computes until its gate opens
        held = worker.pool.pool_bytes - (1 << 20)  # r2's slot taken, r1's freed when r1 started
        deadline = time.monotonic() + 10
        while worker.pool.free_bytes == held and load_ahead and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # without load-ahead nothing should change meanwhile
        if load_ahead:
            assert worker.pool.free_bytes == worker.pool.pool_bytes, "r2's slot is freed while r1 computes"
        else:
            assert worker.pool.free_bytes == held, "without load-ahead r2's slot is held until r1 is done"
        assert [r for r, _ in pipeline.runs] == ["r1"]
        for rid in ("r1", "r2"):
            pipeline.gates[rid].set()
            assert w.next_message(TransferStaged).request_id == rid  # type: ignore[attr-defined]
        assert [bytes(t["x"][:2].numpy()) for t in pipeline.inputs] == [b"\x01\x01", b"\x02\x02"]
        assert all(t["x"].shape == (4096,) and t["x"].unique().numel() == 1 for t in pipeline.inputs)


class InPlaceGatedPipeline(GatedPipeline):
    """GatedPipeline stages that use their inputs in place (views on the receive slot): each reports
    a step, reads its input while its gate is closed, and fails when its prompt is in `fail`."""

    reads_inputs_in_place = True

    def __init__(self) -> None:
        super().__init__()
        self.fail: set[str] = set()
        self.seen: dict[str, bytes] = {}  # each job's input bytes, read after its gate opened

    def run(self, batch: object) -> object:
        rid = batch.params.prompt  # type: ignore[attr-defined]
        x = batch.tensors["x"]  # type: ignore[attr-defined]
        self.inputs.append(dict(batch.tensors))  # type: ignore[attr-defined]  # before the step the test waits for
        batch.report_progress(1, 1)  # type: ignore[attr-defined]
        assert self.gates[rid].wait(30), f"gate of {rid} never opened"
        self.seen[rid] = bytes(x.numpy())  # still the sender's bytes: the slot is held until the stage ends
        if rid in self.fail:
            raise RuntimeError(f"{rid} fails on purpose")
        batch.tensors = {"latents": torch.zeros(16, dtype=torch.uint8)}  # type: ignore[attr-defined]
        return batch


def test_inputs_used_in_place_hold_their_slot_until_the_stage_is_done_also_on_cancel_and_failure():
    """Real sockets, a CPU denoiser whose stages use their inputs in place: each job's slot stays
    allocated while its stage runs (a cancel meanwhile frees it when the stage stops), and is free
    before the head hears the stage ended; its Progress tells the head the slot is still busy."""
    pipeline = InPlaceGatedPipeline()
    with served_worker(pipeline=pipeline) as w:
        worker, pool = w.worker, w.worker.pool
        assert worker.inputs.in_place

        def deliver(rid: str, value: int) -> None:
            w.work.send_multipart(encode(TransferAlloc(rid, "w", 1 << 20)))
            allocated = w.next_message(TransferAllocated)
            offset = allocated.addr - pool.base_addr  # type: ignore[attr-defined]
            pool.buffer[offset : offset + 4096] = value  # the sender's Mooncake write, in place
            manifest = [{"name": "x", "dtype": "uint8", "shape": [4096], "offset": 0}]
            params = {"width": 16, "height": 16, "num_inference_steps": 1, "prompt": rid}
            w.work.send_multipart(encode(TransferReady(rid, "w", params, manifest, {}, progress=True)))  # type: ignore[arg-type]

        def until(condition: object, what: str) -> None:
            deadline = time.monotonic() + 10
            while not condition():  # type: ignore[operator]
                assert time.monotonic() < deadline, what
                time.sleep(0.01)

        # Each finished job's outputs (a new CPU tensor) wait for their push where they are: sent in
        # place, they take nothing from the pool (transfer/in_place.py).
        for rid, value, ending in (("r1", 1, "done"), ("r2", 2, "cancelled"), ("r3", 3, "failed")):
            pipeline.gates[rid] = threading.Event()
            if ending == "failed":
                pipeline.fail.add(rid)
            before = pool.free_bytes
            deliver(rid, value)
            assert w.next_message(Progress).inputs_held  # type: ignore[attr-defined]
            view = pipeline.inputs[-1]["x"]
            assert pool.base_addr <= view.data_ptr() < pool.base_addr + pool.pool_bytes, "a view, not a copy"
            if ending == "cancelled":
                w.work.send_multipart(encode(CancelWork(rid, "w")))
                until(lambda rid=rid: worker._is_cancelled(rid), "the cancel reached the worker")  # type: ignore[misc]
            time.sleep(0.1)
            assert pool.free_bytes == before - (1 << 20), f"{rid}'s slot is held while its stage runs"
            pipeline.gates[rid].set()
            if ending == "done":
                w.next_message(TransferStaged)
                assert pool.free_bytes == before, "the slot was given back before the head heard"
                assert isinstance(worker._staged[rid], InPlaceTensors)
            elif ending == "failed":
                assert "fails on purpose" in w.next_message(Failed).error  # type: ignore[attr-defined]
                until(lambda before=before: pool.free_bytes == before, "r3's slot given back after its failure")  # type: ignore[misc]
            else:
                until(lambda before=before: pool.free_bytes == before, "r2's slot given back once its stage stopped")  # type: ignore[misc]
            assert pipeline.seen[rid] == bytes([value]) * 4096


def test_outputs_that_need_the_room_of_the_input_slot_in_use_get_it():
    """A pool that fits one 3 MiB input or one 3 MiB output, not both: the stage that used its input
    in place gives the slot back to stage its outputs (copying any that still view it) instead of
    waiting for room it holds itself."""
    argv = ["serve", "--model-path", "m", "--disagg-role", "denoiser", "--disagg-server-addr", "tcp://127.0.0.1:1",
            "--device", "cpu", "--disagg-transfer-pool-size", "4MiB"]  # fmt: skip
    args = ServeArgs.from_namespace(build_parser().parse_args(argv))
    nbytes = 3 << 20
    worker = Worker(args, pipeline=NullPipeline(Role.DENOISER, nbytes))  # type: ignore[arg-type]
    # Outputs copied into the pool, as over RDMA (on TCP they would go in place, needing no room at all).
    worker.transport.sends_in_place = False
    try:
        assert worker.inputs.in_place
        slot = worker.pool.allocate(nbytes, "r1")
        assert slot is not None
        manifest = [{"name": "x", "dtype": "uint8", "shape": [nbytes], "offset": 0}]
        params = GenerationParams("r1", width=16, height=16, num_inference_steps=1)
        link = RecordingLink()
        running = threading.Thread(
            target=compute.compute, args=(worker, link, [Job("r1", params, (slot, manifest, {}))])
        )
        running.start()
        running.join(timeout=10)
        if running.is_alive():
            worker._stop.set()  # ends the wait for room, so that the failure is reported, not hung
            running.join(timeout=5)
            pytest.fail("the outputs waited for the room their own input slot held")
        assert isinstance(link.sent[-1], TransferStaged) and link.sent[-1].nbytes == nbytes
        assert worker.pool.free_bytes == worker.pool.pool_bytes - nbytes, "only the staged outputs remain"
    finally:
        worker.transport.close()


def test_standing_slots_are_sized_for_inputs_in_the_receiver_s_dtype(tiny_models):
    from triptych.families import read_rules
    from triptych_worker import standing

    flux, wan = str(tiny_models["tiny-flux"]), str(tiny_models["tiny-wan"])
    wide, narrow = (standing.slot_size(None, flux, Role.DENOISER, dtype) for dtype in ("float32", "bfloat16"))
    params = standing.default_params("image")
    embeds = sum(spec.nbytes for spec in read_rules(flux).output_specs(Role.ENCODER, params, "float32"))
    assert wide >= embeds and narrow < wide and narrow >= embeds // 2  # FLUX hands on the model's dtype
    # Wan hands its latents on in float32 whatever the model computes in: the decoder's slot stays
    assert standing.slot_size(None, wan, Role.DECODER, "bfloat16") == standing.slot_size(None, wan, Role.DECODER)


def _latents_manifest(worker: Worker) -> bytes:
    """A manifest of one 1 KiB `latents` tensor, as a sender lays it out."""
    from triptych_worker.transfer import stage_tensors

    staged = stage_tensors(worker.pool, {"latents": np.ones(256, np.float32)}, owner="layout")
    assert staged is not None
    worker.pool.free(staged.allocation)
    return staged.manifest


def test_a_hop_cancelled_here_and_dispatched_here_again_runs_and_reports():
    """The head gave up on this receiver (heartbeats late), cancelled the slot it then answered late,
    and once the receiver was back dispatched the same hop, the same id, here again: it runs, where the
    memory of the cancel used to skip it without a word and the head waited its whole timeout."""
    worker, link = make_worker(), RecordingLink()
    try:
        worker._on_message(link, ping("head-1"))
        worker._on_message(link, _encoded(TransferAlloc("x", "w", 1024)))  # answered late: the head cancels it
        worker._on_message(link, _encoded(CancelWork("x", "w")))
        worker._on_message(link, _encoded(TransferAlloc("x", "w", 1024)))
        assert isinstance(link.sent[-1], TransferAllocated), link.sent[-1]
        params = GenerationParams("x", 16, 16, num_inference_steps=1)
        worker._on_message(link, _encoded(TransferReady("x", "w", params, _latents_manifest(worker), {})))
        link.sent.clear()
        compute.compute(worker, link, worker._take_jobs())
        reports = [m for m in link.sent if not isinstance(m, Heartbeat)]
        assert [type(m) for m in reports] == [TransferStaged], reports
    finally:
        worker.transport.close()


def test_work_dispatched_again_while_its_cancelled_run_still_stops_here_is_refused_for_the_head_to_retry():
    worker, link = make_worker(), RecordingLink()
    try:
        worker._on_message(link, ping("head-1"))
        params = GenerationParams("x", 16, 16, num_inference_steps=1)
        worker._on_message(link, _encoded(Work("x", "w", params)))
        worker._on_message(link, _encoded(CancelWork("x", "w")))  # the run is still queued
        link.sent.clear()
        worker._on_message(link, _encoded(Work("x", "w", params)))
        (refused,) = [m for m in link.sent if not isinstance(m, Heartbeat)]
        assert isinstance(refused, WorkRefused) and "still stopping" in refused.reason, refused
        assert [job.request_id for job in worker._queue] == ["x"]  # the cancelled one, which compute skips
        compute.compute(worker, link, worker._take_jobs())
        assert worker._next_jobs() == []  # the computing thread is done with it
        worker._on_message(link, _encoded(Work("x", "w", params)))  # gone now: the next one runs
        link.sent.clear()
        compute.compute(worker, link, worker._take_jobs())
        assert [type(m) for m in link.sent if not isinstance(m, Heartbeat)] == [TransferStaged], link.sent
    finally:
        worker.transport.close()


def test_a_request_readied_on_a_standing_slot_frees_the_slot_of_its_own_earlier_alloc():
    """TransferAlloc(b) answered with a slot of its own, then b's inputs pushed into a standing slot
    (the head lost this worker and found it again meanwhile): b's own slot is freed, not left in the
    pool for ever."""
    worker, link = make_worker(), RecordingLink()
    try:
        worker._on_message(link, ping("head-1"))
        free = worker.pool.free_bytes
        standing = next(iter(worker._standing.values()))
        worker._on_message(link, _encoded(TransferAlloc("b", "w", 1024)))  # not a standing one
        assert worker.pool.free_bytes < free
        worker.pool.view(standing)[:1024] = np.ones(256, np.float32).view(np.uint8)  # the push, into the standing slot
        params = GenerationParams("b", 16, 16, num_inference_steps=1)
        worker._on_message(
            link, _encoded(TransferReady("b", "w", params, _latents_manifest(worker), {}, standing.addr))
        )
        compute.compute(worker, link, worker._take_jobs())
        worker.free_staged(worker._staged.pop("b"))  # its push ended
        assert worker.pool.free_bytes == free
    finally:
        worker.transport.close()


def test_a_member_of_a_batch_asked_to_hand_off_is_reported_at_its_step_not_after_the_group_s_last():
    """Three requests denoised as one batch, the second asked to hand off after step 2: its state is
    staged and reported right there, while the other two run their remaining steps as a batch of two
    and report at their end (it used to wait for them, then run the same steps again elsewhere)."""
    from triptych_worker.batching import run_merged

    events: list[tuple[Any, ...]] = []
    steps = 8

    class BatchingNull(NullPipeline):
        hands_off = True

        def run_many(self, batches: list[StageBatch]) -> list[Exception | None]:
            for batch in batches:
                batch.tensors = {"latents": torch.zeros(batch.params.num_outputs, 4)}

            def loop(merged: StageBatch) -> None:
                first = merged.meta.pop(RESUME, {"step": 0})["step"]
                latents = merged.tensors["latents"]
                for i in range(first, steps):
                    if merged.should_hand_off():
                        merged.tensors, merged.meta[RESUME] = {"latents": latents}, {"step": i}
                        return
                    latents = latents + 1
                    events.append(("step", i + 1, latents.shape[0]))
                    merged.report_progress(i + 1, steps, latents)
                merged.tensors = {"latents": latents}

            return run_merged(batches, frozenset(), loop)

    class Link(RecordingLink):
        def send(self, msg: object, frames: object = ()) -> None:
            super().send(msg, frames)
            if isinstance(msg, TransferStaged):
                events.append(("staged", msg.request_id, msg.continues_at))

    worker = make_worker("--batching-max-size", "3")
    worker.pipeline = BatchingNull(Role.DENOISER, 1024)  # type: ignore[assignment]
    try:
        jobs = [
            Job(f"r{i}", GenerationParams(f"p{i}", 16, 16, num_inference_steps=steps), None, False) for i in range(3)
        ]
        with worker._lock:
            worker._outstanding.update(job.request_id for job in jobs)
        asked = worker.handing_off

        def handing_off(request_id: str) -> bool:  # the head's HandOff for r1 arrives after step 2
            if sum(1 for e in events if e[0] == "step") == 2:
                worker._hand_off("r1")
            return asked(request_id)

        worker.handing_off = handing_off  # type: ignore[method-assign]
        compute.compute(worker, Link(), jobs)
        assert events == [
            ("step", 1, 3), ("step", 2, 3),
            ("staged", "r1", 2),
            *(("step", i, 2) for i in range(3, steps + 1)),
            ("staged", "r0", None), ("staged", "r2", None),
        ], events  # fmt: skip
        assert worker._staged["r1"].continuation  # type: ignore[union-attr]
        assert worker._held_requests() == {"r0", "r2"}  # their outputs wait for their pushes; r1's state holds none
    finally:
        worker.transport.close()


def test_a_request_asked_to_hand_off_and_then_cancelled_while_queued_is_forgotten():
    """A queued request dropped with its head never reaches the computing thread, which is what forgot
    a hand-off it was asked: one id kept per such request, for the worker's life."""
    worker = make_worker()
    try:
        worker.hands_off = True
        worker._outstanding.add("r")
        worker._hand_off("r")
        assert worker.handing_off("r")
        worker._cancel("r")
        assert not worker.handing_off("r") and not worker._handing_off
    finally:
        worker.transport.close()
