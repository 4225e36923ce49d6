"""A multi-rank denoiser (two CPU ranks, gloo) stops at a step boundary on every rank, hands on the
whole state from rank 0, and continues a continuation on every rank: the pixels are those of a
request that never moved, byte for byte (worker/triptych_worker/parallel/handoff.py; docs/design.md
"Migration").

Rank 0 runs in this process (ParallelPipeline, as `triptych serve --num-gpus 2` does) with one
real follower process; every hand-off goes over the wire (tests.worker.test_resume), between the
two-rank denoiser and one-rank ones, in both directions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
import torch

from tests.worker.test_resume import CASES, STEPS, encoded
from tests.worker.test_role_pipelines import over_the_wire
from triptych.cli import build_parser
from triptych.config import ServeArgs
from triptych.lora import LoraCatalog
from triptych.roles import Role
from triptych_dev.localdeploy import free_port_block
from triptych_worker.parallel.full import FullPipelineRanks
from triptych_worker.parallel.handoff import fingerprint
from triptych_worker.parallel.ranks import ParallelPipeline, Rank
from triptych_worker.pipeline import RolePipeline, load_role_pipeline
from triptych_worker.resume import RESUME, CannotResume
from triptych_worker.stages import PIXELS, StageBatch

# (package, request case of test_resume, the denoiser's parallel flags, whether two ranks make one
# rank's bytes: TP's all-reduce sums in another order, so its pixels are within a level of one rank's
# (docs/parallelism.md) and its moves are checked among two-rank denoisers only)
TWO_RANKS = {
    "flux-ulysses2": ("tiny-flux", "flux", ("--num-gpus", "2"), True),  # Ulysses derived from the heads
    "wan-unipc-cfg2": ("tiny-wan", "wan-unipc-cfg", ("--num-gpus", "2", "--cfg-parallel-size", "2"), True),
    "wan-unipc-ulysses2": ("tiny-wan", "wan-unipc-cfg", ("--num-gpus", "2", "--denoiser-ulysses", "2"), True),
    "wan-unipc-tp2": ("tiny-wan", "wan-unipc-cfg", ("--num-gpus", "2", "--denoiser-tp", "2"), False),
}
# Which denoiser each hop runs on ("2": the two-rank one, "1": a one-rank one), and the steps it stops before.
ROUTES = [
    (("2", "2"), [3]),  # once, back onto the two ranks
    (("2", "1"), [STEPS - 1]),  # two ranks to one
    (("1", "2"), [1]),  # one rank to two
    (("2", "1", "2", "1"), [1, 3, 5]),  # three moves, both directions
    (("2", "2", "2", "2"), [1, 2, 4]),  # three moves, two ranks each time
]


@contextmanager
def two_ranks(
    model: Path, flags: tuple[str, ...], rank0_flags: tuple[str, ...] = (), lora_catalog: LoraCatalog | None = None
) -> Iterator[ParallelPipeline]:
    """Rank 0 here and its follower process, as `start_ranks` starts them (without its watchdog,
    which would end this process when the fixture stops the follower); `rank0_flags`: rank 0's alone;
    `lora_catalog`: rank 0's, as the worker gives it (else one from the flags)."""
    argv = ["serve", "--model-path", str(model), "--disagg-role", "denoiser", "--device", "cpu",
            "--disagg-server-addr", "tcp://127.0.0.1:1", "--master-port", str(free_port_block(1)), *flags]  # fmt: skip
    args = ServeArgs.from_namespace(build_parser().parse_args([*argv, *rank0_flags]))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    follower_args = ServeArgs.from_namespace(build_parser().parse_args(argv))
    argv = [sys.executable, "-m", "triptych_worker.parallel.follower", "1", *follower_args.to_argv()]
    follower = subprocess.Popen(argv, env=env)
    ranks = None
    try:
        catalog = lora_catalog if lora_catalog is not None else LoraCatalog.from_flags(args.lora, args.lora_catalog)
        ranks = ParallelPipeline(Rank.start(args, 0, catalog), [follower])
        yield ranks
    finally:
        if ranks is not None:
            ranks.rank.mesh.close()
        follower.kill()
        follower.wait(30)


@pytest.fixture(scope="module", params=sorted(TWO_RANKS))
def setup(request, tiny_models) -> Iterator[tuple[str, bool, dict[str, object]]]:  # type: ignore[no-untyped-def]
    name, case, flags, exact = TWO_RANKS[request.param]
    model = tiny_models[name]
    pipelines: dict[str, object] = {
        "encoder": load_role_pipeline(str(model), Role.ENCODER),
        "decoder": load_role_pipeline(str(model), Role.DECODER),
        "1": load_role_pipeline(str(model), Role.DENOISER),
    }
    with two_ranks(model, flags) as pipelines["2"]:
        yield case, exact, pipelines


