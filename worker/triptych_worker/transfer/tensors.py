"""Staging named tensors into a pool allocation and loading them back out, byte for byte.

Tensors are torch tensors (model workers) or numpy arrays (simulated workers, which never import
torch); a pool of either memory takes both. torch is imported only to handle a torch tensor or a
torch pool, so a simulated worker runs this module without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from triptych.protocol.tensors import ITEMSIZE, WIRE_DTYPES, Array, TensorSpec, wire_dtype

from .allocator import ALIGNMENT, align_up
from .pool import Allocation, TransferPool

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StagedTensors:
    """Tensors copied into one allocation; `manifest` offsets are relative to the allocation start."""

    allocation: Allocation
    manifest: list[dict[str, Any]]
    # A request's state at a step boundary (resume.py), which the head may leave here suspended: it
    # holds no scheduling slot, as nothing computes it (the head freed the slot when it stopped).
    continuation: bool = False

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
        shape, offset, nbytes = list(tensor.shape), align_up(end, ALIGNMENT), ITEMSIZE[dtype]
        for d in shape:
            nbytes *= d
        manifest.append({"name": name, "dtype": dtype, "shape": shape, "offset": offset})  # TensorSpec.to_wire's
        end = offset + nbytes
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
    specs = check_manifest(manifest, total)
    allocation = pool.allocate(total, owner)
    if allocation is None:
        return None
    try:
        slot = pool.view(allocation)
        devices: set[torch.device] = set()
        for spec, tensor in zip(specs, tensors.values(), strict=True):
            if isinstance(tensor, np.ndarray):
                # One copy, strided or not, straight into the slot (no ascontiguousarray first).
                _numpy_view(_as_numpy(slot), spec)[...] = tensor
                continue
            if tensor.is_cuda:
                devices.add(tensor.device)
            # One copy into the slot, whatever the layout: a typed view of the slot is the copy's
            # destination (no contiguous() first, which would copy a strided tensor twice).
            _torch_view(_as_torch(slot), spec).copy_(tensor.detach(), non_blocking=tensor.is_cuda)
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


def view_tensors(
    pool: TransferPool, allocation: Allocation, manifest: list[Any], torch_tensors: bool
) -> dict[str, Any]:
    """The tensors `manifest` describes as views on the slot's bytes: no copy, no new memory.

    They are valid only while `allocation` is live: the caller frees it once it no longer uses
    them (and nothing it produced aliases them). torch tensors (`torch_tensors`) on the CPU, or
    read-only numpy arrays (a write raises; bfloat16 raises ValueError, as in load_tensors).
    stage_tensors aligns every offset to 256 bytes, so every dtype's view is aligned; an offset that
    is not a multiple of its dtype's size raises ValueError naming the tensor, as does a manifest
    that does not fit the allocation.
    """
    specs = check_manifest(manifest, allocation.nbytes)
    for spec in specs:
        if spec.offset % ITEMSIZE[spec.dtype]:  # stage_tensors never does this; a foreign manifest might
            raise ValueError(f"tensor {spec.name!r} at offset {spec.offset} is not aligned for {spec.dtype}")
    slot = pool.view(allocation)  # checks the allocation lies in the pool
    if torch_tensors and pool.memory == "torch":
        return {spec.name: _torch_window(pool, allocation, spec) for spec in specs}
    if torch_tensors:
        torch_slot = _as_torch(slot)
        return {spec.name: _torch_view(torch_slot, spec) for spec in specs}
    numpy_slot = _as_numpy(slot)
    out: dict[str, Any] = {}
    for spec in specs:
        if spec.dtype == "bfloat16":
            raise ValueError(f"tensor {spec.name!r} is bfloat16, which numpy cannot hold; load it as torch")
        array = _numpy_view(numpy_slot, spec)
        array.flags.writeable = False
        out[spec.name] = array
    return out


def _torch_view(slot: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The bytes `spec` places in `slot`, as a tensor of its dtype and shape over the same memory."""
    import torch

    raw = slot[spec.offset : spec.offset + spec.nbytes]
    return raw.view(getattr(torch, WIRE_DTYPES[spec.dtype])).view(spec.shape)


def _torch_window(pool: TransferPool, allocation: Allocation, spec: TensorSpec) -> torch.Tensor:
    """As _torch_view, as one strided window on the pool's buffer of the spec's dtype (a third of
    the slice-view-view's cost: every hop's receiver makes one per input tensor)."""
    import torch

    typed = pool.typed_buffer(getattr(torch, WIRE_DTYPES[spec.dtype]))
    strides, step = [], 1
    for d in reversed(spec.shape):
        strides.append(step)
        step *= max(d, 1)  # as torch strides a contiguous tensor
    start = typed.storage_offset() + (allocation.offset + spec.offset) // ITEMSIZE[spec.dtype]
    return typed.as_strided(spec.shape, strides[::-1], start)


def _numpy_view(slot: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """As _torch_view, for a numpy slot (no bfloat16 in numpy)."""
    return slot[spec.offset : spec.offset + spec.nbytes].view(np.dtype(spec.dtype)).reshape(spec.shape)


def _load_numpy(slot: np.ndarray, specs: list[TensorSpec]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in specs:
        if spec.dtype == "bfloat16":
            raise ValueError(f"tensor {spec.name!r} is bfloat16, which numpy cannot hold; load it as torch")
        array = np.empty(spec.shape, dtype=np.dtype(spec.dtype))
        array.reshape(-1).view(np.uint8)[:] = slot[spec.offset : spec.offset + spec.nbytes]
        out[spec.name] = array
    return out


def _as_numpy(slot: torch.Tensor | np.ndarray) -> np.ndarray:
    """A pool view as a numpy array over the same memory (a torch pool is host memory)."""
    return slot if isinstance(slot, np.ndarray) else slot.numpy()


def _as_torch(slot: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A pool view as a torch tensor over the same memory."""
    if not isinstance(slot, np.ndarray):
        return slot
    import torch

    return torch.from_numpy(slot)
