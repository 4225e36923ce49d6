"""Compatible requests run as one batched forward per stage (RolePipeline.run_many), with the tiny
models on CPU, against the same requests run one at a time.

Measured here (and stated in docs/batching.md): the text encoders give byte-identical embeddings
batched, and each request's initial noise is its own seed's; the DiT (denoising) and the VAE
(decoding) differ in the last float bits, because CPU matmul and convolution kernels block a batch
of N rows differently from one row and so sum in another order. After rounding to uint8 a handful
of pixel values move by 1 (about 1 in 10^4 here).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_worker.pipeline import RolePipeline, load_role_pipeline
from triptych_worker.stages import PIXELS, StageBatch

FLUX = GenerationParams("x", width=64, height=48, num_inference_steps=3, guidance_scale=3.5, max_sequence_length=32)
WAN = GenerationParams("x", width=48, height=32, num_frames=5, num_inference_steps=3, guidance_scale=5.0,
                       negative_prompt="blurry", max_sequence_length=32)  # fmt: skip
CASES = {"flux": ("tiny-flux", FLUX), "wan": ("tiny-wan", WAN)}
PIXEL_TOLERANCE = 1  # uint8 levels
PIXEL_SHARE = 0.01  # at most this share of pixel values may differ at all
LATENT_TOLERANCE = 1e-4  # absolute, on latents of unit scale


def requests(base: GenerationParams, n: int = 4) -> list[GenerationParams]:
    """Compatible requests with different prompts and seeds."""
    return [msgspec.structs.replace(base, prompt=f"prompt {i} " * (i + 1), seed=100 + i) for i in range(n)]


@pytest.fixture(scope="module")
def pipelines(tiny_models: dict[str, Path]) -> dict[str, RolePipeline]:
    return {case: load_role_pipeline(str(tiny_models[name]), Role.MONOLITHIC) for case, (name, _) in CASES.items()}


def run_stagewise(pipeline: RolePipeline, params: list[GenerationParams]) -> list[tuple[str, list, list]]:
    """Every stage's outputs, alone and batched: [(stage, [tensors alone...], [tensors batched...])]."""
    alone = [StageBatch(params=p) for p in params]
    batched = [StageBatch(params=p) for p in params]
    out = []
    with torch.no_grad():
        for stage in pipeline.stages:
            for batch in alone:
                stage.run(batch)
            assert stage.run_many(batched) == [None] * len(batched)
            out.append((stage.name, [dict(b.tensors) for b in alone], [dict(b.tensors) for b in batched]))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_stages_match_requests_run_alone(pipelines: dict[str, RolePipeline], case: str):
    stages = run_stagewise(pipelines[case], requests(CASES[case][1]))
    by_stage = {name: (alone, batched) for name, alone, batched in stages}
    for name in ("TextEncodingStage", "LatentPreparationStage"):  # the math allows: byte-identical
        alone, batched = by_stage[name]
        for a, b in zip(alone, batched, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), (name, key)
    alone, batched = by_stage["DenoisingStage"]
    for a, b in zip(alone, batched, strict=True):
        assert (a["latents"] - b["latents"]).abs().max() <= LATENT_TOLERANCE
    alone, batched = by_stage["DecodingStage"]
    for a, b in zip(alone, batched, strict=True):
        pa, pb = a[PIXELS].numpy().astype(int), b[PIXELS].numpy().astype(int)
        assert pa.shape == pb.shape
        assert np.abs(pa - pb).max() <= PIXEL_TOLERANCE
        assert np.mean(pa != pb) <= PIXEL_SHARE


def test_each_request_keeps_its_own_progress_and_rows_of_the_latents(pipelines: dict[str, RolePipeline]):
    params = requests(FLUX, 3)
    seen: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(3)}
    batches = [StageBatch(params=p) for p in params]
    for i, batch in enumerate(batches):
        batch.on_progress = lambda step, total, latents, i=i: seen[i].append((step, total, len(latents)))
    assert pipelines["flux"].run_many(batches) == [None, None, None]
    for i in range(3):
        assert seen[i] == [(1, 3, 1), (2, 3, 1), (3, 3, 1)]  # one row each: its own output's latents


def test_a_request_that_drops_out_mid_batch_does_not_lose_the_others(pipelines: dict[str, RolePipeline]):
    params = requests(FLUX, 3)

    def cancel_at_step_2(step: int, total: int, latents: object) -> None:
        if step == 2:
            raise RuntimeError("cancelled by the head")

    batches = [StageBatch(params=p) for p in params]
    batches[1].on_progress = cancel_at_step_2
    outcomes = pipelines["flux"].run_many(batches)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], RuntimeError) and "cancelled" in str(outcomes[1])
    alone = pipelines["flux"].run(StageBatch(params=params[2])).tensors[PIXELS].numpy().astype(int)
    assert np.abs(batches[2].tensors[PIXELS].numpy().astype(int) - alone).max() <= PIXEL_TOLERANCE


def test_an_invalid_request_fails_alone_and_the_rest_run_batched(pipelines: dict[str, RolePipeline]):
    params = requests(FLUX, 3)
    params[0] = msgspec.structs.replace(params[0], width=60)  # not a multiple of the latent patch
    batches = [StageBatch(params=p) for p in params]
    outcomes = pipelines["flux"].run_many(batches)
    assert isinstance(outcomes[0], ValueError) and "width" in str(outcomes[0])
    assert outcomes[1:] == [None, None]
    assert all(b.tensors[PIXELS].shape == (1, 1, 48, 64, 3) for b in batches[1:])


def test_a_merge_of_requests_that_hand_on_different_tensors_is_refused() -> None:
    """A backstop behind the keys: one request's tensors (an edit's reference) are never dropped by a merge."""
    from triptych_worker.batching import merge

    plain = StageBatch(FLUX, {"latents": torch.zeros(1, 4)})
    edit = StageBatch(FLUX, {"latents": torch.zeros(1, 4), "image_latents": torch.zeros(1, 4)})
    for batches in ([plain, edit], [edit, plain]):
        with pytest.raises(ValueError, match="hand on different tensors \\(image_latents\\)"):
            merge(batches, frozenset())


def test_a_split_batch_gives_every_request_but_the_first_its_own_shared_tensors() -> None:
    """A shared tensor (positional ids) is the first request's, maybe a view on its receive slot, which
    is given back once its outputs are staged: another request's must not read that memory later."""
    from triptych_worker.batching import merge, split

    slot = torch.arange(12, dtype=torch.float32)  # stands for the first request's receive slot
    batches = [
        StageBatch(
            FLUX,
            {"latents": torch.full((1, 4), float(i)), "ids": slot[:6].view(2, 3) if i == 0 else slot[6:].view(2, 3)},
        )
        for i in range(3)
    ]
    merged = merge(batches, frozenset({"ids"}))
    split(merged, batches, frozenset({"ids"}))
    first_ids = batches[0].tensors["ids"]
    assert first_ids.data_ptr() == slot.data_ptr()  # the first request keeps its own (its slot it detaches itself)
    slot.fill_(-1.0)  # the slot given back and written by the next transfer
    for i, batch in enumerate(batches[1:], start=1):
        assert batch.tensors["ids"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], i
        assert batch.tensors["latents"].tolist() == [[float(i)] * 4]
