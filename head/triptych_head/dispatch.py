"""Dispatch policies: which instance of a role gets the next request (--disagg-dispatch-policy).

A policy sees every instance of the role in a stable order and the predicate saying which can
take this request now; it returns one of those, or None when none can.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from triptych_head.instances import WorkerInstance

Eligible = Callable[[WorkerInstance], bool]


class Policy(Protocol):
    def __call__(self, instances: Sequence[WorkerInstance], eligible: Eligible) -> WorkerInstance | None: ...


class RoundRobin:
    """Take instances in turn, skipping those that cannot take the request now."""

    def __init__(self) -> None:
        self._cursor = 0

    def __call__(self, instances: Sequence[WorkerInstance], eligible: Eligible) -> WorkerInstance | None:
        n = len(instances)
        for step in range(n):
            i = (self._cursor + step) % n
            if eligible(instances[i]):
                self._cursor = i + 1
                return instances[i]
        return None


def dispatch_max_free_slots(instances: Sequence[WorkerInstance], eligible: Eligible) -> WorkerInstance | None:
    """The eligible instance with the most free scheduling slots; ties go to the least used so far."""
    candidates = [w for w in instances if eligible(w)]
    if not candidates:
        return None
    return max(candidates, key=lambda w: (w.free_slots, -w.dispatched_total))


def dispatch_lora_affinity(
    policy: Policy, instances: Sequence[WorkerInstance], eligible: Eligible, loras: frozenset[str]
) -> WorkerInstance | None:
    """A request naming LoRA adapters: the least loaded eligible instance that holds them all already,
    else the least loaded eligible one, which loads them (a load costs seconds; a request already held
    costs nothing more). Without adapters: `policy`."""
    if not loras:
        return policy(instances, eligible)
    holders = [w for w in instances if w.holds(loras)]
    return dispatch_max_free_slots(holders, eligible) or dispatch_max_free_slots(instances, eligible)


def make_policy(name: str) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "max_free_slots":
        return dispatch_max_free_slots
    raise ValueError(f"--disagg-dispatch-policy {name!r} is not round_robin or max_free_slots")
