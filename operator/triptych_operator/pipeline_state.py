"""What the operator remembers about each pipeline between events, so an event costs what it changed.

One `PipelineState` per DiffusionPipeline, kept in kopf's operator-wide memo (`memo.pipelines`)
and dropped when the pipeline is deleted. Everything here can be lost (a restart, a hand-over to
another replica): it is rebuilt from the API server and the watches, at the cost of one read of the
key Secret per pipeline and an apply of any child that does not match its manifest.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from triptych_operator.drift import Applied
from triptych_operator.manifests import Children
from triptych_operator.spec.model import PipelineSpec

PipelineKey = tuple[str, str]  # (namespace, name)
ChildKey = tuple[str, str]  # (kind, name)


@dataclass
class PipelineState:
    # One reconcile per pipeline at a time: child events arrive in bursts and must not race.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The spec is parsed and validated once per (uid, generation), not once per event.
    parsed_for: tuple[str, int] | None = None
    spec: PipelineSpec | None = None
    spec_error: str | None = None
    # The last spec that was valid: its objects keep running through an invalid edit, and the wake
    # loop keeps waking its roles that scale to zero.
    last_valid_spec: PipelineSpec | None = None
    deletions: list[Any] = field(default_factory=list)
    # The key Secret's fingerprint: read when the pipeline changes or is found, not on child events.
    keys_fingerprint: str | None = None
    annotations: str | None = None  # digest of the annotations when the Secret was last read
    rendered_for: tuple[str, int, str] | None = None
    children: Children | None = None
    digests: dict[ChildKey, str] = field(default_factory=dict)  # of each child's manifest, per render
    applied: dict[ChildKey, Applied] = field(default_factory=dict)
    apply_error: str | None = None
    # The status this operator last wrote, compared before writing again.
    status: dict[str, Any] | None = None
    # The pending status write, if one is scheduled (handlers._status_soon).
    status_writer: asyncio.Task[None] | None = None


@dataclass
class PipelineStates:
    """The per-pipeline states of one operator process."""

    by_key: dict[PipelineKey, PipelineState] = field(default_factory=dict)

    def get(self, key: PipelineKey) -> PipelineState:
        return self.by_key.setdefault(key, PipelineState())

    def forget(self, key: PipelineKey) -> None:
        state = self.by_key.pop(key, None)
        if state is not None and state.status_writer is not None:
            state.status_writer.cancel()

    def __len__(self) -> int:
        return len(self.by_key)
