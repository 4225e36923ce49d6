"""Sending a role's outputs from where they are: each CPU tensor's own memory, registered with the
transport from staging until its write ends, instead of a copy into the pool.

The receiver cannot tell the difference: it gets the same manifest and the same bytes at the same
offsets of its slot (one write per tensor instead of one for the span). The sender saves the copy
into its pool, which on the CPU costs a third of the write at 16 MiB (docs/transfer.md, "Outputs
sent in place").

Only where that is cheap and safe, else `stage_in_place` answers None and the caller copies into
the pool as before:
- the transport registers cheaply (Mooncake's TCP transport: a table entry of ~2 us; RDMA pins
  the pages of every registration, so there the pool stays, registered once);
- every tensor is on the CPU and contiguous (a GPU's outputs are copied out of the device anyway);
- no tensor overlaps memory already registered: a view on the pool (an input passed through, whose
  slot is freed when the stage is done) or a tensor another request is sending (a shared cache
  entry). Mooncake refuses overlapping registrations, and that refusal is the check.

The tensors are held (their memory cannot be freed or reused) until `release`, which the worker
calls when the write has ended or the request is cancelled before it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .engine import MooncakeTransport, PendingWrite
from .errors import TransferError
from .tensors import layout

if TYPE_CHECKING:
    from triptych.protocol.tensors import Array

log = logging.getLogger(__name__)


@dataclass
class InPlaceTensors:
    """Outputs registered where they are; `manifest` and `nbytes` as a pool staging would give them."""

    transport: MooncakeTransport
    manifest: list[dict[str, Any]]
    nbytes: int  # the span the receiver's slot must hold, padding between tensors included
    ranges: list[tuple[int, int, int]]  # (local address, offset in the span, bytes) per tensor
    tensors: list[Any] = field(repr=False)  # held: their memory stays valid until release()
    released: bool = False

    def submit_write(self, dest_session: str, dest_addr: int) -> PendingWrite:
        """Write every tensor to its offset in the receiver's slot at `dest_addr`."""
        return self.transport.submit_writes(
            dest_session, [(addr, dest_addr + offset, nbytes) for addr, offset, nbytes in self.ranges]
        )

    def release(self) -> None:
        """Unregister the tensors and let them go (idempotent). Not while a write of them is under way."""
        if self.released:
            return
        self.released = True
        for addr, _, nbytes in self.ranges:
            if nbytes:
                self.transport.unregister(addr)
        self.tensors = []


def stage_in_place(transport: object, tensors: dict[str, Array], pool_bytes: int) -> InPlaceTensors | None:
    """`tensors` registered for sending as they are, or None where they must be copied into the pool.

    Outputs larger than the sender's pool (`pool_bytes`) are not sent in place either: the pool
    copy then refuses them naming --disagg-transfer-pool-size, as it would over RDMA, so a pool
    too small for a role's outputs fails the same way on every transport."""
    if not isinstance(transport, MooncakeTransport) or not transport.sends_in_place:
        return None
    ranges = []
    for tensor in tensors.values():
        where = _cpu_contiguous(tensor)
        if where is None:
            return None
        ranges.append(where)
    manifest, total = layout(tensors)
    if total > pool_bytes:
        return None
    placed = [(addr, int(spec["offset"]), nbytes) for (addr, nbytes), spec in zip(ranges, manifest, strict=True)]
    registered: list[int] = []
    try:
        for addr, _, nbytes in placed:
            if nbytes:
                transport.register(addr, nbytes)
                registered.append(addr)
    except TransferError as exc:  # overlaps a registration: the pool, or a tensor another request sends
        log.debug("outputs copied into the pool: %s", exc)
        for addr in registered:
            transport.unregister(addr)
        return None
    return InPlaceTensors(transport, manifest, total, placed, list(tensors.values()))


def _cpu_contiguous(tensor: Any) -> tuple[int, int] | None:
    """(address, bytes) of a CPU tensor's contiguous memory; None for any other tensor."""
    if isinstance(tensor, np.ndarray):
        return (tensor.ctypes.data, tensor.nbytes) if tensor.flags.c_contiguous else None
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()
