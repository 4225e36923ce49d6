"""The input loader (triptych_worker.inputs): queued jobs' inputs are copied out of their receive
slots on a thread of its own, at most `ahead` jobs ahead of the compute thread, byte for byte; a
job wanted before the loader reached it is loaded by the caller; a cancelled job is dropped."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from triptych.params import GenerationParams
from triptych_worker.inputs import InputLoader, SlotGone
from triptych_worker.job_groups import Job
from triptych_worker.resume import RESUME
from triptych_worker.transfer import Allocation, TransferPool, stage_tensors

WAIT_S = 10.0  # generous: a loaded machine; a loader that never loads fails at this bound


class NoLink:
    """The loader thread's link to the heads; these tests read what was released instead."""

    def close(self) -> None:
        pass


class Loader:
    """An InputLoader over a real numpy pool, recording which slots it gave back and from which thread."""

    def __init__(self, ahead: int, in_place: bool = False) -> None:
        self.pool = TransferPool(1 << 20, "denoiser", memory="numpy")
        self.released: list[tuple[Allocation, str]] = []
        self.cancelled: set[str] = set()
        self.loader = InputLoader(
            self.pool,
            None,
            ahead,
            release=self._release,
            cancelled=lambda rid: rid in self.cancelled,
            make_link=NoLink,  # type: ignore[arg-type]
            in_place=in_place,
        )

    def _release(self, alloc: Allocation, link: Any) -> None:
        self.pool.free(alloc)
        self.released.append((alloc, threading.current_thread().name))

    def job(self, rid: str, value: int) -> Job:
        staged = stage_tensors(self.pool, {"x": np.full(1000, value, dtype=np.uint8)}, owner=rid)
        assert staged is not None
        job = Job(rid, GenerationParams(prompt=rid, width=16, height=16), (staged.allocation, staged.manifest, {}))
        self.loader.submit(job)
        return job

    def released_ids(self) -> list[str]:
        return [alloc.owner for alloc, _ in self.released]


@contextmanager
def running(ahead: int, in_place: bool = False) -> Iterator[Loader]:
    harness = Loader(ahead, in_place)
    harness.loader.start()
    try:
        yield harness
    finally:
        harness.loader.stop()


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {WAIT_S}s"
        time.sleep(0.005)


def test_inputs_are_copied_out_ahead_and_their_slots_freed_before_the_compute_thread_asks():
    with running(ahead=1) as h:
        first, second = h.job("r1", 1), h.job("r2", 2)
        wait_for(lambda: h.released_ids() == ["r1"], "r1's slot given back by the loader")
        time.sleep(0.2)
        assert h.released_ids() == ["r1"], "the loader stays at most one job ahead of the compute thread"
        assert h.released[0][1] == "input-loader"
        tensors = h.loader.take(first, None).tensors  # type: ignore[arg-type]
        assert np.array_equal(tensors["x"], np.full(1000, 1, dtype=np.uint8))
        wait_for(lambda: h.released_ids() == ["r1", "r2"], "r2 loaded once r1 was taken")
        assert np.array_equal(h.loader.take(second, None).tensors["x"], np.full(1000, 2, dtype=np.uint8))  # type: ignore[arg-type]
        assert h.pool.free_bytes == h.pool.pool_bytes


def test_a_job_taken_before_the_loader_reached_it_is_loaded_by_the_caller():
    with running(ahead=1) as h:
        first, second = h.job("r1", 1), h.job("r2", 2)
        wait_for(lambda: h.released_ids() == ["r1"], "r1 loaded ahead")
        # A batch assembled out of order: r2 first. The loader holds r1; the caller loads r2 itself.
        assert np.array_equal(h.loader.take(second, None).tensors["x"], np.full(1000, 2, dtype=np.uint8))  # type: ignore[arg-type]
        assert h.released[-1] == (second.incoming[0], threading.current_thread().name)  # type: ignore[index]
        assert np.array_equal(h.loader.take(first, None).tensors["x"], np.full(1000, 1, dtype=np.uint8))  # type: ignore[arg-type]


def test_a_cancelled_job_no_longer_counts_as_ahead():
    with running(ahead=1) as h:
        h.job("r1", 1)
        second = h.job("r2", 2)
        wait_for(lambda: h.released_ids() == ["r1"], "r1 loaded ahead")
        h.cancelled.add("r1")  # the head cancelled it: never taken
        wait_for(lambda: h.released_ids() == ["r1", "r2"], "r2 loaded once cancelled r1 was dropped")
        assert np.array_equal(h.loader.take(second, None).tensors["x"], np.full(1000, 2, dtype=np.uint8))  # type: ignore[arg-type]