def generate(pipelines, case: str, route: tuple[str, ...], stops: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Denoise on each denoiser of `route` in turn, stopping before each step of `stops`, then decode."""
    name, params = CASES[case]
    encoder: RolePipeline = pipelines["encoder"]
    batch = encoded({(name, Role.ENCODER): encoder}, name, params)
    pending, reached = list(stops), [0]

    def progress(step: int, total: int, latents=None) -> None:  # type: ignore[no-untyped-def]
        reached[0] = step

    for hop, where in enumerate(route):
        batch.on_progress = progress
        batch.hand_off = lambda: bool(pending) and reached[0] == pending[0]
        with torch.no_grad():
            batch = pipelines[where].run(batch)
        if hop < len(route) - 1:
            assert batch.meta[RESUME]["step"] == pending.pop(0), (route, stops)
        batch = over_the_wire(batch)
    assert RESUME not in batch.meta and not pending
    return pipelines["decoder"].run(batch).tensors[PIXELS]


def test_a_request_moved_to_from_and_between_two_rank_denoisers_gives_the_unmoved_pixels(setup) -> None:  # type: ignore[no-untyped-def]
    case, exact, pipelines = setup
    unmoved = generate(pipelines, case, ("2",), [])
    if exact:
        assert torch.equal(generate(pipelines, case, ("1",), []), unmoved), "two ranks differ from one, unmoved"
    for route, stops in ROUTES:
        if exact or "1" not in route:
            assert torch.equal(generate(pipelines, case, route, stops), unmoved), (route, stops)


def test_every_rank_stops_at_the_same_boundary_and_rank_zero_stages_the_whole_state(setup) -> None:  # type: ignore[no-untyped-def]
    """The state rank 0 hands on is a one-rank denoiser's at that boundary (tensor for tensor where
    two ranks make one rank's bytes), and the ranks are in step for the next job."""
    case, exact, pipelines = setup
    name, params = CASES[case]
    states = {}
    for where in ("1", "2"):
        batch = encoded({(name, Role.ENCODER): pipelines["encoder"]}, name, params)
        steps: list[int] = []
        batch.on_progress = lambda step, total, latents=None: steps.append(step)  # noqa: B023
        batch.hand_off = lambda: len(steps) == 3  # noqa: B023
        with torch.no_grad():
            states[where] = pipelines[where].run(batch)
        assert steps == [1, 2, 3]
    one, two = states["1"], states["2"]
    assert two.meta[RESUME] == one.meta[RESUME] and two.meta[RESUME]["step"] == 3
    assert set(two.tensors) == set(one.tensors)
    for tensor in one.tensors:
        if exact:
            assert torch.equal(two.tensors[tensor], one.tensors[tensor]), tensor
        else:
            torch.testing.assert_close(two.tensors[tensor], one.tensors[tensor], msg=tensor)
    counters = pipelines["2"].last_counters
    assert len(counters) == 2 and counters[0][0] == counters[1][0] > 0, counters  # both ranks did 3 steps' work


@pytest.mark.parametrize(("field", "value"), [("width", 17), ("num_inference_steps", 0), ("num_outputs", 10**9)])
def test_several_ranks_check_parameters_as_one_device_does(setup, field: str, value: int) -> None:  # type: ignore[no-untyped-def]
    """A worker checks a request's parameters at every role before it allocates or computes
    (compute._prepare): a multi-device denoiser, alone or as a full-pipeline worker's middle, refuses
    what one device refuses, with its words, rather than leaving it to the head's check."""
    case, _, pipelines = setup
    params = msgspec.structs.replace(CASES[case][1], **{field: value})
    with pytest.raises(ValueError) as one:
        pipelines["1"].validate(params)
    assert str(one.value).startswith(f"{field} {value}"), one.value
    full = FullPipelineRanks(pipelines["encoder"], pipelines["2"], pipelines["decoder"])
    for ranks in (pipelines["2"], full):
        with pytest.raises(ValueError) as several:
            ranks.validate(params)
        assert str(several.value) == str(one.value)
    for ranks in (pipelines["1"], pipelines["2"], full):
        ranks.validate(CASES[case][1])  # what one device serves, several do


def test_a_fingerprint_tells_any_changed_bit_apart() -> None:
    a = torch.linspace(-1, 1, 1000)
    assert torch.equal(fingerprint(a), fingerprint(a.clone()))
    for i in (0, 499, 999):
        b = a.clone()
        b[i] = torch.nextafter(b[i], torch.tensor(2.0))
        assert not torch.equal(fingerprint(a), fingerprint(b)), i
    assert not torch.equal(fingerprint(a), fingerprint(a.flip(0)))  # same values elsewhere: a shard's swap
    assert not torch.equal(fingerprint(a), fingerprint(a[:500]))  # a shard
    assert not torch.equal(fingerprint(torch.zeros(3)), fingerprint(-torch.zeros(3)))
    assert fingerprint(a.to(torch.bfloat16)).shape == (3,)


def test_a_job_handed_off_before_its_first_step_is_a_continuation_at_step_zero(setup) -> None:  # type: ignore[no-untyped-def]
    """Handed off before its first step (the HandOff came as the job started): a continuation at step 0."""
    case, _, pipelines = setup
    name, params = CASES[case]
    batch: StageBatch = encoded({(name, Role.ENCODER): pipelines["encoder"]}, name, params)
    batch.on_progress = lambda step, total, latents=None: None
    batch.hand_off = lambda: True  # before the first step
    with torch.no_grad():
        batch = pipelines["2"].run(batch)
    assert batch.meta[RESUME]["step"] == 0 and "latents" in batch.tensors
    over_the_wire(batch)


def test_a_continuation_that_cannot_be_restored_fails_alone_and_the_ranks_stay_in_step(setup) -> None:  # type: ignore[no-untyped-def]
    """Every rank refuses the same restore (CannotResume) before its first step: the request fails,
    the instance stays, and the next job runs on both ranks."""
    case, _, pipelines = setup
    name, params = CASES[case]
    batch: StageBatch = encoded({(name, Role.ENCODER): pipelines["encoder"]}, name, params)
    steps: list[int] = []
    batch.on_progress = lambda step, total, latents=None: steps.append(step)
    batch.hand_off = lambda: len(steps) == 2
    with torch.no_grad():
        batch = over_the_wire(pipelines["2"].run(batch))
    batch.meta[RESUME]["scheduler"]["class"] = "DDIMScheduler"
    with pytest.raises(CannotResume, match="DDIMScheduler"), torch.no_grad():
        pipelines["2"].run(batch)
    assert torch.equal(generate(pipelines, case, ("2",), []), generate(pipelines, case, ("2", "2"), [2]))
