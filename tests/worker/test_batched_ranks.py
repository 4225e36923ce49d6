"""A multi-rank denoiser (two CPU ranks, gloo) runs a group of compatible requests as one batched
forward on every rank (worker/triptych_worker/parallel/ranks.py `run_many`): the latents are the
one-rank group's byte for byte, a request cancelled inside the group stops on every rank while the
others run on, a group handed off stops on every rank at one boundary, a member handed off alone leaves
the group there while the others run on, and the ranks stay in step for the next job.

Rank 0 runs in this process with one real follower process (tests.worker.test_resume_ranks).
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import torch

from tests.worker.test_resume import CASES, encoded
from tests.worker.test_resume_ranks import two_ranks
from triptych.roles import Role
from triptych_worker.pipeline import load_role_pipeline
from triptych_worker.resume import RESUME
from triptych_worker.stages import StageBatch

# (package, request case of test_resume, the denoiser's parallel flags): degrees whose two ranks make
# one rank's bytes (docs/parallelism.md), so the two-rank group is compared byte for byte.
TWO_RANKS = {
    "flux-ulysses2": ("tiny-flux", "flux", ("--num-gpus", "2")),
    "wan-unipc-cfg2": ("tiny-wan", "wan-unipc-cfg", ("--num-gpus", "2", "--cfg-parallel-size", "2")),
}
GROUP = 3


class Cancelled(Exception):
    """What a worker's progress callback raises for a request the head cancelled."""


@pytest.fixture(scope="module", params=sorted(TWO_RANKS))
def setup(request, tiny_models) -> Iterator[tuple[str, dict[str, object]]]:  # type: ignore[no-untyped-def]
    name, case, flags = TWO_RANKS[request.param]
    model = tiny_models[name]
    pipelines: dict[str, object] = {
        "encoder": load_role_pipeline(str(model), Role.ENCODER),
        "1": load_role_pipeline(str(model), Role.DENOISER),
    }
    with two_ranks(model, flags) as pipelines["2"]:
        yield case, pipelines


def group(pipelines, case: str, size: int = GROUP) -> list[StageBatch]:  # type: ignore[no-untyped-def]
    """`size` compatible requests (their prompts and seeds differ), encoded, as a denoiser receives them."""
    name, params = CASES[case]
    encoder = {(name, Role.ENCODER): pipelines["encoder"]}
    return [
        encoded(encoder, name, msgspec.structs.replace(params, prompt=f"{params.prompt} {i}", seed=params.seed + i))
        for i in range(size)
    ]


def run_many(pipeline, batches: list[StageBatch]) -> list[Exception | None]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return list(pipeline.run_many(batches))


def counted_group(pipelines, case: str) -> tuple[list[StageBatch], list[int]]:  # type: ignore[no-untyped-def]
    """A group, and the steps its first request reports as they run."""
    batches = group(pipelines, case)
    steps: list[int] = []
    batches[0].on_progress = lambda step, total, latents=None: steps.append(step)
    return batches, steps


def assert_same_tensors(one_rank: list[StageBatch], two_ranks: list[StageBatch]) -> None:
    """Every request of the two-rank group holds the one-rank group's tensors, byte for byte."""
    for one, two in zip(one_rank, two_ranks, strict=True):
        assert set(two.tensors) == set(one.tensors)
        for name in one.tensors:
            assert torch.equal(two.tensors[name], one.tensors[name]), name


def assert_ranks_in_step(pipelines, case: str) -> None:  # type: ignore[no-untyped-def]
    """The ranks are in step: the next job, a single request, runs as one rank's."""
    (alone,) = group(pipelines, case, 1)
    (again,) = group(pipelines, case, 1)
    with torch.no_grad():
        pipelines["2"].run(alone)
        pipelines["1"].run(again)
    assert torch.equal(alone.tensors["latents"], again.tensors["latents"])


def test_a_group_on_two_ranks_is_one_batched_forward_and_the_one_rank_group_byte_for_byte(setup) -> None:  # type: ignore[no-untyped-def]
    case, pipelines = setup
    one, two = group(pipelines, case), group(pipelines, case)
    reported: list[tuple[int, int]] = []
    for i, batch in enumerate(two):
        batch.on_progress = lambda step, total, latents=None, i=i: reported.append((i, step))
    assert run_many(pipelines["1"], one) == [None] * GROUP
    assert run_many(pipelines["2"], two) == [None] * GROUP
    for a, b in zip(one, two, strict=True):
        assert RESUME not in b.meta
        assert torch.equal(a.tensors["latents"], b.tensors["latents"])
    assert not torch.equal(two[0].tensors["latents"], two[1].tensors["latents"])  # each request its own rows
    assert reported[:GROUP] == [(i, 1) for i in range(GROUP)], "every request's first step came first: one forward"
    counters = pipelines["2"].last_counters
    assert len(counters) == 2 and counters[0][0] == counters[1][0] > 0, counters  # both ranks did the work