def test_a_load_that_fails_fails_when_taken_and_the_slot_is_given_back():
    with running(ahead=2) as h:
        job = h.job("r1", 1)
        alloc, manifest, meta = job.incoming  # type: ignore[misc]
        job.incoming = (alloc, [{**manifest[0], "offset": alloc.nbytes}], meta)  # outside its allocation
        bad = Job("r1", job.params, job.incoming)
        h.loader.submit(bad)
        wait_for(lambda: "r1" in h.released_ids(), "the bad job's slot given back")
        with pytest.raises(ValueError, match="does not fit"):
            h.loader.take(bad, None)  # type: ignore[arg-type]


def test_without_load_ahead_the_compute_thread_copies_its_own_inputs():
    with running(ahead=0) as h:
        job = h.job("r1", 7)
        time.sleep(0.2)
        assert h.released == [], "nothing is loaded before the compute thread asks"
        assert np.array_equal(h.loader.take(job, None).tensors["x"], np.full(1000, 7, dtype=np.uint8))  # type: ignore[arg-type]
        assert h.released[0][1] == threading.current_thread().name


# --- inputs used in place (views on the slot, held until the stage is done) ---------------------


def test_inputs_in_place_are_views_and_the_slot_is_given_back_only_on_release():
    with running(ahead=1, in_place=True) as h:
        job = h.job("r1", 5)
        time.sleep(0.2)
        assert h.released == [], "the loader copies nothing ahead: views cost nothing to make"
        inputs = h.loader.take(job, None)  # type: ignore[arg-type]
        assert inputs.held is job.incoming[0]  # type: ignore[index]
        assert np.shares_memory(inputs.tensors["x"], h.pool.buffer)
        assert np.array_equal(inputs.tensors["x"], np.full(1000, 5, dtype=np.uint8))
        assert h.released == [] and h.pool.held(inputs.held), "held while the stage runs"
        h.loader.release(inputs, None)  # type: ignore[arg-type]
        assert h.released_ids() == ["r1"] and h.pool.free_bytes == h.pool.pool_bytes


def test_a_cancel_during_the_stage_frees_the_slot_only_once_the_stage_is_done():
    with running(ahead=1, in_place=True) as h:
        job = h.job("r1", 5)
        inputs = h.loader.take(job, None)  # type: ignore[arg-type]
        h.pool.free_owner("r1")  # what the worker does when the head cancels the request
        assert h.pool.free_bytes < h.pool.pool_bytes, "the stage still reads the slot"
        assert np.array_equal(inputs.tensors["x"], np.full(1000, 5, dtype=np.uint8))
        h.loader.release(inputs, None)  # type: ignore[arg-type]
        assert h.pool.free_bytes == h.pool.pool_bytes


def test_a_slot_freed_before_its_inputs_are_taken_is_never_viewed():
    with running(ahead=1, in_place=True) as h:
        job = h.job("r1", 5)
        h.pool.free_owner("r1")  # cancelled while queued
        with pytest.raises(SlotGone):
            h.loader.take(job, None)  # type: ignore[arg-type]
        assert h.pool.free_bytes == h.pool.pool_bytes


def test_a_bad_manifest_in_place_fails_the_take_and_gives_the_slot_back():
    with running(ahead=1, in_place=True) as h:
        job = h.job("r1", 1)
        alloc, manifest, meta = job.incoming  # type: ignore[misc]
        bad = Job("r1", job.params, (alloc, [{**manifest[0], "offset": alloc.nbytes}], meta))
        with pytest.raises(ValueError, match="does not fit"):
            h.loader.take(bad, None)  # type: ignore[arg-type]
        assert h.released_ids() == ["r1"] and not h.pool.held(alloc)
        assert h.pool.free_bytes == h.pool.pool_bytes


def test_a_continuation_is_copied_even_in_place():
    """A resuming request's scheduler state may outlive the stage: its inputs are copies."""
    with running(ahead=1, in_place=True) as h:
        job = h.job("r1", 3)
        alloc, manifest, _ = job.incoming  # type: ignore[misc]
        continuation = Job("r1", job.params, (alloc, manifest, {RESUME: {"step": 1}}))
        inputs = h.loader.take(continuation, None)  # type: ignore[arg-type]
        assert inputs.held is None and not np.shares_memory(inputs.tensors["x"], h.pool.buffer)
        assert h.released_ids() == ["r1"]


def test_detaching_copies_the_outputs_that_view_the_slot_and_gives_it_back():
    with running(ahead=1, in_place=True) as h:
        job = h.job("r1", 9)
        inputs = h.loader.take(job, None)  # type: ignore[arg-type]
        own = np.zeros(4, dtype=np.uint8)
        outputs = h.loader.detach(inputs, {"x": inputs.tensors["x"], "own": own}, None)  # type: ignore[arg-type]
        assert not np.shares_memory(outputs["x"], h.pool.buffer), "an output passed on from the slot is copied"
        assert np.array_equal(outputs["x"], np.full(1000, 9, dtype=np.uint8))
        assert outputs["own"] is own, "the others are kept as they are"
        assert h.released_ids() == ["r1"] and h.pool.free_bytes == h.pool.pool_bytes
