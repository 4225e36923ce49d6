"""Monolithic mode's queue (head/triptych_head/local_queue.py): one request at a time, highest
effective priority first, first come first served within a level, aged as the head's queues are."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from triptych.params import GenerationParams
from triptych.priority import HIGH, LOW, NORMAL, level
from triptych_head.local_queue import PriorityRunner


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def blocked(runner: PriorityRunner) -> threading.Event:
    """Occupy the runner's thread until the returned event is set."""
    release, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(10)

    runner.submit(hold, level(HIGH))
    assert started.wait(10)
    return release


class Recording:
    """Monolithic mode's pipeline, stood in for: it records the prompts it runs, in the order they start,
    and the one named "first" holds the device until `release` is set."""

    step_cache = None

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.release = threading.Event()

    def validate(self, params: GenerationParams) -> None:
        pass

    def generate(self, params: GenerationParams, on_progress: Any, preview_every: int = 0) -> np.ndarray:
        self.ran.append(params.prompt)
        if params.prompt == "first":
            self.release.wait(10)
        return np.zeros((1, 1, 1, 3), dtype=np.uint8)


def test_waiting_requests_run_highest_priority_first_and_in_arrival_order_within_a_level() -> None:
    runner = PriorityRunner(aging_s=30)
    release = blocked(runner)
    ran: list[str] = []
    futures = [
        runner.submit(lambda name=name: ran.append(name), level(priority))
        for name, priority in (("low-1", LOW), ("normal", NORMAL), ("high", HIGH), ("low-2", LOW))
    ]
    assert runner.waiting() == 4
    release.set()
    for f in futures:
        f.result(10)
    assert ran == ["high", "normal", "low-1", "low-2"]
    runner.shutdown()


def test_a_waiting_request_rises_one_level_per_aging_period_so_none_starves() -> None:
    clock = Clock()
    runner = PriorityRunner(aging_s=30, clock=clock)
    release = blocked(runner)
    ran: list[str] = []
    old = runner.submit(lambda: ran.append("old-low"), level(LOW))
    clock.now = 30.0
    fresh = runner.submit(lambda: ran.append("fresh-low"), level(LOW))
    clock.now = 65.0
    # old: low + 2 levels (65 s) = high, and earlier than new-high; fresh-low: low + 1 (35 s) = normal.
    new = runner.submit(lambda: ran.append("new-high"), level(HIGH))
    release.set()
    for f in (old, fresh, new):
        f.result(10)
    assert ran == ["old-low", "new-high", "fresh-low"]
    runner.shutdown()


def test_a_cancelled_waiting_request_never_runs_and_a_failure_reaches_its_caller() -> None:
    runner = PriorityRunner(aging_s=30)
    release = blocked(runner)
    ran: list[str] = []
    gone = runner.submit(lambda: ran.append("gone"), level(HIGH))
    assert gone.cancel()

    def fail() -> None:
        raise ValueError("bad request")

    failing = runner.submit(fail, level(NORMAL))
    after = runner.submit(lambda: ran.append("after"), level(LOW))
    release.set()
    with pytest.raises(ValueError, match="bad request"):
        failing.result(10)
    after.result(10)
    assert ran == ["after"]
    runner.shutdown()


def test_shutdown_cancels_what_waits_and_refuses_more() -> None:
    runner = PriorityRunner(aging_s=30)
    release = blocked(runner)
    waiting = runner.submit(lambda: None, level(NORMAL))
    runner.shutdown()
    release.set()
    assert waiting.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        runner.submit(lambda: None, level(NORMAL))


def test_monolithic_mode_runs_waiting_requests_by_priority_and_drops_one_whose_client_left() -> None:
    """LocalBackend, as monolithic mode builds it, over a stand-in pipeline that records its runs."""
    import asyncio

    from triptych.params import GenerationParams
    from triptych_head.backend import LocalBackend

    pipeline = Recording()

    async def scenario() -> None:
        backend = LocalBackend(pipeline, aging_s=30)  # type: ignore[arg-type]

        def request(prompt: str, priority: str) -> asyncio.Task:
            params = GenerationParams(prompt=prompt, width=16, height=16)
            return asyncio.create_task(backend.generate(prompt, params, priority=level(priority)))

        first = request("first", NORMAL)
        await asyncio.sleep(0.1)  # running, holding the device
        low, left, high = request("low", LOW), request("left", HIGH), request("high", HIGH)
        await asyncio.sleep(0.1)
        left.cancel()  # its client went away while it waited
        await asyncio.sleep(0.1)  # the cancellation reaches the request's coroutine
        pipeline.release.set()
        await asyncio.gather(first, low, high)
        assert left.cancelled()
        await backend.cancel("first")  # a cancel that comes after its request ended is not kept
        assert backend._cancelled == set() and backend._live == set()
        await backend.close()

    asyncio.run(scenario())
    assert pipeline.ran == ["first", "high", "low"]


def test_monolithic_mode_fails_a_waiting_request_cancelled_before_its_turn_without_running_it() -> None:
    """A drain's end cancels every request the head holds: one still waiting for the device used to run
    its stages anyway (prompt and reference encoding, a URL fetch) once its turn came, past the drain."""
    import asyncio

    from triptych.params import GenerationParams
    from triptych_head.backend import GenerationFailed, LocalBackend

    pipeline = Recording()

    async def scenario() -> None:
        backend = LocalBackend(pipeline, aging_s=30)  # type: ignore[arg-type]
        first = asyncio.create_task(backend.generate("first", GenerationParams(prompt="first", width=16, height=16)))
        await asyncio.sleep(0.1)  # running, holding the device
        waiting = asyncio.create_task(
            backend.generate("waiting", GenerationParams(prompt="waiting", width=16, height=16))
        )
        await asyncio.sleep(0.1)
        await backend.cancel("waiting")  # the drain's end
        pipeline.release.set()
        await first
        with pytest.raises(GenerationFailed) as failed:
            await waiting
        assert failed.value.status_code == 499
        await backend.close()

    asyncio.run(scenario())
    assert pipeline.ran == ["first"]
