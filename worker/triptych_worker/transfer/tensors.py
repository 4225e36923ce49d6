"""Staging named tensors into a pool allocation and loading them back out, byte for byte.

Tensors are torch tensors (model workers) or numpy arrays (simulated workers, which never import
torch); a pool of either memory takes both. torch is imported only to handle a torch tensor or a
torch pool, so a simulated worker runs this module without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from triptych.protocol.tensors import WIRE_DTYPES, Array, TensorSpec, wire_dtype

from .allocator import ALIGNMENT, align_up
from .pool import Allocation, TransferPool

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StagedTensors:
    """Tensors copied into one allocation; `manifest` offsets are relative to the allocation start."""

    allocation: Allocation
    manifest: list[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        """Bytes to push: the whole allocation, from its first tensor to the end of its last."""
        return self.allocation.nbytes


def layout(tensors: dict[str, Array]) -> tuple[list[dict[str, Any]], int]:
    """Manifest placing each tensor at a 256-byte-aligned offset, and the total bytes it spans."""
    manifest: list[dict[str, Any]] = []
    end = 0
    for name, tensor in tensors.items():
        try:
            dtype = wire_dtype(tensor)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from None
        spec = TensorSpec(name, dtype, tuple(tensor.shape), align_up(end, ALIGNMENT))
        manifest.append(spec.to_wire())
        end = spec.offset + spec.nbytes
    return manifest, end


def check_manifest(manifest: list[Any], nbytes: int) -> list[TensorSpec]:
    """Parse `manifest`, raising ValueError naming the first tensor that does not fit in `nbytes`."""
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    for raw in manifest:
        spec = TensorSpec.from_wire(raw)
        if spec.name in seen:
            raise ValueError(f"tensor {spec.name!r} appears twice in the manifest")
        seen.add(spec.name)
        if spec.offset + spec.nbytes > nbytes:
            raise ValueError(
                f"tensor {spec.name!r} ({spec.nbytes} bytes at offset {spec.offset}) does not fit "
                f"in the {nbytes}-byte allocation"
            )
        specs.append(spec)
    return specs


def stage_tensors(pool: TransferPool, tensors: dict[str, Array], owner: str) -> StagedTensors | None:
    """Copy `tensors` (torch on any device, or numpy; any layout) into one new allocation owned by `owner`.

    Returns None when the pool has no room right now (back-pressure; retry later); raises
    PayloadTooLarge when it never could, and ValueError for a dtype or shape that cannot travel.
    """
    manifest, total = layout(tensors)
    check_manifest(manifest, total)
    allocation = pool.allocate(total, owner)
    if allocation is None:
        return None
    try:
        slot = pool.view(allocation)
        devices: set[torch.device] = set()
        for raw, tensor in zip(manifest, tensors.values(), strict=True):
            if isinstance(tensor, np.ndarray):
                flat = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
                _as_numpy(slot)[raw["offset"] : raw["offset"] + flat.size] = flat
                continue
            src = _as_bytes(tensor)
            if src.is_cuda:
                devices.add(src.device)
            _as_torch(slot)[raw["offset"] : raw["offset"] + src.numel()].copy_(src, non_blocking=src.is_cuda)
        if devices:
            import torch

            for device in devices:
                # The peer reads the slot as soon as write() returns, so device copies must be done.
                torch.cuda.current_stream(device).synchronize()
    except BaseException:
        pool.free(allocation)
        raise
    return StagedTensors(allocation=allocation, manifest=manifest)


def load_tensors(
    pool: TransferPool, allocation: Allocation, manifest: list[Any], device: str | torch.device | None
) -> dict[str, Any]:
    """New tensors holding the bytes `manifest` describes; the slot may be freed after.

    `device`: torch tensors on that device, or None for numpy arrays in host memory (no torch;
    bfloat16, which numpy lacks, then raises ValueError). Raises ValueError naming the tensor if
    the manifest does not fit the allocation.
    """
    specs = check_manifest(manifest, allocation.nbytes)
    if device is None:
        return _load_numpy(_as_numpy(pool.view(allocation)), specs)
    import torch

    slot = _as_torch(pool.view(allocation))
    target = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        tensor = torch.empty(spec.shape, dtype=getattr(torch, WIRE_DTYPES[spec.dtype]), device=target)
        if spec.nbytes:
            tensor.reshape(-1).view(torch.uint8).copy_(
                slot[spec.offset : spec.offset + spec.nbytes], non_blocking=target.type == "cuda"
            )
        out[spec.name] = tensor
    if target.type == "cuda":
        torch.cuda.current_stream(target).synchronize()
    return out


def _load_numpy(slot: np.ndarray, specs: list[TensorSpec]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in specs:
        if spec.dtype == "bfloat16":
            raise ValueError(f"tensor {spec.name!r} is bfloat16, which numpy cannot hold; load it as torch")
        array = np.empty(spec.shape, dtype=np.dtype(spec.dtype))
        array.reshape(-1).view(np.uint8)[:] = slot[spec.offset : spec.offset + spec.nbytes]
        out[spec.name] = array
    return out


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat contiguous uint8 tensor on its own device."""
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _as_numpy(slot: torch.Tensor | np.ndarray) -> np.ndarray:
    """A pool view as a numpy array over the same memory (a torch pool is host memory)."""
    return slot if isinstance(slot, np.ndarray) else slot.numpy()


def _as_torch(slot: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A pool view as a torch tensor over the same memory."""
    if not isinstance(slot, np.ndarray):
        return slot
    import torch

    return torch.from_numpy(slot)
