"""One batched forward over several requests: merge their StageBatches, run a stage once, split.

The requests of a batch are compatible (triptych.batching.batch_key), so their tensors differ only
in their rows: every tensor a stage hands on has one row per output ([num_outputs, ...]) except the
ones the adapter lists as shared (positional ids that depend on the shape alone), and their meta
(the schedule) is the same. `merge` concatenates the rows in request order and keeps the first
request's params and meta; `split` hands each request its own rows back.

Progress fans out per request (`fan_out_progress`), each request seeing its own rows of the
latents. A request whose progress callback raises (the head cancelled it) is dropped from the
batch's reporting at that step boundary and its outputs are discarded after the batch ends; the
others run on. Only when every request of the batch has dropped does the stage stop early.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from triptych_worker.resume import RESUME
from triptych_worker.stages import StageBatch

if TYPE_CHECKING:
    import torch


class EveryRequestDropped(Exception):
    """Raised inside a batched stage once every request of the batch has dropped out."""

    def __init__(self, errors: dict[int, Exception]):
        super().__init__(f"all {len(errors)} requests of the batch dropped out")
        self.errors = errors


def rows(batch: StageBatch) -> int:
    return batch.params.num_outputs


def merge(batches: Sequence[StageBatch], shared: frozenset[str]) -> StageBatch:
    """One StageBatch holding every request's rows (request order), the first request's params and meta."""
    import torch

    first = batches[0]
    for batch in batches[1:]:  # what batch_key let through must not drop a request's tensors (its reference's)
        if set(batch.tensors) != set(first.tensors):
            different = sorted(set(batch.tensors) ^ set(first.tensors))
            raise ValueError(f"the requests of a batch hand on different tensors ({', '.join(different)})")
    tensors: dict[str, Any] = {}
    for name, tensor in first.tensors.items():
        if name in shared:
            tensors[name] = tensor
        else:
            tensors[name] = torch.cat([cast("torch.Tensor", b.tensors[name]) for b in batches], dim=0)
    return StageBatch(params=first.params, tensors=tensors, meta=dict(first.meta))


def split(merged: StageBatch, batches: Sequence[StageBatch], shared: frozenset[str]) -> None:
    """Give each request its rows of `merged`'s tensors (a copy, so none keeps the batch alive) and its meta.

    A shared tensor is the first request's, which may be a view on that request's receive slot (inputs
    used in place): the slot is given back once the first request's outputs are staged, possibly before
    another's are, so every other request gets a copy of its own (positional ids: small)."""
    start = 0
    for i, batch in enumerate(batches):
        n = rows(batch)
        batch.tensors = {
            name: (tensor if i == 0 else cast("torch.Tensor", tensor).clone())
            if name in shared
            else cast("torch.Tensor", tensor)[start : start + n].clone()
            for name, tensor in merged.tensors.items()
        }
        batch.meta = dict(merged.meta)  # compatible requests share their meta (a continuation's RESUME too)
        start += n


def fan_out_progress(batches: Sequence[StageBatch], dropped: dict[int, Exception]) -> Callable[[int, int, Any], None]:
    """The merged batch's progress callback: each request's own, with its rows of the latents.

    A request whose callback raises joins `dropped` (index -> its exception) and hears nothing more.
    """

    def progress(step: int, total: int, latents: torch.Tensor | None = None) -> None:
        start = 0
        for i, batch in enumerate(batches):
            n = rows(batch)
            if i not in dropped:
                try:
                    batch.report_progress(step, total, None if latents is None else latents[start : start + n])
                except Exception as exc:
                    dropped[i] = exc
            start += n
        if len(dropped) == len(batches):
            raise EveryRequestDropped(dict(dropped))

    return progress


def run_merged(
    batches: Sequence[StageBatch], shared: frozenset[str], run: Callable[[StageBatch], None]
) -> list[Exception | None]:
    """Run `run` once over the merged requests and split its outputs back; per request, the exception
    it dropped out with (None: it ran to the end, or stopped at a step boundary when asked).

    A member asked to hand off (a drain, a preemption) stops the merged loop at that step boundary:
    every member's rows of the state are split back as a continuation (resume.py), the asked members
    keep theirs, handed on at once through their `leave` while the group runs on, and the others run
    on from that same state as one merged batch again, so only the requests the head asked for move."""
    outcomes: dict[int, Exception] = {}
    live = list(range(len(batches)))
    while live:
        members = [batches[i] for i in live]
        dropped: dict[int, Exception] = {}
        asked: set[int] = set()
        merged = merge(members, shared)
        merged.on_progress = fan_out_progress(members, dropped)
        merged.hand_off = _asking(members, dropped, asked)
        try:
            run(merged)
        except EveryRequestDropped as exc:
            outcomes.update((live[j], error) for j, error in exc.errors.items())
            break
        split(merged, members, shared)
        outcomes.update((live[j], error) for j, error in dropped.items())
        stopped = bool(asked) and RESUME in merged.meta  # at a boundary, for the asked members
        live = [i for j, i in enumerate(live) if stopped and j not in asked and j not in dropped]
        if live:  # the asked members' states go now; the others' outputs at the group's end, as ever
            for j in sorted(asked - dropped.keys()):
                if (leave := members[j].leave) is not None:
                    leave()
    return [outcomes.get(i) for i in range(len(batches))]


def _asking(members: Sequence[StageBatch], dropped: dict[int, Exception], asked: set[int]) -> Callable[[], bool]:
    """The merged batch's `hand_off`: "stop before this step?", yes when any member still reporting is
    asked, which join `asked`. Every member is asked at every boundary, in order (on a rank of a
    multi-device role each answer may take a collective, so every rank asks the same questions)."""

    def hand_off() -> bool:
        asked.update(j for j, member in enumerate(members) if j not in dropped and member.should_hand_off())
        return bool(asked)

    return hand_off


Outcomes = list[Exception | None]  # per request: the exception it failed with, or None


def run_in_turn(
    parts: Sequence[Callable[[list[StageBatch]], Sequence[Exception | None]]],
    batches: Sequence[StageBatch],
    outcomes: Outcomes | None = None,
) -> Outcomes:
    """Run each part (a `run_many`: stages, or a role's pipeline) over the requests still live, in
    order: a request that fails in one part (its outcome an exception; given ones count) leaves the
    group there while the others carry on."""
    outcomes = list(outcomes) if outcomes is not None else [None] * len(batches)
    for run_many in parts:
        live = [i for i, error in enumerate(outcomes) if error is None]
        if not live:
            break
        for i, error in zip(live, run_many([batches[i] for i in live]), strict=True):
            outcomes[i] = error
    return outcomes
