"""Monolithic mode's queue: one thread runs the requests, highest effective priority first.

The disaggregated head orders its role queues the same way (preemption.py): a request's effective
level is its priority (triptych.priority) plus one for every `aging_s` seconds it has waited, so a
low request waits behind newer high ones for a bounded time only; first come, first served within a
level. Monolithic mode has one device and no step-boundary hand-off, so a running request is never
suspended: a waiting high request goes next, not at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from triptych_head.preemption import aged


@dataclass
class _Entry:
    level: int
    queued_at: float
    seq: int
    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


class PriorityRunner:
    """Runs submitted calls one at a time on its own thread, in decreasing effective level."""

    def __init__(self, aging_s: float, clock: Callable[[], float] = time.monotonic, name: str = "pipeline"):
        self._aging_s = aging_s
        self._clock = clock
        self._waiting: list[_Entry] = []
        self._seq = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], level: int) -> Future[Any]:
        with self._cond:
            if self._closed:
                raise RuntimeError("the pipeline's queue is shut down")
            self._seq += 1
            entry = _Entry(level, self._clock(), self._seq, fn)
            self._waiting.append(entry)
            self._cond.notify()
        return entry.future

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def shutdown(self) -> None:
        """Run nothing more: the waiting calls' futures are cancelled; the running one finishes."""
        with self._cond:
            self._closed = True
            for entry in self._waiting:
                entry.future.cancel()
            self._waiting.clear()
            self._cond.notify()

    def _effective(self, entry: _Entry, now: float) -> int:
        return aged(entry.level, max(now - entry.queued_at, 0.0), self._aging_s)

    def _next(self) -> _Entry | None:
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            now = self._clock()
            entry = max(self._waiting, key=lambda e: (self._effective(e, now), -e.seq))
            self._waiting.remove(entry)
            return entry

    def _run(self) -> None:
        while (entry := self._next()) is not None:
            if not entry.future.set_running_or_notify_cancel():
                continue
            try:
                entry.future.set_result(entry.fn())
            except BaseException as exc:  # the request's failure, delivered to its caller
                entry.future.set_exception(exc)