def test_a_request_cancelled_inside_a_group_stops_on_every_rank_and_the_others_run_on(setup) -> None:  # type: ignore[no-untyped-def]
    case, pipelines = setup
    whole = group(pipelines, case)
    assert run_many(pipelines["2"], whole) == [None] * GROUP

    def cancel_at_2(step: int, total: int, latents=None) -> None:  # type: ignore[no-untyped-def]
        if step == 2:
            raise Cancelled("the head cancelled it")

    batches = group(pipelines, case)
    batches[1].on_progress = cancel_at_2
    outcomes = run_many(pipelines["2"], batches)
    assert outcomes[0] is None and outcomes[2] is None and isinstance(outcomes[1], Cancelled), outcomes
    for i in (0, 2):
        assert torch.equal(batches[i].tensors["latents"], whole[i].tensors["latents"]), i

    every = group(pipelines, case)
    for batch in every:
        batch.on_progress = cancel_at_2
    assert all(isinstance(error, Cancelled) for error in run_many(pipelines["2"], every))  # the group stops

    assert_ranks_in_step(pipelines, case)


def test_a_group_handed_off_stops_on_every_rank_at_one_boundary_with_one_rank_s_state(setup) -> None:  # type: ignore[no-untyped-def]
    """A drain asks every request of a group to hand off: the group stops before one step on every
    rank and each request's state is what a one-rank group holds there."""
    case, pipelines = setup
    stopped = {}
    for where in ("1", "2"):
        batches, steps = counted_group(pipelines, case)
        for batch in batches:
            batch.hand_off = lambda: len(steps) == 3  # noqa: B023
        assert run_many(pipelines[where], batches) == [None] * GROUP
        assert steps == [1, 2, 3]
        stopped[where] = batches
    for one, two in zip(stopped["1"], stopped["2"], strict=True):
        assert two.meta[RESUME] == one.meta[RESUME] and two.meta[RESUME]["step"] == 3
    assert_same_tensors(stopped["1"], stopped["2"])


def test_a_member_asked_to_hand_off_stops_alone_on_every_rank_and_the_others_run_on(setup) -> None:  # type: ignore[no-untyped-def]
    """A drain asks one request of a group: it stops before step 3 on every rank with one rank's state,
    and the others run on from there on every rank, to the latents a one-rank group gives."""
    case, pipelines = setup
    done = {}
    for where in ("1", "2"):
        batches, steps = counted_group(pipelines, case)
        batches[1].hand_off = lambda: len(steps) == 3  # noqa: B023
        assert run_many(pipelines[where], batches) == [None] * GROUP
        assert steps == list(range(1, CASES[case][1].num_inference_steps + 1))
        assert [RESUME in b.meta for b in batches] == [False, True, False] and batches[1].meta[RESUME]["step"] == 3
        done[where] = batches
    assert_same_tensors(done["1"], done["2"])
    assert_ranks_in_step(pipelines, case)


def test_a_job_whose_parameters_pass_what_the_ranks_take_is_refused_on_rank_0_before_any_broadcast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group of edits whose inline reference images outgrow the ranks' job header fails those requests
    on rank 0, with a message naming `image`, before a byte goes to the followers (which stay in step);
    before, the followers refused the header and exited, and the instance with them. (The limit made
    small here: at its size, 1 GiB, a group of fifty 16 MiB references.)"""
    from types import SimpleNamespace

    from triptych.params import GenerationParams
    from triptych.protocol.codec import MAX_HEADER_BYTES as CONTROL_HEADER_BYTES
    from triptych_worker.parallel import jobs
    from triptych_worker.stages import StageBatch

    assert jobs.MAX_HEADER_BYTES >= 50 * CONTROL_HEADER_BYTES  # a group of requests each at the control limit
    monkeypatch.setattr(jobs, "MAX_HEADER_BYTES", 1 << 20)
    send_jobs = jobs.send_jobs
    mesh = SimpleNamespace(device="cpu")  # no process group: any broadcast would raise a RuntimeError
    reference = GenerationParams("make it blue", 16, 16, image=b"\x89PNG" + bytes(jobs.MAX_HEADER_BYTES // 4))
    group = [StageBatch(msgspec.structs.replace(reference, prompt=f"edit {i}")) for i in range(5)]
    with pytest.raises(ValueError, match=r"^image: the 5 request\(s\) carry \d+ bytes of parameters"):
        send_jobs(mesh, group)  # type: ignore[arg-type]
