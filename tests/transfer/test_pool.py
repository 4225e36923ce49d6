"""TransferPool: first-fit allocation, alignment, coalescing, back-pressure and cleanup."""

from __future__ import annotations

import threading
import time

import pytest

from triptych_worker.transfer import ALIGNMENT, Allocation, PayloadTooLarge, TransferPool
from triptych_worker.transfer.pool import raw_bytes

KIB = 1024


class RecordingRegistrar:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def register(self, ptr: int, nbytes: int) -> None:
        self.calls.append((ptr, nbytes))


def test_pool_registers_its_whole_buffer_once() -> None:
    registrar = RecordingRegistrar()
    pool = TransferPool(64 * KIB, "encoder", registrar)
    pool.allocate(KIB, "r1")
    assert registrar.calls == [(pool.base_addr, 64 * KIB)]


def test_a_pinned_pool_asks_for_exactly_its_size() -> None:
    # torch rounds a pinned allocation up to a power of two: one byte over 256 MiB would lock 512 MiB.
    # Pinned memory is page-aligned already; only plain memory needs the slack to align its base.
    assert raw_bytes(256 * 1024 * KIB, pinned=True) == 256 * 1024 * KIB
    assert raw_bytes(256 * 1024 * KIB, pinned=False) == 256 * 1024 * KIB + ALIGNMENT - 1


def test_allocations_are_aligned_in_offset_and_address() -> None:
    pool = TransferPool(64 * KIB, "encoder")
    allocations = [pool.allocate(n, f"r{n}") for n in (1, 255, 256, 257, 1000, 0)]
    for a in allocations:
        assert a is not None
        assert a.offset % ALIGNMENT == 0
        assert a.addr % ALIGNMENT == 0
        assert a.addr == pool.base_addr + a.offset
    offsets = [a.offset for a in allocations if a is not None]
    assert offsets == [0, 256, 512, 768, 1280, 2304]


def test_first_fit_reuses_the_lowest_hole_that_fits() -> None:
    pool = TransferPool(64 * KIB, "encoder")
    a = pool.allocate(1 * KIB, "a")
    b = pool.allocate(4 * KIB, "b")
    c = pool.allocate(1 * KIB, "c")
    assert a and b and c
    pool.free(a)
    pool.free(c)  # holes now: [0, 1K) and everything from 5K on
    small = pool.allocate(512, "small")
    assert small is not None and small.offset == 0
    big = pool.allocate(2 * KIB, "big")  # does not fit the 512-byte remainder of the first hole
    assert big is not None and big.offset == 5 * KIB


def test_freed_neighbours_coalesce_into_one_block() -> None:
    pool = TransferPool(16 * KIB, "denoiser")
    parts = [pool.allocate(4 * KIB, f"r{i}") for i in range(4)]
    assert pool.free_bytes == 0 and pool.largest_free_block == 0
    for i in (0, 2, 1, 3):  # free out of order so both left and right merges happen
        part = parts[i]
        assert part is not None
        pool.free(part)
    assert pool.free_bytes == 16 * KIB
    assert pool.largest_free_block == 16 * KIB
    whole = pool.allocate(16 * KIB, "whole")
    assert whole is not None and whole.offset == 0


def test_full_pool_returns_none_for_back_pressure() -> None:
    pool = TransferPool(8 * KIB, "encoder")
    first = pool.allocate(6 * KIB, "r1")
    assert first is not None
    assert pool.allocate(4 * KIB, "r2") is None
    pool.free(first)
    assert pool.allocate(4 * KIB, "r2") is not None


