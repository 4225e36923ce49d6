"""A multi-rank denoiser stopping at a step boundary: what rank 0 stages is the whole state
(docs/design.md "Migration").

Every rank asks before each step whether to stop there (jobs.StepBoundary: rank 0's worker
answers, in the step flag), so every rank leaves the loop before the same step, and rank 0 stages
the continuation as a one-rank denoiser does (resume.suspend). Rank 0's copy is the whole state:
the loop's latents and the scheduler's history are whole on every rank (sequence parallel joins
its shards after the last block, CFG parallel gathers both branches, TP all-reduces every
row-parallel layer), so the ranks hold the same bytes. `states_agree` checks that they do, with a
fingerprint per tensor gathered from every rank, so that a parallelism that one day keeps a shard
in the loop fails the request naming it instead of staging a part as the whole. A continuation
comes back as any job does (jobs.send_jobs broadcasts its resume meta, latents and history) and
every rank restores it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from triptych_worker.resume import TENSOR_PREFIX

if TYPE_CHECKING:
    import torch

    from triptych_worker.parallel.mesh import RankMesh
    from triptych_worker.stages import StageBatch

_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}  # the integer dtype of each element size


def state_names(batch: StageBatch) -> list[str]:
    """The tensors of a stopped loop's state: its latents and the scheduler's history (the inputs
    came to every rank from rank 0 and did not change)."""
    return sorted(name for name in batch.tensors if name == "latents" or name.startswith(TENSOR_PREFIX))


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the tensor's raw bits (plain and position-weighted): equal bytes, equal
    fingerprints; a rank that diverged, or holds a shard, differs (wrapping sums are still exact)."""
    import torch

    bits = tensor.detach().contiguous().view(-1).view(getattr(torch, _BITS[tensor.element_size()])).to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) % 65521 + 1
    return torch.stack([bits.sum(), (bits * weights).sum(), torch.tensor(bits.numel(), device=bits.device)])


def states_agree(mesh: RankMesh, batch: StageBatch) -> list[str]:
    """Every rank, after a loop that stopped: the state tensors whose bytes differ between ranks
    (empty: rank 0 holds the whole state). A collective: every rank calls it at the same point."""
    import torch

    names = state_names(batch)
    if not names:
        return []
    mine = torch.stack([fingerprint(torch.as_tensor(batch.tensors[name])) for name in names]).to(mesh.device)
    every = mesh.all_gather_cat(mine.unsqueeze(0), None, dim=0)  # [world, tensors, 3]
    differs = (every != every[:1]).any(dim=2).any(dim=0).tolist()
    return [name for name, bad in zip(names, differs, strict=True) if bad]
