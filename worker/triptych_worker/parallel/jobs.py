"""Rank 0 hands each job to the other ranks: a msgspec header, then the tensors, by broadcast.

The header is decoded into typed structs (GenerationParams is checked field by field), never
unpickled: torch.distributed's object collectives pickle, so they are not used. A one-element
step flag follows every denoising step, so that a request the head cancels stops on every rank
at the same step instead of leaving followers waiting in a collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from triptych.params import GenerationParams
from triptych.protocol.tensors import WIRE_DTYPES
from triptych_worker.stages import StageBatch

if TYPE_CHECKING:
    import torch

    from triptych_worker.parallel.mesh import RankMesh

MAX_HEADER_BYTES = 16 << 20


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: list[int]


class JobHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    params: GenerationParams
    meta: dict[str, Any]
    tensors: list[TensorEntry]


class StopFollowing(Exception):
    """Rank 0 stopped the job this rank is following (the head cancelled it)."""


def _broadcast(mesh: RankMesh, tensor: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.broadcast(tensor, src=0)
    return tensor


def send_job(mesh: RankMesh, batch: StageBatch) -> None:
    """Rank 0: give every rank this job's params, meta and input tensors."""
    import torch

    tensors = {name: torch.as_tensor(t).to(mesh.device) for name, t in batch.tensors.items()}
    entries = [TensorEntry(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()]
    header = msgspec.msgpack.encode(JobHeader(batch.params, batch.meta, entries))
    _broadcast(mesh, torch.tensor([len(header)], dtype=torch.int64, device=mesh.device))
    _broadcast(mesh, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(mesh.device))
    for tensor in tensors.values():
        _broadcast(mesh, tensor.contiguous())


def receive_job(mesh: RankMesh) -> StageBatch:
    """Other ranks: wait for rank 0's next job and return it as a batch on this rank's device."""
    import torch

    size = _broadcast(mesh, torch.zeros(1, dtype=torch.int64, device=mesh.device))
    length = int(size.item())
    if not 0 < length <= MAX_HEADER_BYTES:
        raise ValueError(f"job header of {length} bytes from rank 0 (at most {MAX_HEADER_BYTES})")
    raw = _broadcast(mesh, torch.empty(length, dtype=torch.uint8, device=mesh.device))
    header = msgspec.msgpack.decode(raw.cpu().numpy().tobytes(), type=JobHeader)
    tensors = {}
    for entry in header.tensors:
        if entry.dtype not in WIRE_DTYPES:
            raise ValueError(f"tensor {entry.name}: dtype {entry.dtype!r} does not travel between ranks")
        dtype = getattr(torch, WIRE_DTYPES[entry.dtype])
        tensors[entry.name] = _broadcast(mesh, torch.empty(entry.shape, dtype=dtype, device=mesh.device))
    return StageBatch(params=header.params, tensors=dict(tensors), meta=dict(header.meta))


def step_flag(mesh: RankMesh, stop: bool = False) -> bool:
    """After each step: rank 0 says whether to stop; every rank returns what rank 0 said."""
    import torch

    flag = torch.tensor([1 if stop else 0], dtype=torch.int64, device=mesh.device)
    return bool(_broadcast(mesh, flag).item())
