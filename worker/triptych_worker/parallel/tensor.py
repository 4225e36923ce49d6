"""`--denoiser-tp N`: the DiT's attention heads and MLPs split across the ranks of a TP group.

Each rank keeps only its shard of every planned Linear (the rest of its weights are freed):
"colwise" keeps a block of output features (Q, K, V: this rank's heads; the MLP's first layer:
its hidden units), "rowwise" the matching block of input features, after which the group
all-reduces the partial outputs and adds the bias once. FLUX's single-stream `proj_out` reads
`cat([attention, MLP])`, two column-sharded streams, so its input blocks are cut block by block
(diffusers' own `_tp_plan` for FLUX, which is this module's plan for it). Wan's QK norm is an
RMS over all heads: with the heads split, each rank sums its squares and the group all-reduces
them. The attention processors see only this rank's heads (`attn.heads` is set to them).

A request's LoRA adapters take the same cuts (`shard_lora_loads`): an adapter's `lora_B` keeps a
column-parallel layer's output rows, its `lora_A` a row-parallel layer's input columns, so each
rank's adapter product matches its shard of the layer, and a row-parallel layer's partial adapter
products are summed by the layer's own all-reduce (the sum of the ranks' `B(A_i x_i)` is `B(A x)`),
which therefore runs after peft adds them: on the outermost module at the layer's path
(outermost.py), not inside the base layer. DoRA adapters are refused on TP ranks (their magnitude
normalises each output row over every input column).

The all-reduce sums the partial products in another order than one rank's matmul, so a TP
denoiser matches one rank within a tolerance, not bitwise (tests/e2e/test_parallel_ranks.py,
tests/worker/test_ranks_adapters.py).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass
from types import MethodType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from triptych_worker.parallel.mesh import RankMesh
    from triptych_worker.parallel.outermost import OutermostHooks

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


def shard_transformer(transformer: Any, family: str, mesh: RankMesh, hooks: OutermostHooks) -> int:
    """Keep this rank's shard of every planned module and make it compute its part; returns how many."""
    tp, index = mesh.degrees.tp, mesh.layout.tp_index(mesh.rank)
    plan = tp_plan(transformer, family)
    count = 0
    for name, module in transformer.named_modules():
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None:
            continue
        if style == NORM_ACROSS_HEADS:
            _shard_norm(module, tp, index, mesh)
        elif style == COLWISE:
            keep_shard(module, TpCut(tp, index, rows=True))
        else:
            blocks = tuple(getattr(module, "_tp_packed_row_blocks", [module.in_features]))
            keep_shard(module, TpCut(tp, index, rows=False, blocks=blocks))
            hooks.add(name, functools.partial(_sum_partials, mesh, module))
        count += 1
    for module in transformer.modules():
        if hasattr(module, "heads") and hasattr(module, "processor"):
            module.heads //= tp  # the processors unflatten into this rank's heads
    return count


@dataclass(frozen=True)
class TpCut:
    """This rank's part of a Linear: a block of its output rows (column-parallel) or of the input columns
    of each of its input blocks (row-parallel), and the same cut of an adapter's factor of it."""

    tp: int
    index: int
    rows: bool
    blocks: tuple[int, ...] = ()

    def weight(self, weight: torch.Tensor) -> torch.Tensor:
        return _block(weight, 0, self.tp, self.index) if self.rows else self.columns(weight)

    def columns(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        return torch.cat([_block(part, 1, self.tp, self.index) for part in torch.split(x, list(self.blocks), dim=1)], 1)

    def factor(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """An adapter's `kind` tensor ("A", "B" or "B.bias") for this rank."""
        if self.rows:  # the output rows: B's (and its bias); A reads the whole input
            return tensor if kind == "A" else _block(tensor, 0, self.tp, self.index)
        if kind == "A":  # the input columns
            return self.columns(tensor)
        if kind == "B.bias" and self.index:  # added once: the group sums the ranks' outputs
            return tensor.new_zeros(tensor.shape)
        return tensor


def _block(x: torch.Tensor, dim: int, tp: int, index: int) -> torch.Tensor:
    return x.chunk(tp, dim=dim)[index].clone()  # a copy: the full tensor is freed with the old parameter


def keep_shard(linear: Any, cut: TpCut) -> None:
    """Replace the Linear's weight by this rank's cut of it (column-parallel: and of its bias). A row-parallel
    one computes its partial product only: `_sum_partials` all-reduces it and adds the bias."""
    import torch
    import torch.nn.functional as F

    linear.weight = torch.nn.Parameter(cut.weight(linear.weight.data), requires_grad=False)
    linear.out_features, linear.in_features = linear.weight.shape
    linear._tp_cut = cut  # what an adapter's factors of this layer keep (shard_lora_factors)
    if cut.rows:
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(_block(linear.bias.data, 0, cut.tp, cut.index), requires_grad=False)
        return
    linear.forward = MethodType(lambda module, x: F.linear(x, module.weight), linear)


def _sum_partials(mesh: RankMesh, linear: Any, module: Any, args: Any, partial: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's output (with an adapter's partial product, once peft added it): the group's
    sum, then the bias once."""
    out = mesh.all_reduce_sum(partial, mesh.tp_group)
    return out if linear.bias is None else out + linear.bias


LORA_FACTOR = re.compile(r"\.(?P<factor>lora_A|lora_B|lora_down|lora_up|lora\.down|lora\.up)\.(?P<rest>.+)$")
DORA = ("lora_magnitude_vector", "dora_scale")


def shard_lora_loads(pipe: Any) -> None:
    """Every LoRA load on this TP rank's pipeline reads the adapter's tensors through `lora_state_dict`
    (the stock `load_lora_weights` does): from now on that returns them cut as the layers they adapt."""
    read = pipe.lora_state_dict

    def lora_state_dict(*args: Any, **kwargs: Any) -> Any:
        out = read(*args, **kwargs)
        if isinstance(out, tuple):  # (state dict, alphas, metadata), as the family's loader asked
            return (shard_lora_factors(out[0], pipe.transformer), *out[1:])
        return shard_lora_factors(out, pipe.transformer)

    pipe.lora_state_dict = lora_state_dict


def shard_lora_factors(state_dict: dict[str, torch.Tensor], transformer: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors with this rank's cut of each factor of a sharded layer ("transformer.<layer
    path>.lora_A.weight", ...; a text encoder's and an unsharded layer's as they are). ValueError for a
    DoRA adapter on a sharded layer."""
    out = {}
    for key, tensor in state_dict.items():
        cut = _cut_of(transformer, key.removeprefix("transformer.").split(".lora", 1)[0], key)
        if cut is None:
            out[key] = tensor
            continue
        if any(marker in key for marker in DORA):
            raise ValueError(
                f"{key}: a DoRA adapter's magnitude spans every input of a layer that tensor-parallel ranks hold "
                "in shards; serve DoRA adapters from a denoiser without --denoiser-tp"
            )
        found = LORA_FACTOR.search(key)
        if found is None:
            out[key] = tensor  # an alpha: a number per layer
            continue
        kind = "A" if found["factor"] in ("lora_A", "lora_down", "lora.down") else "B"
        out[key] = cut.factor(kind + (".bias" if kind == "B" and found["rest"].endswith("bias") else ""), tensor)
    return out


def _cut_of(transformer: Any, path: str, key: str) -> TpCut | None:
    if not key.startswith("transformer."):
        return None
    try:
        module = transformer.get_submodule(path)
    except AttributeError:
        return None  # no such layer: the loader reports (or ignores) it as for one rank
    return getattr(getattr(module, "base_layer", module), "_tp_cut", None)


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
