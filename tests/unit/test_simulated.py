"""Simulated workers (`triptych serve --simulate`): the cost model, the flags, and a worker without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from triptych.cli import build_parser
from triptych.config import ConfigError, ServeArgs
from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_worker import simulated
from triptych_worker.resume import RESUME
from triptych_worker.simulated import DEFAULT_COSTS, SimulatedPipeline, StageCost, work_units
from triptych_worker.stages import StageBatch

MEGAPIXEL_SQUARE = 1024  # 1024 x 1024 pixels = one megapixel


def serve_args(*flags: str, role: str = "denoiser", model: str = "m") -> ServeArgs:
    argv = ["serve", "--model-path", model, "--disagg-role", role, "--disagg-server-addr", "tcp://127.0.0.1:1",
            *flags]  # fmt: skip
    return ServeArgs.from_namespace(build_parser().parse_args(argv))


def test_work_units_scale_with_size_frames_steps_and_outputs() -> None:
    p = GenerationParams("x", MEGAPIXEL_SQUARE, MEGAPIXEL_SQUARE, num_frames=5, num_inference_steps=10, num_outputs=2)
    assert work_units(Role.DENOISER, p) == 2 * 5 * 10
    assert work_units(Role.DECODER, p) == 2 * 5
    assert work_units(Role.ENCODER, p) == 2
    half = GenerationParams("x", 512, 1024, num_inference_steps=4)
    assert work_units(Role.DENOISER, half) == 0.5 * 4


def test_flags_override_the_role_defaults_and_anything_else_keeps_them(tiny_models: dict[str, Path]) -> None:
    flux = str(tiny_models["tiny-flux"])
    default = SimulatedPipeline.from_args(serve_args("--simulate", model=flux))
    assert default.cost == DEFAULT_COSTS[Role.DENOISER] and default.family == "flux"
    tuned = SimulatedPipeline.from_args(serve_args("--simulate", "--simulate-seconds", "0.5", model=flux))
    assert tuned.cost == StageCost(0.5, DEFAULT_COSTS[Role.DENOISER].seconds_per_unit)
    decoder = SimulatedPipeline.from_args(
        serve_args("--simulate", "--simulate-seconds-per-unit", "0", role="decoder", model=flux)
    )
    assert decoder.cost == StageCost(DEFAULT_COSTS[Role.DECODER].seconds, 0.0)


@pytest.mark.parametrize(
    ("flags", "role", "message"),
    [
        (("--simulate",), "server", "--simulate is for worker roles"),
        (("--simulate-seconds", "1"), "denoiser", "--simulate-seconds only applies with --simulate"),
        (("--simulate", "--simulate-seconds-per-unit", "-1"), "decoder", "per-unit -1.0 must be >= 0"),
        (("--disagg-drain-timeout", "0"), "denoiser", "--disagg-drain-timeout 0.0 must be > 0"),
    ],
)
def test_contradictory_simulation_and_drain_flags_are_refused_naming_the_flag(flags, role, message) -> None:
    argv = ["serve", "--model-path", "m", "--disagg-role", role, *flags]
    if role != "server":
        argv += ["--disagg-server-addr", "tcp://127.0.0.1:1"]
    else:
        argv += ["--encoder-urls", "tcp://127.0.0.1:2", "--denoiser-urls", "tcp://127.0.0.1:3",
                 "--decoder-urls", "tcp://127.0.0.1:4"]  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        ServeArgs.from_namespace(build_parser().parse_args(argv))


def test_simulation_and_drain_flags_survive_to_argv() -> None:
    args = serve_args("--simulate", "--simulate-seconds", "0.5", "--disagg-drain-timeout", "30")
    again = ServeArgs.from_namespace(build_parser().parse_args(["serve", *args.to_argv()]))
    assert (again.simulate, again.simulate_seconds, again.disagg_drain_timeout) == (True, 0.5, 30.0)
    assert "--simulate" not in serve_args().to_argv()


class VirtualClock:
    """Stands in for the time module of simulated.py: a sleep advances the clock at once, so the
    modelled time is exact whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def test_a_simulated_denoiser_takes_its_modelled_time_reports_every_step_and_emits_latents(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = SimulatedPipeline.from_args(
        serve_args("--simulate", "--simulate-seconds", "0.3", "--simulate-seconds-per-unit", "0",
                   model=str(tiny_models["tiny-flux"]))
    )  # fmt: skip
    clock = VirtualClock()
    monkeypatch.setattr(simulated, "time", clock)
    steps: list[tuple[int, int, float]] = []
    batch = StageBatch(GenerationParams("x", 64, 32, num_inference_steps=3, num_outputs=2))
    batch.on_progress = lambda step, total, latents=None: steps.append((step, total, clock.now))
    pipeline.run(batch)
    # The modelled 0.3 s once per call, not per step or per output (3 x 2 x 0.3 = 1.8 s), each step
    # reported at its own end.
    assert clock.now == pytest.approx(0.3)
    assert steps == [(1, 3, pytest.approx(0.1)), (2, 3, pytest.approx(0.2)), (3, 3, pytest.approx(0.3))]
    (latents,) = batch.tensors.values()
    assert isinstance(latents, np.ndarray) and latents.dtype == np.float32
    assert latents.shape == (2, (64 // 8) * (32 // 8), 16)  # tiny-flux: 2x2-packed latents of 4 channels


def test_a_simulated_denoiser_stops_at_a_step_boundary_when_asked_and_a_continuation_takes_the_rest(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = SimulatedPipeline.from_args(
        serve_args("--simulate", "--simulate-seconds", "0.4", "--simulate-seconds-per-unit", "0",
                   model=str(tiny_models["tiny-flux"]))
    )  # fmt: skip
    assert pipeline.hands_off
    clock = VirtualClock()
    monkeypatch.setattr(simulated, "time", clock)
    steps: list[int] = []
    params = GenerationParams("x", 64, 32, num_inference_steps=4)
    batch = StageBatch(params, tensors={"prompt_embeds": np.ones(3, np.float32)})
    batch.on_progress = lambda step, total, latents=None: steps.append(step)
    batch.hand_off = lambda: len(steps) == 1  # asked during its first step: it stops before the second
    pipeline.run(batch)
    assert steps == [1] and batch.meta[RESUME] == {"step": 1}
    assert set(batch.tensors) == {"prompt_embeds", "latents"}, "its inputs and latents travel on"
    resumed = StageBatch(params, tensors=batch.tensors, meta=dict(batch.meta))
    resumed.on_progress = batch.on_progress
    pipeline.run(resumed)
    assert steps == [1, 2, 3, 4] and clock.now == pytest.approx(0.4), "the steps left, in their modelled time"
    assert RESUME not in resumed.meta


def test_a_simulated_worker_process_never_imports_torch(tiny_models) -> None:
    """A whole simulated worker (Mooncake transport, numpy pool, stages, staging) runs a job without torch."""
    code = f"""
import sys
from triptych.cli import build_parser
from triptych.config import ServeArgs
from triptych.params import GenerationParams
from triptych_worker import compute, drain, pushes
from triptych_worker.runtime import Job, Worker
argv = ["serve", "--model-path", {str(tiny_models["tiny-wan"])!r}, "--disagg-role", "encoder", "--simulate",
        "--disagg-server-addr", "tcp://127.0.0.1:1", "--disagg-transfer-pool-size", "4MiB"]
worker = Worker(ServeArgs.from_namespace(build_parser().parse_args(argv)))
sent = []
class Link:
    def send(self, msg, frames=()):
        sent.append(msg)
compute.compute(worker, Link(), [Job("r1", GenerationParams("x", 64, 48, num_frames=5, guidance_scale=5.0))])
names = sorted(spec["name"] for spec in sent[-1].manifest)
worker.transport.close()
print(sent[-1].TYPE, names, "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # the encoder hands on embeddings only; the denoiser makes the latents from the seed
    assert out.stdout.split("\n")[-2] == "transfer_staged ['negative_prompt_embeds', 'prompt_embeds'] False"
