"""A worker's head sends it messages it cannot act on: over real sockets, each fails only its own
request, naming what is wrong; the worker goes on, and no other request's data is lost or shared."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.unit.test_worker_runtime import GatedPipeline, ServedWorker, served_worker
from triptych.families import read_rules
from triptych.params import GenerationParams
from triptych.protocol import (
    CancelWork,
    Failed,
    TransferAlloc,
    TransferAllocated,
    TransferReady,
    TransferStaged,
    Work,
    WorkBatch,
    decode,
    encode,
)

PARAMS = {"width": 16, "height": 16, "num_inference_steps": 1}
MANIFEST = [{"name": "x", "dtype": "uint8", "shape": [16], "offset": 0}]


def reports(w: ServedWorker, count: int) -> list[TransferStaged | Failed]:
    """The next `count` TransferStaged or Failed the worker sends (10 s at most for each)."""
    out: list[TransferStaged | Failed] = []
    while len(out) < count:
        msg, _ = decode(w.results.recv_multipart())  # zmq.Again after 10 s fails the test
        if isinstance(msg, (TransferStaged, Failed)):
            out.append(msg)
    return out


def open_gates(w: ServedWorker, *rids: str) -> None:
    for rid in rids:
        w.pipeline.gates.setdefault(rid, threading.Event()).set()


def runs_to_completion(w: ServedWorker, rid: str) -> None:
    """A good request after the bad ones: the worker still serves."""
    open_gates(w, rid)
    w.work.send_multipart(encode(Work(rid, "w", {**PARAMS, "prompt": rid})))  # type: ignore[arg-type]
    (staged,) = reports(w, 1)
    assert isinstance(staged, TransferStaged) and staged.request_id == rid


def test_the_same_work_twice_fails_once_and_the_first_runs_alone():
    """A second run would stage outputs over the first one's, which were then never freed."""
    with served_worker() as w:
        w.pipeline.gates["r1"] = threading.Event()
        w.start_first("r1", PARAMS)
        w.work.send_multipart(encode(Work("r1", "w", {**PARAMS, "prompt": "r1"})))  # type: ignore[arg-type]
        batch = [Work(rid, "w", {**PARAMS, "prompt": rid}) for rid in ("b", "b")]  # type: ignore[arg-type]
        w.work.send_multipart(encode(WorkBatch("w", batch)))
        open_gates(w, "r1", "b")
        got = reports(w, 4)
        failed = sorted((m.request_id, m.error) for m in got if isinstance(m, Failed))
        assert [rid for rid, _ in failed] == ["b", "r1"]
        # Queued or running, or its outputs staged already: either way it is held here.
        assert all(error.startswith(f"work for request {rid}: this worker already holds") for rid, error in failed)
        assert sorted(m.request_id for m in got if isinstance(m, TransferStaged)) == ["b", "r1"]
        assert [r for r, _ in w.pipeline.runs] == ["r1", "b"]
        runs_to_completion(w, "next")


def test_a_repeated_transfer_alloc_answers_the_slot_held_and_leaves_nothing_behind():
    with served_worker() as w:
        pool = w.worker.pool
        for _ in range(2):
            w.work.send_multipart(encode(TransferAlloc("r", "w", 4096)))
        first, again = (w.next_message(TransferAllocated) for _ in range(2))
        assert first.addr == again.addr  # type: ignore[attr-defined]
        w.work.send_multipart(encode(TransferAlloc("r", "w", 8192)))  # larger than the slot it holds
        failed = w.next_message(Failed)
        assert "transfer_alloc of 8192 bytes for request r, which already holds a 4096-byte" in failed.error  # type: ignore[attr-defined]
        open_gates(w, "r")
        w.work.send_multipart(encode(TransferReady("r", "w", {**PARAMS, "prompt": "r"}, MANIFEST, {})))  # type: ignore[arg-type]
        assert isinstance(w.next_message(TransferStaged), TransferStaged)
        deadline = time.monotonic() + 10
        while pool.free_bytes != pool.pool_bytes:
            assert time.monotonic() < deadline, f"a receive slot of request r was never freed: {pool._owners}"
            time.sleep(0.01)


