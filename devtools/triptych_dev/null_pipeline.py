"""Zero-compute stages, for measuring the control and transfer planes without a model.

    python -m triptych_dev.null_pipeline --payload-bytes 1048576 [--step-seconds 0.05] <serve flags>

runs a real worker (same sockets, pool and Mooncake transfers) whose stages only produce
`--payload-bytes` of zeros (encoder, denoiser) or a black image (decoder). It is the simulated
mode (`triptych serve --simulate`, triptych_worker.simulated) with a fixed payload instead of the
family's tensors and no time but `--step-seconds` per denoising step; no torch is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from triptych.cli import OneLineParser
from triptych.config import ConfigError, ServeArgs
from triptych.params import GenerationParams
from triptych.protocol.tensors import TensorSpec
from triptych.roles import Role
from triptych.serve_flags import add_serve_flags
from triptych_worker.simulated import SimulatedPipeline, StageCost
from triptych_worker.stages import StageBatch


@dataclass(frozen=True)
class FixedPayload:
    """Shapes for control-plane measurements: `nbytes` of uint8 per hop, real-shaped pixels at the end."""

    nbytes: int

    def output_specs(self, role: Role, params: GenerationParams) -> list[TensorSpec]:
        p = params
        if role is Role.DECODER:
            return [TensorSpec("pixels", "uint8", (p.num_outputs, p.num_frames, p.height, p.width, 3))]
        return [TensorSpec("payload", "uint8", (self.nbytes,))]

    def validate(self, params: GenerationParams) -> None:
        pass


class NullPipeline(SimulatedPipeline):
    """Simulated stages that cost nothing but the bytes they emit (and `step_seconds` per denoising step)."""

    def __init__(self, role: Role, payload_bytes: int, step_seconds: float = 0.0, fail_prefix: str | None = None):
        super().__init__(role, FixedPayload(payload_bytes), StageCost(0.0, 0.0), family="null")
        self.payload_bytes = payload_bytes
        self.step_seconds = step_seconds
        # --fail-prompt-prefix: a prompt "<prefix><role>" fails that role's stage (tests of failure paths).
        self.fail_prefix = fail_prefix
        self.stage_names = [f"Null{role.value.title()}Stage"]

    def duration(self, params: GenerationParams) -> float:
        return self.step_seconds * params.num_inference_steps if self.role is Role.DENOISER else 0.0

    def run(self, batch: StageBatch) -> StageBatch:
        if self.fail_prefix is not None and batch.params.prompt.startswith(f"{self.fail_prefix}{self.role.value}"):
            raise RuntimeError(f"simulated {self.role.value} stage failed on purpose")
        return super().run(batch)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="null-worker")
    parser.add_argument("--payload-bytes", type=int, default=1 << 20)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="denoiser: simulated time per step")
    parser.add_argument(
        "--fail-prompt-prefix", default=None, help="tests: a prompt PREFIX+ROLE (e.g. fail:denoiser) fails that stage"
    )
    add_serve_flags(parser)
    ns = parser.parse_args(argv)
    try:
        args = ServeArgs.from_namespace(ns)
    except ConfigError as exc:
        print(f"null-worker: error: {exc}", file=sys.stderr)
        return 2
    from triptych.launch import configure_logging
    from triptych_worker.runtime import run_worker

    configure_logging(args)
    try:
        return run_worker(
            args, NullPipeline(args.disagg_role, ns.payload_bytes, ns.step_seconds, ns.fail_prompt_prefix)
        )
    except ConfigError as exc:  # e.g. an unreadable --disagg-keys-dir
        print(f"null-worker: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
