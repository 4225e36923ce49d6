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


def plan_cuts(transformer: Any, family: str, tp: int, index: int) -> dict[str, TpCut]:
    """This rank's cut of every planned module of the transformer, by module path."""
    plan = tp_plan(transformer, family)
    cuts = {}
    for name, module in transformer.named_modules():
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None:
            continue
        cut = getattr(module, "_tp_cut", None)  # loaded cut already: planned on the whole module
        if cut is None:
            blocks = getattr(module, "_tp_packed_row_blocks", [getattr(module, "in_features", 0)])
            cut = TpCut(tp, index, style, () if style in ROWS else tuple(blocks))
        elif (cut.tp, cut.index) != (tp, index):
            raise ValueError(f"{name}: loaded as TP rank {cut.index} of {cut.tp}, run as rank {index} of {tp}")
        cuts[name] = cut
    return cuts


def shard_transformer(transformer: Any, family: str, mesh: RankMesh, hooks: OutermostHooks) -> int:
    """Make every planned module compute this rank's part (cutting its weights first unless the transformer
    was loaded cut, tp_load.py); returns how many."""
    tp, index = mesh.degrees.tp, mesh.layout.tp_index(mesh.rank)
    cuts = plan_cuts(transformer, family, tp, index)
    for name, cut in cuts.items():
        module = transformer.get_submodule(name)
        if getattr(module, "_tp_cut", None) is None:
            keep_shard(module, cut)
        if cut.style == NORM_ACROSS_HEADS:
            _norm_across_ranks(module, mesh)
        elif not cut.rows:  # its partial product; the group's sum and the bias come from _sum_partials
            module.forward = MethodType(_partial_product, module)
            hooks.add(name, functools.partial(_sum_partials, mesh, module))
    for module in transformer.modules():
        if hasattr(module, "heads") and hasattr(module, "processor"):
            module.heads //= tp  # the processors unflatten into this rank's heads
    return len(cuts)


ROWS = (COLWISE, NORM_ACROSS_HEADS)  # styles that keep a block of output features (a norm's: its weight's)


@dataclass(frozen=True)
class TpCut:
    """This rank's part of a planned module: a block of its output rows (column-parallel, a norm across
    heads) or of the input columns of each of its input blocks (row-parallel), and the same cut of an
    adapter's factor of it. It cuts tensors and safetensors slices alike (what it indexes is read)."""

    tp: int
    index: int
    style: str
    blocks: tuple[int, ...] = ()  # a row-parallel layer's input blocks (FLUX's packed proj_out: two)

    @property
    def rows(self) -> bool:
        return self.style in ROWS

    def tensor(self, name: str, x: Any) -> torch.Tensor:
        """The module's tensor `name` ("weight", "bias") for this rank: a row-parallel layer's bias whole."""
        if self.rows:
            return self._rows(x)
        return self._columns(x) if name == "weight" else _owned(x[:], x)

    def factor(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """An adapter's `kind` tensor ("A", "B" or "B.bias") for this rank."""
        if self.rows:  # the output rows: B's (and its bias); A reads the whole input
            return tensor if kind == "A" else self._rows(tensor)
        if kind == "A":  # the input columns
            return self._columns(tensor)
        if kind == "B.bias" and self.index:  # added once: the group sums the ranks' outputs
            return tensor.new_zeros(tensor.shape)
        return tensor

    def columns(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's features of an input `x` [..., in_features] of a row-parallel layer."""
        import torch

        return torch.cat([x[..., start:end] for start, end in self._column_ranges()], dim=-1)

    def _rows(self, x: Any) -> torch.Tensor:
        start, end = _range(_shape(x)[0], self.tp, self.index)
        return _owned(x[start:end], x)

    def _columns(self, x: Any) -> torch.Tensor:
        import torch

        pieces = [x[:, start:end] for start, end in self._column_ranges()]
        return _owned(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1), x)

    def _column_ranges(self) -> list[tuple[int, int]]:
        ranges, offset = [], 0
        for width in self.blocks:
            start, end = _range(width, self.tp, self.index)
            ranges.append((offset + start, offset + end))
            offset += width
        return ranges


def _range(n: int, tp: int, index: int) -> tuple[int, int]:
    """Rank `index`'s block of `n` features, as torch.chunk cuts them (the degrees divide them)."""
    size = -(-n // tp)
    return min(n, index * size), min(n, (index + 1) * size)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.get_shape()) if hasattr(x, "get_shape") else tuple(x.shape)  # a safetensors slice, a tensor


def _owned(part: torch.Tensor, source: Any) -> torch.Tensor:
    """`part` in memory of its own: a cut of a tensor is a view that would keep the whole alive (a read from a
    file is already a new tensor)."""
    import torch

    if isinstance(source, torch.Tensor):
        return part.clone(memory_format=torch.contiguous_format)
    return part.contiguous()


def keep_shard(module: Any, cut: TpCut) -> None:
    """Replace the module's weight (and bias) in memory by this rank's cut of them."""
    for name, tensor in list(module.named_parameters(recurse=False)):
        set_cut_tensor(module, cut, name, cut.tensor(name, tensor.data))


def set_cut_tensor(module: Any, cut: TpCut, name: str, tensor: torch.Tensor) -> None:
    """Give the planned module its cut tensor `name`; a Linear's feature counts follow its weight's shape,
    as peft reads them to size an adapter's layers (and shard_lora_factors cuts the factors by `_tp_cut`)."""
    import torch

    module._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)
    module._tp_cut = cut
    if name == "weight" and hasattr(module, "in_features"):
        module.out_features, module.in_features = tensor.shape


def _partial_product(module: Any, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel Linear's forward: its input features' share of the product, without the bias."""
    import torch.nn.functional as F

    return F.linear(x, module.weight)


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


def _norm_across_ranks(norm: Any, mesh: RankMesh) -> None:
    """RMS over every head's features, with this rank's heads (its weight already cut): the squares' sum is
    all-reduced."""
    import torch

    full = norm.normalized_shape[-1]

    def forward(module: Any, x: torch.Tensor) -> torch.Tensor:
        squares = mesh.all_reduce_sum(x.float().pow(2).sum(-1, keepdim=True), mesh.tp_group)
        eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
        y = (x.float() * torch.rsqrt(squares / full + eps)).type_as(x)
        return y if module.weight is None else y * module.weight

    norm.forward = MethodType(forward, norm)
