"""Sequence-parallel attention: Ulysses (all-to-all over heads), Ring (online-softmax merge), both.

diffusers' attention processors pass their `_parallel_config` to the module-level
`dispatch_attention_fn` of their transformer module; `route_attention` puts a router there that
hands calls carrying a `SequenceParallelAttention` to it and every other call to diffusers
unchanged. The processors' own math (projections, QK norms, RoPE, output projections) is
untouched, which is what keeps a 2-rank Ulysses denoiser byte-identical to one rank.
diffusers' own context parallelism (`enable_parallelism`) does not run on CPU with gloo.

Each rank holds a shard of the sequence, all heads: [B, S/sp, H, D]. Ulysses trades that for the
Ulysses group's whole block of the sequence with H/ulysses heads, runs attention, and trades
back. With a ring degree > 1, each rank's block of queries meets every ring rank's block of
keys and values in turn, and the partial results merge through their log-sum-exp; that changes
the order of the softmax sums, so the result matches one rank within a tolerance, not bitwise.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from triptych_worker.parallel.mesh import RankMesh

ROUTED_MODULES = ("diffusers.models.transformers.transformer_wan", "diffusers.models.transformers.transformer_flux")


class SequenceParallelAttention:
    """One rank's part of the attention over a sequence sharded across its sp group.

    `text_tokens`: how many of each shard's leading tokens are text (FLUX joins text and image
    tokens in one attention); the all-to-all regroups them so the joined block has the text of
    every shard first, in the order one rank sees. `work` counts the query-key pairs times heads
    this rank computed; `seconds` the time in attention (communication included).
    """

    kind = "attention"

    def __init__(self, mesh: RankMesh):
        self.mesh = mesh
        self.text_tokens = 0
        self.work = 0
        self.seconds = 0.0

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("attn_mask") is not None or kwargs.get("is_causal"):
            raise NotImplementedError("sequence-parallel attention takes no mask and is not causal")
        started = time.perf_counter()
        ulysses = self.mesh.degrees.ulysses
        if ulysses > 1:
            query, key, value = (self._gather_sequence(x, ulysses) for x in (query, key, value))
        if self.mesh.degrees.ring > 1:
            out = self._ring(query, key, value, kwargs.get("scale"))
        else:
            out = _local_attention(query, key, value, **kwargs)
            self.work += query.shape[0] * query.shape[2] * query.shape[1] * key.shape[1]
        if ulysses > 1:
            out = self._scatter_sequence(out, ulysses)
        self.seconds += time.perf_counter() - started
        return out

    def _gather_sequence(self, x: torch.Tensor, u: int) -> torch.Tensor:
        """[B, S_shard, H, D] -> [B, u * S_shard, H/u, D]: the Ulysses group's block, this rank's heads."""
        b, s, h, d = x.shape
        chunks = x.reshape(b, s, u, h // u, d).permute(2, 0, 1, 3, 4)  # by destination rank
        got = self.mesh.all_to_all(chunks, self.mesh.ulysses_group)  # [u, B, S_shard, H/u, D] by source shard
        t = self.text_tokens
        text = got[:, :, :t].permute(1, 0, 2, 3, 4).reshape(b, u * t, h // u, d)
        rest = got[:, :, t:].permute(1, 0, 2, 3, 4).reshape(b, u * (s - t), h // u, d)
        return rest if t == 0 else _cat([text, rest], dim=1)

    def _scatter_sequence(self, x: torch.Tensor, u: int) -> torch.Tensor:
        """The inverse of _gather_sequence."""
        b, s_block, h_local, d = x.shape
        s, t = s_block // u, self.text_tokens
        text = x[:, : u * t].reshape(b, u, t, h_local, d)
        rest = x[:, u * t :].reshape(b, u, s - t, h_local, d)
        chunks = _cat([text, rest], dim=2).permute(1, 0, 2, 3, 4)  # [u, B, S_shard, H/u, D] by destination
        got = self.mesh.all_to_all(chunks, self.mesh.ulysses_group)  # by source rank = head group
        return got.permute(1, 2, 0, 3, 4).reshape(b, s, u * h_local, d)

    def _ring(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Attention of this block's queries over every ring rank's keys/values, merged by log-sum-exp."""
        import torch

        q = query.transpose(1, 2).float()  # [B, H, Sq, D]
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        out: torch.Tensor | None = None
        lse: torch.Tensor | None = None
        k, v = key, value
        for step in range(self.mesh.degrees.ring):
            scores = (q @ k.transpose(1, 2).float().transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
            block_lse = torch.logsumexp(scores, dim=-1)
            block_out = torch.softmax(scores, dim=-1) @ v.transpose(1, 2).float()
            self.work += scores.numel()
            if out is None or lse is None:
                out, lse = block_out, block_lse
            else:
                merged = torch.logaddexp(lse, block_lse)
                out = out * (lse - merged).exp().unsqueeze(-1) + block_out * (block_lse - merged).exp().unsqueeze(-1)
                lse = merged
            if step < self.mesh.degrees.ring - 1:
                k, v = self.mesh.ring_shift([k, v])
        assert out is not None
        return out.transpose(1, 2).to(query.dtype)


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    import torch

    return torch.cat(parts, dim=dim)


def _local_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """diffusers' own attention on this rank's heads (the same kernel one rank uses for all of them)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    kwargs.pop("parallel_config", None)
    return dispatch_attention_fn(query, key, value, **kwargs)


def _routed_dispatch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    config = kwargs.get("parallel_config")
    if isinstance(config, SequenceParallelAttention):
        names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "attention_kwargs")
        kwargs.update(zip(names, args, strict=False))
        kwargs.pop("parallel_config")
        return config(query, key, value, **kwargs)
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(query, key, value, *args, **kwargs)


def route_attention() -> None:
    """Point the Wan and FLUX processors' attention calls at the router (idempotent)."""
    import importlib

    for name in ROUTED_MODULES:
        importlib.import_module(name).dispatch_attention_fn = _routed_dispatch  # type: ignore[attr-defined]


def use_sequence_parallel(transformer: Any, attention: SequenceParallelAttention) -> int:
    """Give every attention processor of `transformer` this rank's sequence-parallel attention; returns how many."""
    route_attention()
    count = 0
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = attention
            count += 1
    return count
