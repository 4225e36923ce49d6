"""Simulated stages (`triptych serve --simulate`): modelled time, correctly shaped tensors, no model.

A simulated worker is a real worker (same sockets, messages, transfer pool and Mooncake writes)
whose stages load no weights and never import torch: each request sleeps for the time the cost
model gives its role, then emits zeros shaped as the family of --model-path would emit them
(`FamilyRules.output_specs` of triptych.families, read from the package's JSON configs). The pool holds numpy
arrays. That keeps one worker to a few tens of MB, so one small machine can run dozens of them
against one head (bench/scaling_bench.py).

Cost model, per request: seconds + seconds_per_unit x units, where a unit is
- encoder: one output (num_outputs; text encoding does not depend on the image size; an image
  encoder's reference latents are shaped as the family encodes the reference: FluxRules.image_outputs);
- denoiser: one step over one megapixel-frame (num_outputs x num_frames x width x height / 2**20
  x num_inference_steps); progress is reported after each step, as the real loop does;
- decoder: one megapixel-frame (num_outputs x num_frames x width x height / 2**20).
A simulated denoiser stops at a step boundary when the head asks (HandOff: migration and
preemption), staging its inputs and zero latents with the step to continue at, and a continuation
resumes from that step, taking only the remaining steps' time.
The defaults (triptych.config.SIMULATE_DEFAULTS, which the flags' help shows) are coarse figures
for a FLUX.1-dev-class model on one modern GPU; --simulate-seconds and --simulate-seconds-per-unit
override them for the worker's role.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from triptych.config import SIMULATE_DEFAULTS, ServeArgs
from triptych.families import family_of, read_rules
from triptych.params import GenerationParams
from triptych.protocol.tensors import Array, TensorSpec
from triptych.roles import Role
from triptych_worker.resume import RESUME
from triptych_worker.stages import StageBatch

MEGAPIXEL = 1 << 20


@dataclass(frozen=True)
class StageCost:
    """How long a simulated stage takes: `seconds` per request plus `seconds_per_unit` per unit of work."""

    seconds: float
    seconds_per_unit: float

    def duration(self, role: Role, params: GenerationParams) -> float:
        return self.seconds + self.seconds_per_unit * work_units(role, params)


DEFAULT_COSTS: dict[Role, StageCost] = {role: StageCost(*costs) for role, costs in SIMULATE_DEFAULTS.items()}


def work_units(role: Role, params: GenerationParams) -> float:
    """The units of work one request is for `role` (see the module docstring)."""
    p = params
    megapixel_frames = p.num_outputs * p.num_frames * p.width * p.height / MEGAPIXEL
    if role is Role.DENOISER:
        return megapixel_frames * p.num_inference_steps
    if role is Role.DECODER:
        return megapixel_frames
    return float(p.num_outputs)


class OutputShapes(Protocol):
    """Where a simulated stage learns what to emit: a family's rules (or the null pipeline's fixed payload)."""

    def output_specs(self, role: Role, params: GenerationParams) -> list[TensorSpec]: ...

    def validate(self, params: GenerationParams) -> None: ...


class SimulatedPipeline:
    """Quacks like RolePipeline: `run(batch)` takes the modelled time and emits the modelled tensors."""

    loaded_components: set[str] = set()

    def __init__(self, role: Role, shapes: OutputShapes, cost: StageCost, family: str = "simulated"):
        self.role = role
        self.shapes = shapes
        self.cost = cost
        self.family = family
        self.stage_names = [f"Simulated{role.value.title()}Stage"]

    @classmethod
    def from_args(cls, args: ServeArgs) -> SimulatedPipeline:
        """The simulated stages of `args.disagg_role` for the package at --model-path (its configs only)."""
        rules = read_rules(args.model_path)
        default = DEFAULT_COSTS[args.disagg_role]
        cost = StageCost(
            default.seconds if args.simulate_seconds is None else args.simulate_seconds,
            default.seconds_per_unit if args.simulate_seconds_per_unit is None else args.simulate_seconds_per_unit,
        )
        return cls(args.disagg_role, rules, cost, family_of(rules.package).name)

    def validate(self, params: GenerationParams) -> None:
        self.shapes.validate(params)

    def duration(self, params: GenerationParams) -> float:
        return self.cost.duration(self.role, params)

    # Its inputs are read-only views on the receive slot (inputs.py): it never writes them.
    reads_inputs_in_place = True

    @property
    def hands_off(self) -> bool:
        """A simulated denoiser can stop between steps and continue elsewhere, as the real one."""
        return self.role is Role.DENOISER

    def run(self, batch: StageBatch) -> StageBatch:
        p = batch.params
        started, total = time.monotonic(), self.duration(p)
        specs = self.shapes.output_specs(self.role, p)
        outputs: dict[str, Array] = {spec.name: np.zeros(spec.shape, dtype=np.dtype(spec.dtype)) for spec in specs}
        if self.role is Role.DENOISER:
            steps = p.num_inference_steps
            first = int(batch.meta.pop(RESUME, {}).get("step", 0))  # a continuation: the steps it has left
            for step in range(first + 1, steps + 1):  # sleep to each step's end, so the steps add up to the total
                if batch.should_hand_off():
                    batch.meta[RESUME] = {"step": step - 1}
                    batch.tensors = {**batch.tensors, **outputs}  # its inputs and (zero) latents travel on
                    return batch
                time.sleep(max(0.0, started + total * (step - first) / steps - time.monotonic()))
                batch.report_progress(step, steps)  # raises when the head cancelled the request
        elif total > 0:
            time.sleep(total)
        batch.tensors = outputs
        return batch
