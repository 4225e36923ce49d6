"""`--dtype`: a role's model loads and computes in bfloat16 as the stock pipeline does with `dtype`.

Roles loaded in bfloat16 and split over the wire give the stock bfloat16 pipeline's pixels byte for
byte, as monolithic mode does, handing on what the family's specs declare (FLUX: everything in
bfloat16; Wan: its embeddings in bfloat16 and its latents in float32, as WanPipeline steps them).
Roles may differ: a receiver casts its inputs to the dtype it makes them in, so Wan's own recipe (a
float32 VAE under a bfloat16 pipeline) is a float32 decoder after bfloat16 roles, with the stock
recipe's bytes; a FLUX denoiser in float32 after a bfloat16 encoder computes in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan, DiffusionPipeline

from tests.worker.test_role_pipelines import CASES, THREE_ROLES, over_the_wire, stock_run
from triptych.roles import Role
from triptych_worker.pipeline import RolePipeline, load_role_pipeline
from triptych_worker.stages import PIXELS, StageBatch

BF16 = "bfloat16"
SPLIT = sorted(case for case in CASES if case != "flux-kontext")  # edits: tests/e2e/test_edits.py's, float32


@pytest.fixture(scope="module")
def pipelines(tiny_models: dict[str, Path]) -> dict[tuple[str, Role, str], RolePipeline]:
    """(package, role, dtype) -> its role pipeline, as a process with --dtype loads it."""
    out = {}
    for name in ("tiny-flux", "tiny-wan"):
        for role in (*THREE_ROLES, Role.MONOLITHIC):
            out[name, role, BF16] = load_role_pipeline(str(tiny_models[name]), role, dtype=BF16)
        out[name, Role.DENOISER, "float32"] = load_role_pipeline(str(tiny_models[name]), Role.DENOISER)
        out[name, Role.DECODER, "float32"] = load_role_pipeline(str(tiny_models[name]), Role.DECODER)
    return out


def split(pipelines, name: str, params, dtypes: tuple[str, str, str]) -> list[StageBatch]:  # type: ignore[no-untyped-def]
    """The request through encoder, denoiser and decoder of the given dtypes: what each hands on."""
    handed, batch = [], StageBatch(params)
    for i, (role, dtype) in enumerate(zip(THREE_ROLES, dtypes, strict=True)):
        batch = pipelines[name, role, dtype].run(over_the_wire(batch) if i else batch)
        handed.append(batch)
    return handed


@pytest.mark.parametrize("case", SPLIT)
def test_bfloat16_roles_over_the_wire_equal_monolithic_and_the_stock_bfloat16_pipeline(
    pipelines, tiny_models, case: str
) -> None:  # type: ignore[no-untyped-def]
    name, params = CASES[case]
    stock = stock_run(DiffusionPipeline.from_pretrained(tiny_models[name], dtype=torch.bfloat16), name, params)
    handed = split(pipelines, name, params, (BF16, BF16, BF16))
    assert torch.equal(handed[-1].tensors[PIXELS], stock), "bfloat16 roles differ from the stock bfloat16 pipeline"
    assert torch.equal(pipelines[name, Role.MONOLITHIC, BF16].run(StageBatch(params)).tensors[PIXELS], stock)
    for role, batch in zip(THREE_ROLES[:2], handed, strict=False):
        produced = sorted((n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in batch.tensors.items())
        declared = sorted(
            (s.name, s.dtype, s.shape) for s in pipelines[name, role, BF16].adapter.output_specs(role, params)
        )
        assert produced == declared, role
    assert handed[0].tensors["prompt_embeds"].dtype == torch.bfloat16  # not float32 bytes in a bfloat16 name


def test_a_float32_decoder_after_bfloat16_roles_is_wan_s_stock_recipe(pipelines, tiny_models) -> None:  # type: ignore[no-untyped-def]
    """WanPipeline.from_pretrained(dtype=bfloat16, vae=<the VAE in float32>), the model card's recipe."""
    name, params = CASES["wan-cfg-negative-prompt"]
    vae = AutoencoderKLWan.from_pretrained(tiny_models[name] / "vae", dtype=torch.float32)
    pipe = DiffusionPipeline.from_pretrained(tiny_models[name], vae=vae, dtype=torch.bfloat16)
    stock = stock_run(pipe, name, params)
    pixels = split(pipelines, name, params, (BF16, BF16, "float32"))[-1].tensors[PIXELS]
    assert torch.equal(pixels, stock)
    assert not torch.equal(pixels, split(pipelines, name, params, (BF16, BF16, BF16))[-1].tensors[PIXELS])


def test_a_float32_flux_denoiser_after_a_bfloat16_encoder_computes_in_float32(pipelines) -> None:  # type: ignore[no-untyped-def]
    name, params = CASES["flux"]
    encoded, denoised, decoded = split(pipelines, name, params, (BF16, "float32", BF16))
    assert encoded.tensors["prompt_embeds"].dtype == torch.bfloat16
    assert denoised.tensors["latents"].dtype == torch.float32  # its inputs cast to what it makes them in
    assert decoded.tensors[PIXELS].shape == (1, 1, params.height, params.width, 3)
