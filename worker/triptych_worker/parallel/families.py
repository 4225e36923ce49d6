"""Which parallel degrees each model family runs, and how its transformer's sequence is sharded.

| family | CFG parallel | Ulysses | Ring | TP | --decoder-sp | encoder ranks |
|---|---|---|---|---|---|---|
| wan | 2 (negative prompt branch) | divides the heads | yes | divides heads, ffn_dim | row bands | no |
| flux, flux-kontext | no: embedded guidance, one branch | divides the heads | yes | divides the heads | no | no |

TP (tensor.py) splits the heads first: Ulysses then divides each TP rank's heads.

Unless `--denoiser-ulysses`/`--denoiser-ring` are given, the Ulysses degree is the largest that
divides both the heads and sp, and the ring takes the rest. `check_degrees` runs at startup (a
combination a family cannot run exits naming the flag), and `check_request` before a job reaches
the ranks (a sequence that does not split evenly fails that request naming the field).
`shard_sequence` installs the hooks that cut a family's token sequence into this rank's shard
before the transformer blocks and join the shards after them, where diffusers' `_cp_plan` for
the family cuts and joins it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from triptych.config import ROLE_PARALLEL_FLAGS, ConfigError, ServeArgs, flag
from triptych.families import wan
from triptych.parallelism import Parallelism
from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_worker.adapters import FamilyAdapter
from triptych_worker.step_cache import SHARED_BY_BRANCHES

if TYPE_CHECKING:
    import torch

    from triptych_worker.parallel.attention import SequenceParallelAttention
    from triptych_worker.parallel.mesh import RankMesh
    from triptych_worker.parallel.outermost import OutermostHooks


GENERIC_FLAGS = {"tp": "--tp-size", "sp": "--sp-degree", "cfg": "--cfg-parallel-size"}


def degree_flag(args: ServeArgs, degree: str) -> str:
    """The flag a user sets for `degree` of this role: its own (--denoiser-ulysses), else the generic one."""
    attr = ROLE_PARALLEL_FLAGS.get(args.disagg_role, {}).get(degree)
    return flag(attr) if attr else GENERIC_FLAGS[degree]


def check_degrees(args: ServeArgs, family: str, adapter: FamilyAdapter) -> Parallelism:
    """The degrees this role runs, or ConfigError naming the flag a family cannot run."""
    degrees = args.parallelism()
    n = args.num_gpus
    if args.disagg_role is Role.DECODER:
        return _decoder_degrees(args, family, degrees)
    if args.disagg_role is not Role.DENOISER:
        what = ", ".join(flag(a) for a in ROLE_PARALLEL_FLAGS.get(args.disagg_role, {}).values()) or "parallelism"
        raise ConfigError(
            f"--num-gpus {n} on the {args.disagg_role.value}: {what} is not supported for {family}; "
            f"only the denoiser and the Wan decoder run on several devices (give this role --num-gpus 1)"
        )
    if degrees.cfg > 2:
        raise ConfigError(f"--cfg-parallel-size {degrees.cfg}: a step has at most 2 guidance branches; use 1 or 2")
    if degrees.cfg > 1 and family != "wan":
        raise ConfigError(
            f"--cfg-parallel-size {degrees.cfg}: {family} uses embedded guidance (one transformer pass per step), "
            f"there are no two guidance branches to split; use --denoiser-ulysses/--denoiser-ring instead"
        )
    config = adapter.package.config("transformer")
    for what, width in tp_widths(config, family).items():
        if width % degrees.tp:
            raise ConfigError(
                f"{degree_flag(args, 'tp')} {degrees.tp} does not divide the model's {width} {what}; "
                f"use a TP degree that divides {width}"
            )
    heads = int(config["num_attention_heads"]) // degrees.tp  # each TP rank's heads
    if args.denoiser_ulysses is None and args.denoiser_ring is None:
        # Derived, not chosen: Ulysses takes what the heads allow, the ring the rest.
        ulysses = math.gcd(heads, degrees.sp)
        degrees = dataclasses.replace(degrees, ulysses=ulysses, ring=degrees.sp // ulysses)
    if heads % degrees.ulysses:
        per_rank = f" ({heads} per TP rank)" if degrees.tp > 1 else ""
        raise ConfigError(
            f"{degree_flag(args, 'ulysses')} {degrees.ulysses} does not divide the model's {heads * degrees.tp} "
            f"attention heads{per_rank}; use a divisor of {heads} (and --denoiser-ring for the rest)"
        )
    return degrees


def tp_widths(config: dict[str, Any], family: str) -> dict[str, int]:
    """What the TP degree must divide, by what it is (FLUX's MLPs are 4 x heads x head_dim wide)."""
    widths = {"attention heads": int(config["num_attention_heads"])}
    if family == "wan":
        widths["feed-forward units (ffn_dim)"] = int(config["ffn_dim"])
    return widths


def _decoder_degrees(args: ServeArgs, family: str, degrees: Parallelism) -> Parallelism:
    for degree in ("tp", "cfg"):
        if getattr(degrees, degree) > 1:
            raise ConfigError(
                f"{degree_flag(args, degree)} {getattr(degrees, degree)}: the decoder splits its work by "
                f"--decoder-sp only; leave {degree_flag(args, degree)} unset on the decoder"
            )
    if family != "wan":
        raise ConfigError(
            f"{degree_flag(args, 'sp')} {degrees.sp}: {family} decodes single images with a 2D VAE whose "
            f"GroupNorm spans the whole image, so bands of rows cannot decode apart, and an image decode is "
            f"short; run more decoder replicas with --num-gpus 1 instead"
        )
    return degrees


def sequence_lengths(adapter: FamilyAdapter, family: str, params: GenerationParams) -> dict[str, int]:
    """The token counts the sp degree must divide, by the request field that sets each."""
    latents = next(spec for spec in adapter.output_specs(Role.DENOISER, params) if spec.name == "latents")
    if family == "wan":
        patch = adapter.package.config("transformer")["patch_size"]
        _, _, frames, height, width = latents.shape
        return {"size/num_frames": (frames // patch[0]) * (height // patch[1]) * (width // patch[2])}
    return {"size": latents.shape[1], "max_sequence_length": params.max_sequence_length}


def check_request(
    adapter: FamilyAdapter, family: str, params: GenerationParams, degrees: Parallelism, role: Role = Role.DENOISER
) -> None:
    """Raise ValueError naming the field when the request's tokens (rows, for the decoder) do not split over
    the sp ranks, or when it asks a CFG-parallel denoiser for a step cache that one device shares between
    the guidance branches."""
    cache = params.resolved_step_cache.mode
    if role is Role.DENOISER and degrees.cfg > 1 and cache in SHARED_BY_BRANCHES and wan.uses_cfg(params):
        raise ValueError(
            f"step_cache: {cache} keeps one cache for both guidance branches on one device (the uncond pass "
            f"reuses what the cond pass cached), which CFG-parallel ranks (--cfg-parallel-size {degrees.cfg}), "
            "one branch each, cannot give; choose first_block (a cache per branch, as on one device) or none, "
            "or serve from a denoiser without --cfg-parallel-size"
        )
    if role is Role.DECODER:
        latents = next(spec for spec in adapter.output_specs(Role.DENOISER, params) if spec.name == "latents")
        rows = latents.shape[3]  # [n, C, T', H', W']
        if rows % degrees.sp:
            raise ValueError(
                f"size: the request's height makes {rows} latent rows, which do not split over this decoder's "
                f"{degrees.sp} ranks; choose a height giving a multiple of {degrees.sp} latent rows"
            )
        return
    for field, tokens in sequence_lengths(adapter, family, params).items():
        if tokens % degrees.sp:
            raise ValueError(
                f"{field}: the request makes {tokens} tokens, which do not split over this denoiser's "
                f"{degrees.sp} sequence-parallel ranks; choose a size giving a multiple of {degrees.sp} tokens"
            )


def shard_sequence(
    transformer: Any, family: str, mesh: RankMesh, attention: SequenceParallelAttention, hooks: OutermostHooks
) -> None:
    """Cut the token sequence into this rank's shard before the blocks and join the shards after them."""
    sp, shard = mesh.degrees.sp, mesh.layout.shard(mesh.rank)

    def cut(x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.chunk(sp, dim=dim)[shard]

    def join(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        return mesh.all_gather_cat(output, mesh.sp_group, dim=1)

    if family == "wan":
        transformer.rope.register_forward_hook(lambda m, a, out: tuple(cut(x, 1) for x in out))
        transformer.blocks[0].register_forward_pre_hook(lambda m, a: (cut(a[0], 1), *a[1:]))
    else:

        def cut_inputs(module: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            attention.text_tokens = kwargs["encoder_hidden_states"].shape[1] // sp
            for name, dim in (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 0), ("txt_ids", 0)):
                kwargs[name] = cut(kwargs[name], dim)
            return args, kwargs

        transformer.register_forward_pre_hook(cut_inputs, with_kwargs=True)
    hooks.add("proj_out", join)  # on a peft layer wrapping proj_out, once an adapter targets it
