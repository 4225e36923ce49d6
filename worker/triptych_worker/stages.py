"""The stage contract: a pipeline is an ordered list of stages, each with a role affinity.

A role process instantiates only the stages whose affinity its role runs
(`Role.runs_affinity`). Between roles, a StageBatch travels as its `tensors` (through
Mooncake) and its `meta` (msgpack scalars, lists and maps through the head).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from triptych.params import GenerationParams
from triptych.protocol.tensors import PIXELS as WIRE_PIXELS
from triptych.protocol.tensors import Array
from triptych.roles import Role

ProgressCallback = Callable[[int, int, Any], None]
"""(step, total, latents after that step or None): the denoising loop reports after every step."""


@dataclass
class StageBatch:
    """One request as it moves through the stages."""

    params: GenerationParams
    tensors: dict[str, Array] = field(default_factory=dict)  # torch tensors; numpy arrays in simulated workers
    meta: dict[str, Any] = field(default_factory=dict)
    on_progress: ProgressCallback | None = None
    hand_off: Callable[[], bool] | None = None
    """Whether the denoising loop should stop at this step boundary and hand its state on
    (triptych_worker.resume; docs/design.md "Migration"); None: never."""
    leave: Callable[[], None] | None = None
    """Called when this request stopped at a step boundary, its state in `tensors` and `meta`, while
    the rest of its batched group runs on (batching.run_merged): its outputs can go now, not after the
    group's last step. None: they go with the group's."""

    def report_progress(self, step: int, total: int, latents: Any = None) -> None:
        if self.on_progress is not None:
            self.on_progress(step, total, latents)

    def should_hand_off(self) -> bool:
        """Asked to hand off, and able to: a step cache's hook keeps state of its own (the residuals or
        attentions it reuses) that does not travel, so a cached request finishes where it is."""
        if self.hand_off is None or self.params.resolved_step_cache.on:
            return False
        return self.hand_off()


PIXELS = WIRE_PIXELS
"""The decoder's final output tensor: uint8 [num_outputs, frames, height, width, 3]."""


class PipelineStage(abc.ABC):
    """One step of a pipeline. Subclasses set `role_affinity` when it is not the encoder."""

    role_affinity: ClassVar[Role] = Role.ENCODER

    @property
    def name(self) -> str:
        return type(self).__name__

    @abc.abstractmethod
    def run(self, batch: StageBatch) -> None:
        """Read and update `batch` in place."""

    def run_many(self, batches: list[StageBatch]) -> list[Exception | None]:
        """Run several requests (compatible ones, triptych.batching); per request, the exception it
        failed with or None. Here one by one; a stage that batches its forward overrides this."""
        return [_attempt(self.run, batch) for batch in batches]


def _attempt(run: Callable[[StageBatch], None], batch: StageBatch) -> Exception | None:
    try:
        run(batch)
    except Exception as exc:
        return exc
    return None
