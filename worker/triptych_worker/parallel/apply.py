"""What a rank changes in the stages it loaded, by role and degrees, and what it counts as its work.

    work = parallelize(pipeline, mesh)   # every rank, after loading its stages and joining the mesh

Denoiser: sequence-parallel attention (counting this rank's attention work even with sp 1), the
sequence shards (sp > 1), the heads' and MLP's shards (tp > 1; such a rank read only its cut of the
transformer, tp_load.py), a guidance branch per CFG rank; every rank loads a
request's LoRA adapters (a TP rank its shards of them) and the ranks agree that all did (lora.py),
and a first-block step cache decides on the whole sequence (step_cache.py).
Decoder: the VAE decode by bands of rows (`--decoder-sp`). `families.check_degrees` has already
refused what the family cannot run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from triptych.roles import Role
from triptych_worker.parallel import families
from triptych_worker.parallel.attention import SequenceParallelAttention, use_sequence_parallel
from triptych_worker.parallel.outermost import OutermostHooks
from triptych_worker.parallel.tensor import shard_lora_loads, shard_transformer
from triptych_worker.parallel.vae import RowParallelDecoder

if TYPE_CHECKING:
    import torch

    from triptych_worker.parallel.mesh import RankMesh
    from triptych_worker.pipeline import RolePipeline


class WorkCounter(Protocol):
    """What rank 0 gathers after each job to show every rank did a share: `work` units of `kind`."""

    kind: str
    work: int


def parallelize(pipeline: RolePipeline, mesh: RankMesh) -> WorkCounter:
    """Install this rank's part of the role's parallelism in its loaded stages; return its work counter."""
    pipe = pipeline.adapter.pipe
    if pipeline.role is Role.DECODER:
        decoder = RowParallelDecoder(mesh)
        decoder.install(pipe.vae)
        return decoder
    degrees = mesh.degrees
    attention = SequenceParallelAttention(mesh)
    use_sequence_parallel(pipe.transformer, attention)  # with sp 1 it only counts this rank's attention work
    hooks = OutermostHooks(pipe.transformer)
    if degrees.tp > 1:
        shard_transformer(pipe.transformer, pipeline.family, mesh, hooks)
        if pipeline.loras is not None:
            shard_lora_loads(pipe)
    if degrees.sp > 1:
        families.shard_sequence(pipe.transformer, pipeline.family, mesh, attention, hooks)
    if degrees.cfg > 1:
        pipeline.adapter.run_branches = CfgBranches(mesh)
    if pipeline.loras is not None:
        pipeline.loras.agree = functools.partial(every_rank_agrees, mesh)
    if pipeline.step_cache is not None and (degrees.sp > 1 or degrees.tp > 1):
        pipeline.step_cache.first_block_change = functools.partial(residual_change, mesh)
    return attention


def every_rank_agrees(mesh: RankMesh, ok: bool) -> bool:
    """Whether every rank says ok (a collective: every rank calls it at the same point of a job)."""
    import torch

    failed = mesh.all_reduce_sum(torch.tensor([0 if ok else 1], dtype=torch.int64, device=mesh.device), None)
    return int(failed.item()) == 0


def residual_change(mesh: RankMesh, residual: torch.Tensor, previous: torch.Tensor) -> float:
    """The first-block cache's figure, mean |residual - previous| / mean |previous|, over the whole
    sequence: a sequence-parallel rank holds a shard of the tokens (equal shards, so the sums' ratio
    is the means'); TP ranks hold the same residual, and summing over them too keeps the ratio and
    gives every rank the very same number, so they decide alike."""
    import torch

    sums = torch.stack(
        [torch.sum((residual - previous).abs(), dtype=torch.float64), torch.sum(previous.abs(), dtype=torch.float64)]
    )
    for degree, group in ((mesh.degrees.sp, mesh.sp_group), (mesh.degrees.tp, mesh.tp_group)):
        if degree > 1:
            sums = mesh.all_reduce_sum(sums, group)
    return float(sums[0] / sums[1])


def parameter_bytes(pipeline: RolePipeline) -> int:
    """Bytes of the parameters this rank holds (after any TP sharding freed the rest)."""
    modules = [c for c in pipeline.adapter.pipe.components.values() if hasattr(c, "parameters")]
    return sum(p.numel() * p.element_size() for module in modules for p in module.parameters())


class CfgBranches:
    """CFG parallel: each rank runs the guidance branch of its CFG index; the group shares the results."""

    def __init__(self, mesh: RankMesh):
        self.mesh = mesh

    def __call__(self, branches: Sequence[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        if len(branches) != self.mesh.degrees.cfg:  # e.g. a request without guidance: every rank runs it all
            return [branch() for branch in branches]
        mine = branches[self.mesh.layout.cfg_index(self.mesh.rank)]()
        joined = self.mesh.all_gather_cat(mine.unsqueeze(0), self.mesh.cfg_group, dim=0)
        return list(joined.unbind(0))
