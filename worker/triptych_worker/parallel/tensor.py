"""`--denoiser-tp N`: the DiT's attention heads and MLPs split across the ranks of a TP group.

Each rank keeps only its shard of every planned Linear (the rest of its weights are freed):
"colwise" keeps a block of output features (Q, K, V: this rank's heads; the MLP's first layer:
its hidden units), "rowwise" the matching block of input features, after which the group
all-reduces the partial outputs and adds the bias once. FLUX's single-stream `proj_out` reads
`cat([attention, MLP])`, two column-sharded streams, so its input blocks are cut block by block
(diffusers' own `_tp_plan` for FLUX, which is this module's plan for it). Wan's QK norm is an
RMS over all heads: with the heads split, each rank sums its squares and the group all-reduces
them. The attention processors see only this rank's heads (`attn.heads` is set to them).

The all-reduce sums the partial products in another order than one rank's matmul, so a TP
denoiser matches one rank within a tolerance, not bitwise (tests/e2e/test_parallel_ranks.py).
"""

from __future__ import annotations

import fnmatch
from types import MethodType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from triptych_worker.parallel.mesh import RankMesh

COLWISE, ROWWISE, PACKED_ROWWISE, NORM_ACROSS_HEADS = "colwise", "rowwise", "packed_rowwise", "norm_across_heads"

WAN_TP_PLAN: dict[str, str] = {
    **{f"blocks.*.{attn}.to_{x}": COLWISE for attn in ("attn1", "attn2") for x in "qkv"},
    **{f"blocks.*.{attn}.to_out.0": ROWWISE for attn in ("attn1", "attn2")},
    **{f"blocks.*.{attn}.norm_{x}": NORM_ACROSS_HEADS for attn in ("attn1", "attn2") for x in "qk"},
    "blocks.*.ffn.net.0.proj": COLWISE,
    "blocks.*.ffn.net.2": ROWWISE,
}


def tp_plan(transformer: Any, family: str) -> dict[str, str]:
    """Module path pattern -> how it is split: diffusers' own plan for FLUX, ours for Wan."""
    if family == "wan":
        return WAN_TP_PLAN
    plan = {}
    for pattern, style in type(transformer)._tp_plan.items():
        plan[pattern] = style if isinstance(style, str) else PACKED_ROWWISE  # PackedRowwiseParallel
    return plan


def shard_transformer(transformer: Any, family: str, mesh: RankMesh) -> int:
    """Keep this rank's shard of every planned module and make it compute its part; returns how many."""
    tp, index = mesh.degrees.tp, mesh.layout.tp_index(mesh.rank)
    plan = tp_plan(transformer, family)
    count = 0
    for name, module in transformer.named_modules():
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None:
            continue
        if style == COLWISE:
            _keep_rows(module, tp, index)
        elif style == NORM_ACROSS_HEADS:
            _shard_norm(module, tp, index, mesh)
        else:
            blocks = list(getattr(module, "_tp_packed_row_blocks", [module.in_features]))
            _keep_columns(module, blocks, tp, index, mesh)
        count += 1
    for module in transformer.modules():
        if hasattr(module, "heads") and hasattr(module, "processor"):
            module.heads //= tp  # the processors unflatten into this rank's heads
    return count


def _block(x: torch.Tensor, dim: int, tp: int, index: int) -> torch.Tensor:
    return x.chunk(tp, dim=dim)[index].clone()  # a copy: the full tensor is freed with the old parameter


def _keep_rows(linear: Any, tp: int, index: int) -> None:
    import torch

    linear.weight = torch.nn.Parameter(_block(linear.weight.data, 0, tp, index), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(_block(linear.bias.data, 0, tp, index), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: Any, blocks: list[int], tp: int, index: int, mesh: RankMesh) -> None:
    """Row-parallel: this rank's input features of each block; the group sums the outputs, then the bias."""
    import torch
    import torch.nn.functional as F

    parts = torch.split(linear.weight.data, blocks, dim=1)
    linear.weight = torch.nn.Parameter(torch.cat([_block(p, 1, tp, index) for p in parts], dim=1), requires_grad=False)
    linear.in_features = linear.weight.shape[1]

    def forward(module: Any, x: torch.Tensor) -> torch.Tensor:
        out = mesh.all_reduce_sum(F.linear(x, module.weight), mesh.tp_group)
        return out if module.bias is None else out + module.bias

    linear.forward = MethodType(forward, linear)


def _shard_norm(norm: Any, tp: int, index: int, mesh: RankMesh) -> None:
    """RMS over every head's features, with this rank's heads: the squares' sum is all-reduced."""
    import torch

    full = norm.normalized_shape[-1]
    if norm.weight is not None:
        norm.weight = torch.nn.Parameter(_block(norm.weight.data, 0, tp, index), requires_grad=False)

    def forward(module: Any, x: torch.Tensor) -> torch.Tensor:
        squares = mesh.all_reduce_sum(x.float().pow(2).sum(-1, keepdim=True), mesh.tp_group)
        eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
        y = (x.float() * torch.rsqrt(squares / full + eps)).type_as(x)
        return y if module.weight is None else y * module.weight

    norm.forward = MethodType(forward, norm)
