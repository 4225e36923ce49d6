"""A multi-device denoiser (two CPU ranks, gloo) with a request's LoRA adapters and its step cache
(worker/triptych_worker/parallel/ranks.py, lora.py, step_cache.py).

Every rank loads the adapters rank 0's catalogue names as it sends the job (the follower here is
started without any: it can only have them from the job), and the latents are a one-rank
denoiser's with the same adapters byte for byte (TP ranks, each holding its shards of the layers and
of the adapters' factors: within a tolerance), an adapter on FLUX's root `proj_out` (where the
sequence shards are joined) included; a request without adapters after them is the base model's.
An adapter that does not load fails its request on every rank, and the ranks are in step for the
next job. Every step cache mode gives the one-rank denoiser's latents with the same skips, the
first-block cache deciding on the whole sequence where each rank holds a shard of it.

Rank 0 runs in this process with one real follower process (tests.worker.test_resume_ranks).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from tests.worker.test_resume import CASES, encoded
from tests.worker.test_resume_ranks import two_ranks
from tests.worker.test_role_pipelines import over_the_wire
from triptych.families import read_rules
from triptych.families.wan import uses_cfg
from triptych.lora import BadAdapter, LoraCatalog
from triptych.params import LoraWeight
from triptych.roles import Role
from triptych_worker.pipeline import RolePipeline, load_role_pipeline
from triptych_worker.resume import RESUME
from triptych_worker.stages import StageBatch
from triptych_worker.step_cache import SHARED_BY_BRANCHES

# (package, request case of test_resume, the denoiser's parallel flags): CFG and Ulysses ranks make one
# rank's bytes (docs/parallelism.md), so their latents are compared byte for byte; TP ranks sum each
# row-parallel product (and an adapter's share of it) in another order: within TP_LATENT_TOLERANCE.
TWO_RANKS = {
    "flux-ulysses2": ("tiny-flux", "flux", ("--num-gpus", "2")),
    "flux-tp2": ("tiny-flux", "flux", ("--num-gpus", "2", "--denoiser-tp", "2")),
    "wan-unipc-cfg2": ("tiny-wan", "wan-unipc-cfg", ("--num-gpus", "2", "--cfg-parallel-size", "2")),
    "wan-unipc-ulysses2": ("tiny-wan", "wan-unipc-cfg", ("--num-gpus", "2", "--denoiser-ulysses", "2")),
    "wan-unipc-tp2": ("tiny-wan", "wan-unipc-cfg", ("--num-gpus", "2", "--denoiser-tp", "2")),
}
TP_LATENT_TOLERANCE = 1e-4  # the latents differ by up to ~2e-5
# The adapters each family's requests name, with weights: the *-out ones adapt the transformer's own
# proj_out, whose output the sequence-parallel ranks join.
ADAPTERS = {
    "tiny-flux": (("flux-ink", 0.8), ("flux-out", 1.3), ("flux-paper", 0.7)),
    "tiny-wan": (("wan-ink", 1.0), ("wan-out", 1.2)),
}
MISFITS = {"tiny-flux": ("flux-misfit", "gone"), "tiny-wan": ("gone",)}  # fail to load, on every rank
MODES: dict[str, dict[str, Any]] = {  # a generous first_block threshold: the tiny models' few steps skip some
    "first_block": {"step_cache": "first_block", "step_cache_threshold": 0.5},
    "pyramid_attention_broadcast": {"step_cache": "pyramid_attention_broadcast"},
    "taylorseer": {"step_cache": "taylorseer", "step_cache_interval": 2},
}
GIB = 1 << 30


@pytest.fixture(scope="module", params=sorted(TWO_RANKS))
def setup(request, tiny_models, tiny_loras) -> Iterator[tuple[str, str, dict[str, Any]]]:  # type: ignore[no-untyped-def]
    name, case, flags = TWO_RANKS[request.param]
    model = tiny_models[name]
    entries = {adapter: str(path) for adapter, path in tiny_loras.items()}
    entries["gone"] = str(tiny_loras["flux-ink"].parent / "no-such-adapter")
    lora_flags = tuple(flag for adapter, source in entries.items() for flag in ("--lora", f"{adapter}={source}"))
    pipelines: dict[str, Any] = {
        "encoder": load_role_pipeline(str(model), Role.ENCODER),
        "1": load_role_pipeline(str(model), Role.DENOISER, "cpu", 0, LoraCatalog(entries), GIB),
    }
    with two_ranks(model, flags, rank0_flags=lora_flags) as pipelines["2"]:  # the follower has no catalogue
        yield name, case, pipelines


def latents(pipelines: dict[str, Any], case: str, where: str, **changes: Any) -> torch.Tensor:
    """The request of `case` (with `changes`), encoded, denoised on `where`: its latents."""
    (batch,) = requests(pipelines, case, [changes])
    with torch.no_grad():
        return pipelines[where].run(batch).tensors["latents"]


def requests(pipelines: dict[str, Any], case: str, changes: list[dict[str, Any]]) -> list[StageBatch]:
    """The request of `case` with each of `changes`, encoded, as a denoiser receives them (the encoder
    holds no adapters: these have no text-encoder part, so their prompt embeddings are the base model's)."""
    name, params = CASES[case]
    encoder = {(name, Role.ENCODER): pipelines["encoder"]}
    batches = []
    for change in changes:
        request = msgspec.structs.replace(params, **change)
        batch = encoded(encoder, name, msgspec.structs.replace(request, loras=()))
        batch.params = request
        batches.append(batch)
    return batches


def same(pipelines: dict[str, Any], two: torch.Tensor, one: torch.Tensor) -> bool:
    """Two ranks' latents against one rank's: byte for byte, or within TP_LATENT_TOLERANCE for TP ranks."""
    if pipelines["2"].rank.degrees.tp == 1:
        return torch.equal(two, one)
    return bool((two - one).abs().max() <= TP_LATENT_TOLERANCE)


def apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` differ far beyond any tolerance here (what a test's change must do to prove anything)."""
    return bool((a - b).abs().max() > 10 * TP_LATENT_TOLERANCE)


def adapters(*named: tuple[str, float]) -> tuple[LoraWeight, ...]:
    return tuple(LoraWeight(name, weight) for name, weight in named)


def test_adapters_on_two_ranks_give_one_rank_s_latents_and_the_base_model_after_them(setup) -> None:  # type: ignore[no-untyped-def]
    model, case, pipelines = setup
    loras = adapters(*ADAPTERS[model])
    base = latents(pipelines, case, "1")
    one = latents(pipelines, case, "1", loras=loras)
    assert apart(one, base), "the adapters change nothing: the test would prove nothing"
    assert same(pipelines, latents(pipelines, case, "2", loras=loras), one), "two ranks with adapters differ from one"
    ranks: Any = pipelines["2"]
    assert set(ranks.loras.held()) == {lora.name for lora in loras}  # what the heartbeats report
    assert same(pipelines, latents(pipelines, case, "2"), base), "a request without adapters after them is not the base"
    first = loras[:1]
    assert same(pipelines, latents(pipelines, case, "2", loras=first), latents(pipelines, case, "1", loras=first))


def test_an_adapter_that_does_not_load_fails_its_request_on_every_rank_and_the_next_job_runs(setup) -> None:  # type: ignore[no-untyped-def]
    model, case, pipelines = setup
    for bad in (*MISFITS[model], "not-in-the-catalogue"):
        with pytest.raises(BadAdapter, match=rf"^loras: adapter '{bad}'"):
            latents(pipelines, case, "2", loras=adapters((bad, 1.0)))
    loras = adapters(*ADAPTERS[model])
    assert same(pipelines, latents(pipelines, case, "2", loras=loras), latents(pipelines, case, "1", loras=loras))


def test_a_request_with_adapters_moved_between_two_ranks_and_one_gives_the_unmoved_latents(setup) -> None:  # type: ignore[no-untyped-def]
    """Migration: a continuation names its adapters like any job, and each denoiser it reaches applies them."""
    model, case, pipelines = setup
    loras = adapters(*ADAPTERS[model])
    unmoved = latents(pipelines, case, "1", loras=loras)
    (batch,) = requests(pipelines, case, [{"loras": loras}])
    for where, stop in (("2", 2), ("1", 4), ("2", None)):
        reached = [0]
        batch.on_progress = lambda step, total, latents=None, reached=reached: reached.__setitem__(0, step)
        batch.hand_off = None if stop is None else lambda reached=reached, stop=stop: reached[0] == stop
        with torch.no_grad():
            batch = pipelines[where].run(batch)
        if stop is None:
            assert RESUME not in batch.meta
        else:
            assert batch.meta[RESUME]["step"] == stop, (where, batch.meta)
        batch = over_the_wire(batch)
    assert same(pipelines, batch.tensors["latents"], unmoved)


def test_a_group_with_adapters_is_one_rank_s_group_and_one_whose_adapter_fails_fails_every_member(setup) -> None:  # type: ignore[no-untyped-def]
    """Batching: compatible requests (the same adapters) as one batched forward on every rank."""
    model, case, pipelines = setup
    loras = adapters(*ADAPTERS[model])
    one, two = group(pipelines, case, loras), group(pipelines, case, loras)
    with torch.no_grad():
        assert pipelines["1"].run_many(one) == [None, None]
        assert pipelines["2"].run_many(two) == [None, None]
    for a, b in zip(one, two, strict=True):
        assert same(pipelines, b.tensors["latents"], a.tensors["latents"])
    with torch.no_grad():
        outcomes = pipelines["2"].run_many(group(pipelines, case, adapters(("gone", 1.0))))
    assert [type(error) for error in outcomes] == [BadAdapter, BadAdapter], outcomes
    assert same(pipelines, latents(pipelines, case, "2", loras=loras), latents(pipelines, case, "1", loras=loras))


def group(pipelines: dict[str, Any], case: str, loras: tuple[LoraWeight, ...]) -> list[StageBatch]:
    """Two compatible requests (their prompts and seeds differ), encoded, as a denoiser receives them."""
    _, params = CASES[case]
    changes = [{"prompt": f"{params.prompt} {i}", "seed": params.seed + i, "loras": loras} for i in range(2)]
    return requests(pipelines, case, changes)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_step_cache_mode_on_two_ranks_gives_one_rank_s_latents_with_its_skips(setup, mode: str) -> None:  # type: ignore[no-untyped-def]
    _, case, pipelines = setup
    if mode not in read_rules(pipelines["1"].adapter.package.path).step_cache_modes:
        return  # the family does not serve it (FamilyRules.step_cache_modes): Wan and taylorseer
    one_rank: RolePipeline = pipelines["1"]
    ranks: Any = pipelines["2"]
    request = MODES[mode]
    branches = ranks.rank.degrees.cfg > 1 and uses_cfg(msgspec.structs.replace(CASES[case][1], **request))
    if branches and mode in SHARED_BY_BRANCHES:
        with pytest.raises(ValueError, match=rf"^step_cache: {mode} keeps one cache for both guidance branches"):
            latents(pipelines, case, "2", **request)
        # One branch, which every rank runs (no negative prompt: it would steer no guidance).
        request, branches = {**request, "guidance_scale": 1.0, "negative_prompt": None}, False
    counts = {where: _skipped(p, mode) for where, p in (("1", one_rank), ("2", ranks))}
    one = latents(pipelines, case, "1", **request)
    two = latents(pipelines, case, "2", **request)
    assert same(pipelines, two, one), f"{mode}: two ranks differ from one"
    plain = {k: v for k, v in request.items() if not k.startswith("step_cache")}
    assert apart(one, latents(pipelines, case, "1", **plain)), f"{mode} skipped nothing: proves nothing"
    skipped = {where: _skipped(p, mode) - counts[where] for where, p in (("1", one_rank), ("2", ranks))}
    if branches:
        assert skipped["2"] > 0  # rank 0 counts its own guidance branch's skips: one of the two
    else:
        assert skipped["2"] == skipped["1"] > 0, skipped
    assert not ranks.rank.pipeline.adapter.pipe.transformer.is_cache_enabled  # the hook is gone after the job


def _skipped(pipeline: Any, mode: str) -> int:
    stats = {s.mode: s for s in pipeline.step_cache.stats()}
    return stats[mode].skipped if mode in stats else 0