def test_reserved_bytes_count_only_allocations_still_live() -> None:
    """A heartbeat lists the standing slots, then asks what they reserve; the leader may free them in
    between (a head replaced): those count for nothing, and the count never raises."""
    pool = TransferPool(8 * KIB, "denoiser")
    kept, freed = pool.allocate(1000, "s"), pool.allocate(2 * KIB, "s")
    assert kept is not None and freed is not None
    pool.free(freed)
    again = pool.allocate(2 * KIB, "other")  # the same offset, another allocation
    assert again is not None and again.offset == freed.offset
    assert pool.reserved_bytes([kept, freed]) == pool.reserved_bytes([kept]) == ALIGNMENT * -(-1000 // ALIGNMENT)


def test_payload_larger_than_pool_raises_with_the_flag_and_role() -> None:
    pool = TransferPool(8 * KIB, "denoiser")
    with pytest.raises(PayloadTooLarge) as info:
        pool.allocate(8 * KIB + 1, "r1")
    assert str(info.value) == (
        "payload of 8193 bytes exceeds --disagg-transfer-pool-size (8192 bytes); raise the flag on the denoiser workers"
    )


def test_payload_of_exactly_the_pool_size_fits_an_unaligned_pool() -> None:
    pool = TransferPool(8 * KIB + 100, "encoder")
    whole = pool.allocate(8 * KIB + 100, "r1")
    assert whole is not None and pool.free_bytes == 0


def test_free_owner_releases_everything_the_request_holds_and_is_idempotent() -> None:
    pool = TransferPool(16 * KIB, "encoder")
    held = [pool.allocate(KIB, "req-1") for _ in range(3)]
    other = pool.allocate(KIB, "req-2")
    assert all(held) and other is not None
    assert pool.free_owner("req-1") == 3
    assert pool.free_owner("req-1") == 0
    assert pool.free_owner("never-seen") == 0
    assert pool.free_bytes == 15 * KIB


def test_freeing_a_stale_allocation_does_not_touch_its_successor() -> None:
    pool = TransferPool(16 * KIB, "encoder")
    stale = pool.allocate(KIB, "req-1")
    assert stale is not None
    pool.free_owner("req-1")  # e.g. the request was cancelled
    successor = pool.allocate(KIB, "req-2")
    assert successor is not None and successor.offset == stale.offset
    assert pool.free(stale) is False
    assert pool.free(successor) is True
    assert pool.free_bytes == 16 * KIB


def test_concurrent_allocate_and_free_never_overlap_or_leak() -> None:
    pool = TransferPool(64 * KIB, "encoder")
    live: dict[int, tuple[int, int]] = {}  # id(allocation) -> byte range, across all threads
    live_lock = threading.Lock()
    problems: list[str] = []
    deadline = time.monotonic() + 5.0

    def worker(seed: int) -> None:
        owner = f"w{seed}"
        mine: list[Allocation] = []
        for i in range(400):
            if time.monotonic() > deadline:
                break
            nbytes = 1 + (seed * 7919 + i * 104729) % (6 * KIB)
            a = pool.allocate(nbytes, owner)
            if a is not None:
                with live_lock:
                    problems.extend(
                        f"{a.offset}+{nbytes} overlaps {start}-{end}"
                        for start, end in live.values()
                        if a.offset < end and start < a.offset + nbytes
                    )
                    live[id(a)] = (a.offset, a.offset + nbytes)
                mine.append(a)
            if i % 50 == 49:
                with live_lock:
                    for held in mine:
                        del live[id(held)]
                mine.clear()
                pool.free_owner(owner)
            elif len(mine) > 2:
                oldest = mine.pop(0)
                with live_lock:
                    del live[id(oldest)]
                if not pool.free(oldest):
                    problems.append(f"allocation at {oldest.offset} was freed behind its owner's back")
        with live_lock:
            for held in mine:
                del live[id(held)]
        pool.free_owner(owner)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert problems == []
    assert pool.free_bytes == 64 * KIB
    assert pool.largest_free_block == 64 * KIB


# --- holding a slot whose bytes are in use (inputs used in place) ------------------------------


def test_a_held_allocation_outlives_a_free_until_it_is_unheld() -> None:
    pool = TransferPool(4096, "denoiser", memory="numpy")
    alloc = pool.allocate(4096, "req-1")
    assert alloc is not None and pool.hold(alloc)
    assert pool.free(alloc), "the free is accepted"
    assert not pool.free(alloc), "a second free is stale"
    assert pool.free_bytes == 0 and pool.allocate(256, "req-2") is None, "but the bytes stay in use"
    assert pool.unhold(alloc), "released once unheld"
    assert pool.free_bytes == 4096 and not pool.held(alloc)


def test_free_owner_of_a_held_allocation_takes_effect_at_unhold_and_stays_idempotent() -> None:
    pool = TransferPool(8192, "denoiser", memory="numpy")
    held, other = pool.allocate(4096, "req-1"), pool.allocate(1024, "req-1")
    assert held is not None and other is not None and pool.hold(held)
    assert pool.free_owner("req-1") == 2
    assert pool.free_bytes == 4096, "the held slot stays; the other is freed now"
    assert pool.free_owner("req-1") == 0
    assert pool.unhold(held) and pool.free_bytes == 8192


def test_unholding_without_a_free_keeps_the_allocation_and_a_freed_one_cannot_be_held() -> None:
    pool = TransferPool(4096, "denoiser", memory="numpy")
    alloc = pool.allocate(1024, "req-1")
    assert alloc is not None and pool.hold(alloc)
    assert not pool.hold(alloc), "held once"
    assert not pool.unhold(alloc), "nothing freed it meanwhile: still live"
    assert pool.free_bytes == 4096 - 1024
    assert pool.free(alloc) and pool.free_bytes == 4096
    assert not pool.hold(alloc), "released: it must not be viewed"