def test_a_standing_slot_is_run_once_for_the_request_it_was_given_to():
    """A transfer_ready naming a standing slot whose inputs a queued request still waits on (or the
    same one twice) fails: it would run on that request's bytes. The queued request gets its own."""
    with served_worker() as w:
        pool = w.worker.pool
        w.work.send_multipart(encode(TransferAlloc("keep", "w", 4096, standing=True)))
        slot = w.next_message(TransferAllocated).addr  # type: ignore[attr-defined]
        w.work.send_multipart(encode(CancelWork("keep", "w")))  # the slot stays, standing
        w.pipeline.gates["r1"] = threading.Event()
        w.start_first("r1", PARAMS)  # computes: what follows queues behind it
        pool.buffer[slot - pool.base_addr : slot - pool.base_addr + 16] = 7  # the sender's write for "a"
        for rid in ("a", "stranger", "a"):
            ready = TransferReady(rid, "w", {**PARAMS, "prompt": rid}, MANIFEST, {}, slot_addr=slot)  # type: ignore[arg-type]
            w.work.send_multipart(encode(ready))
        lost = TransferReady("lost", "w", {**PARAMS, "prompt": "lost"}, MANIFEST, {}, slot_addr=5)  # type: ignore[arg-type]
        w.work.send_multipart(encode(lost))
        errors = {}
        for _ in range(3):
            failed = w.next_message(Failed)
            errors[failed.request_id, len(errors)] = failed.error  # type: ignore[attr-defined]
        assert list(errors.values()) == [
            f"transfer_ready for slot_addr {slot:#x}, which still holds the inputs of request a",
            "transfer_ready for request a, which this worker already runs or queues",
            "transfer_ready for a slot this worker does not hold (slot_addr 0x5 is none of its standing slots)",
        ]
        assert [rid for rid, _ in errors] == ["stranger", "a", "lost"]
        open_gates(w, "r1", "a")
        got = reports(w, 2)
        assert [m.request_id for m in got] == ["r1", "a"] and all(isinstance(m, TransferStaged) for m in got)
        assert [r for r, _ in w.pipeline.runs] == ["r1", "a"]
        assert bytes(w.pipeline.inputs[1]["x"].numpy()) == b"\x07" * 16
        runs_to_completion(w, "next")


def test_a_standing_slot_made_by_its_request_s_own_transfer_alloc_runs_it():
    """The head's usual way to make a standing slot: a TransferAlloc asking for one, then the
    request's TransferReady naming it. The duplicate check must not take the slot's own request,
    which holds it since the alloc, for a request already queued (it did, failing every such hop)."""
    with served_worker() as w:
        w.work.send_multipart(encode(TransferAlloc("r", "w", 4096, standing=True)))
        allocated = w.next_message(TransferAllocated)
        assert allocated.standing  # type: ignore[attr-defined]
        open_gates(w, "r")
        ready = TransferReady("r", "w", {**PARAMS, "prompt": "r"}, MANIFEST, {}, slot_addr=allocated.addr)  # type: ignore[arg-type, attr-defined]
        w.work.send_multipart(encode(ready))
        (staged,) = reports(w, 1)
        assert isinstance(staged, TransferStaged) and staged.request_id == "r", staged
        runs_to_completion(w, "next")


class FamilyCheckedPipeline(GatedPipeline):
    """GatedPipeline stages that serve what a FLUX package can, as a model's stages check it."""

    def __init__(self, package: Path) -> None:
        super().__init__()
        self.rules = read_rules(str(package))

    def validate(self, params: GenerationParams) -> None:
        self.rules.validate(params)


@pytest.mark.parametrize(
    ("param", "value"), [("width", 17), ("num_inference_steps", 0), ("num_frames", 81), ("num_outputs", 10**9)]
)
def test_params_the_model_cannot_serve_fail_naming_the_parameter(tiny_models, param, value):
    """A denoiser (not only the first role) refuses what its model cannot serve, rather than compute it
    (a billion outputs: memory and hours of compute the requests queued behind it would wait for)."""
    with served_worker(pipeline=FamilyCheckedPipeline(tiny_models["tiny-flux"])) as w:
        open_gates(w, "bad")
        w.work.send_multipart(encode(Work("bad", "w", {**PARAMS, "prompt": "bad", param: value})))  # type: ignore[arg-type]
        (failed,) = reports(w, 1)
        assert isinstance(failed, Failed) and failed.status_code == 400
        assert failed.error.startswith(f"{param} {value}"), failed.error
        assert w.pipeline.runs == []
        runs_to_completion(w, "next")
