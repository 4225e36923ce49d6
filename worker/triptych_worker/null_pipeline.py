"""Zero-compute stages, for measuring the control and transfer planes without a model.

    python -m triptych_worker.null_pipeline --payload-bytes 1048576 [--step-seconds 0.05] <serve flags>

runs a real worker (same sockets, pool and Mooncake transfers) whose stages only produce
`--payload-bytes` of zeros (encoder, denoiser) or a black image (decoder).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

from triptych.cli import OneLineParser
from triptych.config import ConfigError, ServeArgs, add_serve_flags
from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_worker.stages import PIXELS, StageBatch


class NullPipeline:
    """Quacks like RolePipeline; stages cost nothing but the bytes they emit."""

    family = "null"
    loaded_components: set[str] = set()

    def __init__(self, role: Role, payload_bytes: int, step_seconds: float = 0.0):
        self.role = role
        self.payload_bytes = payload_bytes
        self.step_seconds = step_seconds
        self.stage_names = [f"Null{role.value.title()}Stage"]

    def validate(self, params: GenerationParams) -> None:
        pass

    def run(self, batch: StageBatch) -> StageBatch:
        p = batch.params
        if p.prompt.startswith(f"fail:{self.role.value}"):  # lets tests make exactly one stage fail
            raise RuntimeError(f"null {self.role.value} stage failed on purpose")
        if self.role is Role.DECODER:
            batch.tensors = {
                PIXELS: torch.zeros((p.num_outputs, p.num_frames, p.height, p.width, 3), dtype=torch.uint8)
            }
        elif self.role is Role.DENOISER:
            for step in range(1, p.num_inference_steps + 1):
                time.sleep(self.step_seconds)  # stands in for one DiT forward
                batch.report_progress(step, p.num_inference_steps)
        else:
            batch.tensors = {"payload": torch.zeros(self.payload_bytes, dtype=torch.uint8)}
        return batch


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="null-worker")
    parser.add_argument("--payload-bytes", type=int, default=1 << 20)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="denoiser: simulated time per step")
    add_serve_flags(parser)
    ns = parser.parse_args(argv)
    try:
        args = ServeArgs.from_namespace(ns)
    except ConfigError as exc:
        print(f"null-worker: error: {exc}", file=sys.stderr)
        return 2
    from triptych.launch import configure_logging
    from triptych_worker.runtime import Worker

    configure_logging(args)
    torch.set_num_threads(1)  # no compute here; idle OpenMP threads would only spin against the measured path
    Worker(args, pipeline=NullPipeline(args.disagg_role, ns.payload_bytes, ns.step_seconds)).serve()  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
