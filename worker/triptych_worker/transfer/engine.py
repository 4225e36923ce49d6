"""MooncakeTransport: one Mooncake TransferEngine per worker, P2P handshake, TCP or RDMA."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from .errors import MooncakeNotInstalled, TransferError, TransferStalled

# How write() waits for Mooncake. transfer_sync_write spins a core for the whole write, which
# on a host with few cores starves the transport threads doing the work (and every other
# process). Instead: poll without pausing while the write is young (small and RDMA writes end
# within microseconds), then poll yielding the core to anything runnable, and once the write is
# long, sleep a small fraction of the time already spent between polls (at most ~5% added).
SPIN_S = 200e-6
YIELD_S = 2e-3
POLL_FRACTION = 0.05
POLL_MAX_S = 1e-3
WRITE_TIMEOUT_S = 120.0
_PENDING, _DONE = 0, 1


def _import_transfer_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise MooncakeNotInstalled(str(exc)) from exc
    return TransferEngine


class MooncakeTransport:
    """Writes local registered memory into a peer's registered memory (one-sided, synchronous).

    `ib_device=None` selects the TCP transport (any host, no NIC needed); a device name such as
    "mlx5_0" selects RDMA through that NIC. Peers address each other by `session_id`
    ("host:rpc_port"), exchanged through the head; no metadata server is involved.
    """

    def __init__(self, hostname: str, ib_device: str | None = None) -> None:
        engine_cls = _import_transfer_engine()
        self.hostname = hostname
        self.protocol = "tcp" if ib_device is None else "rdma"
        self.ib_device = ib_device
        self._engine: Any = engine_cls()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", self.protocol, ib_device or "")
        if rc != 0:
            nic = f" on --disagg-ib-device {ib_device}" if ib_device else ""
            raise TransferError(
                f"Mooncake {self.protocol} engine failed to start{nic} at --disagg-p2p-hostname {hostname} "
                f"(return code {rc}); check that the address belongs to this host"
                + (" and the device name matches `ibv_devices`" if ib_device else "")
            )
        self.session_id: str = f"{hostname}:{self._engine.get_rpc_port()}"
        self._regions: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def engine(self) -> Any:
        """The underlying mooncake TransferEngine (for benchmarks and diagnostics)."""
        return self._engine

    def register(self, ptr: int, nbytes: int) -> None:
        """Make `nbytes` at `ptr` readable/writable by peers; raises TransferError on failure."""
        self._check_open()
        if nbytes <= 0:
            raise ValueError(f"cannot register {nbytes} bytes")
        rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            hint = "; RDMA pins the memory, so check the memlock limit (`ulimit -l`)" if self.protocol == "rdma" else ""
            raise TransferError(f"Mooncake could not register {nbytes} bytes at 0x{ptr:x} (return code {rc}){hint}")
        with self._lock:
            self._regions.append((ptr, nbytes))

    def write(self, dest_session: str, local_addr: int, dest_addr: int, nbytes: int) -> None:
        """Copy `nbytes` from local registered memory to `dest_addr` in peer `dest_session`; blocks.

        Raises TransferError naming the peer, size and status if the engine refuses or the peer is
        unreachable, and before calling the engine if the local range is not registered;
        TransferStalled (a TransferError) if the write is still pending after WRITE_TIMEOUT_S, in
        which case the engine may still write into the peer's range (and read the local one).
        """
        self._check_open()
        if nbytes < 0:
            raise ValueError(f"cannot write {nbytes} bytes")
        if nbytes == 0:
            return
        if not self._is_registered(local_addr, nbytes):
            raise TransferError(
                f"local range 0x{local_addr:x}+{nbytes} is not inside memory registered with this transport; "
                "stage the payload in the TransferPool first"
            )
        batch = self._engine.transfer_submit_write(dest_session, local_addr, dest_addr, nbytes)
        status = self._wait(batch) if batch else None
        if status == _DONE:
            return
        what = f"Mooncake {self.protocol} write of {nbytes} bytes to peer {dest_session} at 0x{dest_addr:x}"
        if status == _PENDING:
            raise TransferStalled(
                f"{what} did not finish in {WRITE_TIMEOUT_S:g}s; the peer may be stalled or its network congested"
            )
        outcome = "could not start" if status is None else f"failed (status {status})"
        raise TransferError(f"{what} {outcome}; the peer may be gone or the address outside its transfer pool")

    def _wait(self, batch: int) -> int:
        """The final status of a submitted write (1 done, negative failed, 0 still pending at the timeout).

        Mooncake forgets a batch once it has reported it done, so its status is read until then only.
        """
        started = time.perf_counter()
        while (status := self._engine.transfer_check_status(batch)) == _PENDING:
            elapsed = time.perf_counter() - started
            if elapsed > WRITE_TIMEOUT_S:
                break
            if elapsed > YIELD_S:
                time.sleep(min(POLL_MAX_S, elapsed * POLL_FRACTION))
            elif elapsed > SPIN_S:
                os.sched_yield()
        return status

    def close(self) -> None:
        """Unregister all memory and drop the engine. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions, self._regions = self._regions, []
        for ptr, _ in regions:
            self._engine.unregister_memory(ptr)
        self._engine = None

    def __enter__(self) -> MooncakeTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _is_registered(self, addr: int, nbytes: int) -> bool:
        with self._lock:
            return any(start <= addr and addr + nbytes <= start + size for start, size in self._regions)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transport {self.session_id} is closed")
