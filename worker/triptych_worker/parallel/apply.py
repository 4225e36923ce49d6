"""What a rank changes in the stages it loaded, by role and degrees, and what it counts as its work.

    work = parallelize(pipeline, mesh)   # every rank, after loading its stages and joining the mesh

Denoiser: sequence-parallel attention (counting this rank's attention work even with sp 1), the
sequence shards (sp > 1), the heads' and MLP's shards (tp > 1; such a rank was loaded on the CPU and
only now moves to its device, shards only), a guidance branch per CFG rank.
Decoder: the VAE decode by bands of rows (`--decoder-sp`). `families.check_degrees` has already
refused what the family cannot run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from triptych.roles import Role
from triptych_worker.parallel import families
from triptych_worker.parallel.attention import SequenceParallelAttention, use_sequence_parallel
from triptych_worker.parallel.tensor import shard_transformer
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
    if degrees.tp > 1:
        shard_transformer(pipe.transformer, pipeline.family, mesh)
    if pipeline.adapter.device != mesh.device:  # loaded on the CPU (a TP rank, Rank.start): now its shards go
        pipeline.adapter.move_to(mesh.device)
    if degrees.sp > 1:
        families.shard_sequence(pipe.transformer, pipeline.family, mesh, attention)
    if degrees.cfg > 1:
        pipeline.adapter.run_branches = CfgBranches(mesh)
    return attention


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
