"""A TP rank loads its transformer on the CPU and moves only its shards to its device.

Loaded on the device first, every rank's device would have to hold the whole transformer before
dropping what it does not keep, which defeats TP for a model larger than one device. No GPU runs
here, so the rank's device is torch's `meta` device (tensors without storage): what reaches it, and
when, is what is checked; the real TP ranks' pixels are tests/e2e/test_parallel_ranks.py's.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_parallel_ranks import tp_shard_bytes
from triptych.parallelism import Parallelism
from triptych.roles import Role
from triptych_worker.parallel.apply import parallelize
from triptych_worker.parallel.layout import RankLayout
from triptych_worker.parallel.mesh import RankMesh
from triptych_worker.pipeline import load_role_pipeline


def transformer_bytes(pipe) -> int:  # type: ignore[no-untyped-def]
    return sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())


@pytest.mark.parametrize("package", ["tiny-flux", "tiny-wan"])
def test_a_tp_rank_moves_only_its_shards_to_its_device(tiny_models, monkeypatch, package) -> None:
    pipeline = load_role_pipeline(tiny_models[package], Role.DENOISER, "cpu")  # as Rank.start loads a TP rank
    pipe = pipeline.adapter.pipe
    moved: list[int] = []
    to_device = pipe.to

    def to(device: str):  # type: ignore[no-untyped-def]
        moved.append(transformer_bytes(pipe))  # what is on its way to the device
        return to_device(device)

    monkeypatch.setattr(pipe, "to", to)
    mesh = RankMesh(rank=1, layout=RankLayout(Parallelism(tp=2)), device="meta")
    parallelize(pipeline, mesh)
    full, shard = tp_shard_bytes(tiny_models[package], package.removeprefix("tiny-"), 2)
    assert moved == [shard] and shard < 0.8 * full  # one move, of this rank's shards only
    assert pipeline.adapter.device == "meta"  # the stages run on the rank's device from now on
    assert {p.device.type for p in pipe.transformer.parameters()} == {"meta"}


def test_a_rank_without_tp_is_loaded_on_its_device_and_not_moved(tiny_models, monkeypatch) -> None:
    pipeline = load_role_pipeline(tiny_models["tiny-wan"], Role.DENOISER, "cpu")
    monkeypatch.setattr(pipeline.adapter.pipe, "to", lambda device: pytest.fail(f"moved to {device}"))
    parallelize(pipeline, RankMesh(rank=1, layout=RankLayout(Parallelism(cfg=2)), device="cpu"))
    assert pipeline.adapter.device == "cpu"
