"""First-fit allocation of byte ranges inside one fixed-size region (offsets only, no memory)."""

from __future__ import annotations

import bisect

ALIGNMENT = 256


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Round `n` up to a multiple of `alignment`."""
    return -(-n // alignment) * alignment


class FirstFitAllocator:
    """Free list of (offset, size) blocks kept sorted by offset; freed neighbours coalesce.

    Every block starts on an `alignment` boundary, so every returned offset is aligned. A block
    reserves `align_up(nbytes)` bytes, clipped at the end of the region so that a request of
    exactly `capacity` bytes fits an empty region. Zero-byte requests still reserve one aligned
    unit so that every live range has its own offset. Not thread-safe: the caller holds a lock.
    """

    def __init__(self, capacity: int, alignment: int = ALIGNMENT) -> None:
        if capacity <= 0:
            raise ValueError(f"allocator capacity must be > 0 bytes, got {capacity}")
        self.capacity = capacity
        self.alignment = alignment
        self._free_offsets: list[int] = [0]
        self._free_sizes: list[int] = [capacity]
        self._reserved: dict[int, int] = {}  # live offset -> reserved size

    def allocate(self, nbytes: int) -> int | None:
        """Offset of the first free block that fits `nbytes`, or None when none does now."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        want = align_up(max(nbytes, 1), self.alignment)
        for i, (offset, size) in enumerate(zip(self._free_offsets, self._free_sizes, strict=True)):
            if size < max(nbytes, 1):
                continue
            take = min(want, size)
            if take == size:
                del self._free_offsets[i]
                del self._free_sizes[i]
            else:
                self._free_offsets[i] = offset + take
                self._free_sizes[i] = size - take
            self._reserved[offset] = take
            return offset
        return None

    def free(self, offset: int) -> None:
        """Return the block at `offset` to the free list, merging it with free neighbours."""
        size = self._reserved.pop(offset, None)
        if size is None:
            raise KeyError(f"offset {offset} is not allocated")
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and offset + size == self._free_offsets[i]:
            size += self._free_sizes[i]
            del self._free_offsets[i]
            del self._free_sizes[i]
        if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:
            self._free_sizes[i - 1] += size
        else:
            self._free_offsets.insert(i, offset)
            self._free_sizes.insert(i, size)

    def reserved_size(self, offset: int) -> int:
        """Bytes reserved by the live block at `offset` (its aligned size)."""
        return self._reserved[offset]

    @property
    def free_bytes(self) -> int:
        return sum(self._free_sizes)

    @property
    def largest_free_block(self) -> int:
        return max(self._free_sizes, default=0)

    @property
    def free_blocks(self) -> list[tuple[int, int]]:
        """(offset, size) of each free block in address order; for tests and diagnostics."""
        return list(zip(self._free_offsets, self._free_sizes, strict=True))
