"""Rank 0 hands each job to the other ranks: a msgspec header, then the tensors, by broadcast.

A job is one request, or a group of compatible ones the worker runs as one batched forward
(triptych_worker.batching): the header lists each request's params, meta and tensors, and every
rank runs the group as rank 0 does, request for request.

The header is decoded into typed structs (GenerationParams is checked field by field), never
unpickled: torch.distributed's object collectives pickle, so they are not used. A one-element
step flag follows every denoising step, so that a request the head cancels stops on every rank
at the same step instead of leaving followers waiting in a collective. For a job that may be
handed off (docs/design.md "Migration") the flag also carries rank 0's answer to the question the
loop asks before the next step, whether to stop there and hand the state on (StepBoundary): only
rank 0 hears the head's HandOff, and every rank must stop at the same boundary. A continuation
(resume.py) travels as any job: its resume meta in the header, its latents and scheduler history
among the tensors. The job also names the source of every LoRA adapter its requests use, as rank 0's
catalogue gave it when it sent the job: every rank loads those, whatever its own reading of a
catalogue file that changes meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from triptych.params import GenerationParams
from triptych.protocol.tensors import WIRE_DTYPES
from triptych_worker.stages import StageBatch

if TYPE_CHECKING:
    import torch

    from triptych_worker.parallel.mesh import RankMesh

# A job's parameters may carry a reference image inline (at most 16 MiB, triptych.reference; each
# request's came in one control header, codec.MAX_HEADER_BYTES): room for a group of 50 such, which
# the worker holds in memory anyway. A header past it is refused on rank 0 before any rank sees it;
# for a follower, a longer length is a garbled one.
MAX_HEADER_BYTES = 1 << 30
GO_ON, STOP, HAND_OFF = 0, 1, 2
"""A step flag: carry on; stop (the head cancelled the request); hand off before the next step."""


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: list[int]


class JobHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    params: GenerationParams
    meta: dict[str, Any]
    tensors: list[TensorEntry]
    hands_off: bool = False  # rank 0 may stop the loop at a step boundary: every rank asks it before each step


class JobsHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    jobs: list[JobHeader]  # one request, or a group run as one batched forward
    lora_sources: dict[str, str] = {}  # adapter name -> its source, from rank 0's catalogue


class StopFollowing(Exception):
    """Rank 0 stopped the job this rank is following (the head cancelled it)."""


def _broadcast(mesh: RankMesh, tensor: torch.Tensor, idle: bool = False) -> torch.Tensor:
    """Rank 0's `tensor` on every rank: in the world group, which gives up on a hung peer after
    STEP_TIMEOUT; `idle`: the first broadcast of a job, which followers wait in between jobs, on the
    default group (IDLE_TIMEOUT)."""
    import torch.distributed as dist

    dist.broadcast(tensor, src=0, group=None if idle else mesh.world_group)
    return tensor


def send_jobs(mesh: RankMesh, batches: list[StageBatch], lora_sources: dict[str, str] | None = None) -> None:
    """Rank 0: give every rank these requests' params, meta and input tensors (one request, or a group),
    and the sources of the LoRA adapters they use."""
    import torch

    jobs: list[JobHeader] = []
    inputs: list[torch.Tensor] = []
    for batch in batches:
        tensors = {name: torch.as_tensor(t).to(mesh.device) for name, t in batch.tensors.items()}
        entries = [TensorEntry(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()]
        jobs.append(JobHeader(batch.params, batch.meta, entries, batch.hand_off is not None))
        inputs += tensors.values()
    header = msgspec.msgpack.encode(JobsHeader(jobs, dict(lora_sources or {})))
    if len(header) > MAX_HEADER_BYTES:  # before any broadcast: the ranks stay in step, only these requests fail
        raise ValueError(
            f"image: the {len(batches)} request(s) carry {len(header)} bytes of parameters (reference images), "
            f"more than the {MAX_HEADER_BYTES} that pass between this worker's ranks; send smaller references"
        )
    _broadcast(mesh, torch.tensor([len(header)], dtype=torch.int64, device=mesh.device), idle=True)
    _broadcast(mesh, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(mesh.device))
    for tensor in inputs:
        _broadcast(mesh, tensor.contiguous())


def receive_jobs(mesh: RankMesh) -> tuple[list[StageBatch], dict[str, str]]:
    """Other ranks: wait for rank 0's next job; return its requests as batches on this rank's device,
    and its LoRA adapters' sources."""
    import torch

    size = _broadcast(mesh, torch.zeros(1, dtype=torch.int64, device=mesh.device), idle=True)
    length = int(size.item())
    if not 0 < length <= MAX_HEADER_BYTES:
        raise ValueError(f"job header of {length} bytes from rank 0 (at most {MAX_HEADER_BYTES})")
    raw = _broadcast(mesh, torch.empty(length, dtype=torch.uint8, device=mesh.device))
    header = msgspec.msgpack.decode(raw.cpu().numpy().tobytes(), type=JobsHeader)
    batches = []
    for job in header.jobs:
        tensors = {}
        for entry in job.tensors:
            if entry.dtype not in WIRE_DTYPES:
                raise ValueError(f"tensor {entry.name}: dtype {entry.dtype!r} does not travel between ranks")
            dtype = getattr(torch, WIRE_DTYPES[entry.dtype])
            tensors[entry.name] = _broadcast(mesh, torch.empty(entry.shape, dtype=dtype, device=mesh.device))
        batch = StageBatch(params=job.params, tensors=dict(tensors), meta=dict(job.meta))
        if job.hands_off:
            batch.hand_off = StepBoundary(mesh)
        batches.append(batch)
    return batches, header.lora_sources


def step_flag(mesh: RankMesh, flag: int = GO_ON) -> int:
    """After each step: rank 0 says GO_ON, STOP or HAND_OFF; every rank returns what rank 0 said."""
    import torch

    return int(_broadcast(mesh, torch.tensor([flag], dtype=torch.int64, device=mesh.device)).item())


class StepBoundary:
    """A job's `hand_off` on every rank: "stop before this step and hand the state on?", answered by
    rank 0's worker (`ask`; None on the other ranks) and the same on every rank.

    Rank 0 asks its worker right after each step's progress report and sends the answer in that
    step's flag (`carry`), which the loop uses at its next question, so asking costs no broadcast
    beyond the step flag; a question no step flag answered (before a job's first step) takes a
    broadcast of its own, on every rank alike."""

    def __init__(self, mesh: RankMesh, ask: Callable[[], bool] | None = None):
        self.mesh = mesh
        self.ask = ask
        self.carried: bool | None = None  # the last step flag's answer, not yet used

    def decide(self) -> int:
        """Rank 0, for the step flag it is about to send: HAND_OFF if its worker says so."""
        return HAND_OFF if self.ask is not None and self.ask() else GO_ON

    def carry(self, flag: int) -> None:
        self.carried = flag == HAND_OFF

    def __call__(self) -> bool:
        answer, self.carried = self.carried, None
        if answer is None:
            answer = step_flag(self.mesh, self.decide()) == HAND_OFF
        return answer
