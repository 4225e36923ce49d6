"""The per-worker transfer pool: one registered buffer that senders stage in and peers write to."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from .allocator import ALIGNMENT, FirstFitAllocator
from .errors import PayloadTooLarge

if TYPE_CHECKING:
    import torch

PoolMemory = Literal["torch", "numpy"]


class MemoryRegistrar(Protocol):
    """What the pool needs from a transport: make a host range reachable by remote peers."""

    def register(self, ptr: int, nbytes: int) -> None: ...


@dataclass(frozen=True, eq=False)
class Allocation:
    """A live range of the pool. `addr` is what a remote peer writes to; `owner` is a request id.

    Compared by identity: a stale Allocation never matches a newer one at the same offset.
    """

    offset: int
    nbytes: int
    addr: int
    owner: str


def raw_bytes(pool_bytes: int, pinned: bool) -> int:
    """The bytes to allocate for a pool of `pool_bytes` whose base must be ALIGNMENT-aligned. Plain
    memory is over-allocated by one alignment unit, so the base can be moved to an aligned address.
    Pinned memory is page-aligned already, and gets exactly `pool_bytes`: torch's pinned allocator
    rounds every request up to a power of two, so one byte over the default 256 MiB would page-lock
    512 MiB. (A pool size that is not a power of two is rounded up all the same: choose one that is.)"""
    return pool_bytes if pinned else pool_bytes + ALIGNMENT - 1


class TransferPool:
    """A contiguous uint8 buffer of `pool_bytes`, registered once, shared out by first fit.

    `memory="torch"` (model workers): the buffer is a torch tensor, pinned when CUDA is available
    (fast, async device copies) and plain CPU memory otherwise. `memory="numpy"` (simulated
    workers): a numpy array, and torch is never imported. Either way its base address is aligned
    to 256 bytes, as is every allocation, and stage_tensors/load_tensors take torch tensors and
    numpy arrays alike. All methods are thread-safe. `role` names the workers in the
    PayloadTooLarge message (e.g. "encoder").
    """

    def __init__(
        self, pool_bytes: int, role: str, transport: MemoryRegistrar | None = None, memory: PoolMemory = "torch"
    ) -> None:
        if pool_bytes <= 0:
            raise ValueError(f"--disagg-transfer-pool-size must be > 0 bytes, got {pool_bytes}")
        self.role = role
        self.memory = memory
        self._allocator = FirstFitAllocator(pool_bytes, ALIGNMENT)
        raw: Any
        if memory == "torch":
            import torch

            self.pinned = torch.cuda.is_available()
            raw = torch.empty(raw_bytes(pool_bytes, self.pinned), dtype=torch.uint8, pin_memory=self.pinned)
            shift = -raw.data_ptr() % ALIGNMENT
            if self.pinned and shift:
                raise RuntimeError(f"pinned memory at {raw.data_ptr():#x} is not {ALIGNMENT}-byte aligned")
        elif memory == "numpy":
            self.pinned = False
            raw = np.empty(raw_bytes(pool_bytes, False), dtype=np.uint8)  # untouched pages cost no memory
            shift = -raw.ctypes.data % ALIGNMENT
        else:
            raise ValueError(f"pool memory must be 'torch' or 'numpy', got {memory!r}")
        self._raw = raw
        self.buffer: torch.Tensor | np.ndarray = raw[shift : shift + pool_bytes]
        self.base_addr: int = raw.data_ptr() + shift if memory == "torch" else raw.ctypes.data + shift
        self._lock = threading.Lock()
        self._live: dict[int, Allocation] = {}
        self._owners: dict[str, set[int]] = {}
        self._held: dict[int, bool] = {}  # offsets with views in use -> freed meanwhile (release on unhold)
        self._typed: dict[Any, Any] = {}  # torch dtype -> the buffer viewed as it (typed_buffer)
        if transport is not None:
            transport.register(self.base_addr, pool_bytes)

    @property
    def pool_bytes(self) -> int:
        return self._allocator.capacity

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._allocator.free_bytes

    @property
    def largest_free_block(self) -> int:
        with self._lock:
            return self._allocator.largest_free_block

    def reserved_bytes(self, allocations: list[Allocation]) -> int:
        """Pool bytes those of the given allocations still live take, alignment included (one freed since
        the caller listed it, by another thread, takes none)."""
        with self._lock:
            return sum(self._allocator.reserved_size(a.offset) for a in allocations if self._live.get(a.offset) is a)

    def allocate(self, nbytes: int, owner: str) -> Allocation | None:
        """Reserve `nbytes` for `owner`; None when no free block fits right now (back-pressure).

        Raises PayloadTooLarge when `nbytes` exceeds the whole pool, since waiting cannot help.
        """
        if nbytes > self.pool_bytes:
            raise PayloadTooLarge(nbytes, self.pool_bytes, self.role)
        with self._lock:
            offset = self._allocator.allocate(nbytes)
            if offset is None:
                return None
            allocation = Allocation(offset=offset, nbytes=nbytes, addr=self.base_addr + offset, owner=owner)
            self._live[offset] = allocation
            self._owners.setdefault(owner, set()).add(offset)
            return allocation

    def free(self, allocation: Allocation) -> bool:
        """Release `allocation`; False (and no change) if it was already released, e.g. by free_owner.

        A held allocation (hold()) is released when it is unheld, not now: True all the same.
        """
        with self._lock:
            if self._live.get(allocation.offset) is not allocation or self._held.get(allocation.offset, False):
                return False  # released already, or to be released at unhold()
            self._release_or_defer(allocation)
            return True

    def free_owner(self, owner: str) -> int:
        """Release everything `owner` holds (failure or cancel cleanup); returns how many. Idempotent.

        Held allocations among them are released when unheld (counted here all the same).
        """
        with self._lock:
            offsets = [o for o in self._owners.get(owner, ()) if not self._held.get(o, False)]
            for offset in offsets:
                self._release_or_defer(self._live[offset])
            return len(offsets)

    def hold(self, allocation: Allocation) -> bool:
        """Keep `allocation` live while tensors viewing it are in use: a free or free_owner meanwhile
        (a cancel, a head change) takes effect at unhold(). False, and nothing held, if it is already
        released (the caller must not view it)."""
        with self._lock:
            if self._live.get(allocation.offset) is not allocation or allocation.offset in self._held:
                return False
            self._held[allocation.offset] = False
            return True

    def unhold(self, allocation: Allocation) -> bool:
        """The views on `allocation` are no longer used; True if a free that came meanwhile released it now."""
        with self._lock:
            if self._live.get(allocation.offset) is not allocation or allocation.offset not in self._held:
                return False
            if not self._held.pop(allocation.offset):
                return False
            self._release(allocation)
            return True

    def held(self, allocation: Allocation) -> bool:
        """Whether views on `allocation` are in use (hold() without unhold() yet)."""
        with self._lock:
            return self._live.get(allocation.offset) is allocation and allocation.offset in self._held

    def view(self, allocation: Allocation) -> torch.Tensor | np.ndarray:
        """The allocation's bytes as a uint8 tensor (or numpy array, as the buffer is) sharing the pool's memory."""
        if allocation.offset < 0 or allocation.offset + allocation.nbytes > self.pool_bytes:
            raise ValueError(
                f"allocation at offset {allocation.offset} of {allocation.nbytes} bytes is outside "
                f"this pool of {self.pool_bytes} bytes"
            )
        return self.buffer[allocation.offset : allocation.offset + allocation.nbytes]

    def typed_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole torch buffer as `dtype` elements (cached per dtype; the views a receiver makes
        of its inputs are strided windows on it, one op each). Every allocation starts 256-aligned,
        so a tensor placed at an offset aligned for its dtype starts on an element."""
        typed: torch.Tensor | None = self._typed.get(dtype)
        if typed is None:
            buffer = self.buffer
            assert not isinstance(buffer, np.ndarray), "typed buffers are for a torch pool"
            itemsize = dtype.itemsize
            typed = self._typed[dtype] = buffer[: self.pool_bytes // itemsize * itemsize].view(dtype)
        return typed

    def _release_or_defer(self, allocation: Allocation) -> None:
        if allocation.offset in self._held:
            self._held[allocation.offset] = True  # released by unhold()
        else:
            self._release(allocation)

    def _release(self, allocation: Allocation) -> None:
        del self._live[allocation.offset]
        held = self._owners[allocation.owner]
        held.discard(allocation.offset)
        if not held:
            del self._owners[allocation.owner]
        self._allocator.free(allocation.offset)
