"""MooncakeTransport: one Mooncake TransferEngine per worker, P2P handshake, TCP or RDMA."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from triptych.config import ConfigError

from .errors import MooncakeNotInstalled, TransferError, TransferStalled
from .listeners import mooncake_port_range
from .waiting import WriteRates, poll_interval

# How a write is waited for: waiting.py.
WRITE_TIMEOUT_S = 120.0
_PENDING, _DONE = 0, 1
_PEER_HINT = "the peer may be gone or the address outside its transfer pool"

log = logging.getLogger(__name__)


def _import_transfer_engine() -> Any:
    mooncake_port_range()  # read by the engine when it starts
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise MooncakeNotInstalled(str(exc)) from exc
    return TransferEngine


RDMA_DEVICES = Path("/sys/class/infiniband")
"""Where the kernel lists this host's RDMA devices (what `ibv_devices` prints)."""


def check_rdma_device(name: str | None, devices: Path = RDMA_DEVICES) -> None:
    """--disagg-ib-device must name an RDMA device of this host: given one it lacks, Mooncake finds no
    NIC and moves tensors over TCP without a word. ConfigError naming the flag and the devices."""
    if name is None:
        return
    have = sorted(p.name for p in devices.iterdir()) if devices.is_dir() else []
    if name not in have:
        raise ConfigError(
            f"--disagg-ib-device {name}: this host has no RDMA device of that name (ibv_devices lists "
            f"{', '.join(have) or 'none'}); name one of them, or omit the flag to move tensors over TCP"
        )


START_ATTEMPTS = 3
_PORT_TAKEN = "Address already in use"


def _start_engine(engine_cls: Any, hostname: str, protocol: str, ib_device: str | None) -> Any:
    """A started Mooncake engine; raises TransferError naming the flags to check.

    Mooncake's TCP transport picks its data port by binding a test socket in MC_MIN_RPC_PORT..
    MC_MAX_RPC_PORT, closes it, then binds its listener there: another process of the host can take
    the port in between (workers sharing a host's network, not a pod's), and initialize() raises
    "bind: Address already in use". A fresh engine picks another port, so that is tried again, up to
    START_ATTEMPTS engines. Mooncake cannot close the failed engine's handshake listener: it stays,
    idle, on this worker's address in the range (no peer is ever told its port).
    """
    nic = f" on --disagg-ib-device {ib_device}" if ib_device else ""
    where = f"Mooncake {protocol} engine failed to start{nic} at --disagg-p2p-hostname {hostname}"
    attempt = 1
    while True:
        engine = engine_cls()
        try:
            rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, ib_device or "")
        except RuntimeError as exc:
            if _PORT_TAKEN not in str(exc):
                raise TransferError(f"{where}: {exc}") from exc
            if attempt == START_ATTEMPTS:
                low, high = mooncake_port_range()
                raise TransferError(
                    f"{where}: another process took the port it chose, {START_ATTEMPTS} times ({exc}); free "
                    f"ports in {low}-{high} (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT) or widen that range"
                ) from exc
            log.warning("%s (%s, attempt %d of %d): starting another engine", where, exc, attempt, START_ATTEMPTS)
            attempt += 1
            continue
        if rc != 0:
            raise TransferError(
                f"{where} (return code {rc}); check that the address belongs to this host"
                + (" and the device name matches `ibv_devices`" if ib_device else "")
            )
        return engine


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
        # Whether outputs may be sent from their own memory (in_place.py): registering is a table entry
        # on TCP (~2 us), where RDMA pins the pages of every registration (there: the pool, one copy).
        self.sends_in_place = self.protocol == "tcp"
        self.ib_device = ib_device
        self._engine: Any = _start_engine(engine_cls, hostname, self.protocol, ib_device)
        self.session_id: str = f"{hostname}:{self._engine.get_rpc_port()}"
        self._regions: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._rates = WriteRates()  # when a write should end, from recent ones to the same peer

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

        Raises as `submit_write` and `PendingWrite.done` do.
        """
        self.submit_write(dest_session, local_addr, dest_addr, nbytes).wait()

    def submit_write(self, dest_session: str, local_addr: int, dest_addr: int, nbytes: int) -> PendingWrite:
        """Start copying `nbytes` from local registered memory to `dest_addr` in peer `dest_session`.

        Raises TransferError naming the peer and size if the engine cannot start the write, and
        before calling the engine if the local range is not registered. The local range must stay
        untouched until the returned write is done.
        """
        return self.submit_writes(dest_session, [(local_addr, dest_addr, nbytes)])

    def submit_writes(self, dest_session: str, ranges: list[tuple[int, int, int]]) -> PendingWrite:
        """Start writing each `(local_addr, dest_addr, nbytes)` range into peer `dest_session`, as one
        write (done when every range is): the pieces of one payload that are not one local range
        (outputs sent in place, in_place.py). Raises as `submit_write`.

        One engine batch per range: Mooncake's batch_transfer_async_write submits several ranges at
        once, but transfer_check_status reports its first task only, so that batch would read done
        while its other ranges are still being written (measured: a 7-byte range first, a 32 MiB one
        second, "done" with the second not landed)."""
        self._check_open()
        if any(nbytes < 0 for _, _, nbytes in ranges):
            raise ValueError(f"cannot write {[n for _, _, n in ranges]} bytes")
        started = time.perf_counter()  # the engine's submit is part of the write (tens of microseconds)
        total = sum(nbytes for _, _, nbytes in ranges)
        first = ranges[0][1] if ranges else 0
        what = f"Mooncake {self.protocol} write of {total} bytes to peer {dest_session} at 0x{first:x}"
        for local_addr, _, nbytes in ranges:
            if nbytes and not self._is_registered(local_addr, nbytes):
                raise TransferError(
                    f"local range 0x{local_addr:x}+{nbytes} is not inside memory registered with this transport; "
                    "stage the payload in the TransferPool first"
                )
        batches: list[int] = []
        for local_addr, dest_addr, nbytes in ranges:
            if not nbytes:
                continue
            batch = self._engine.transfer_submit_write(dest_session, local_addr, dest_addr, nbytes)
            if not batch and batches:
                # Ranges already under way still write: a stalled write, so that the head keeps the
                # peer's slot out of use and the caller keeps their memory.
                raise TransferStalled(
                    f"{what} could not start all its ranges, and {len(batches)} under way may still write; {_PEER_HINT}"
                )
            if not batch:
                raise TransferError(f"{what} could not start; {_PEER_HINT}")
            batches.append(batch)
        return PendingWrite(self._engine, batches, what, started, total, dest_session, self._rates)

    def unregister(self, ptr: int) -> None:
        """Forget memory registered at `ptr` (a range `register` took); peers can no longer address it."""
        with self._lock:
            if self._closed:
                return
            self._regions = [(start, size) for start, size in self._regions if start != ptr]
        self._engine.unregister_memory(ptr)

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


class PendingWrite:
    """A submitted Mooncake write: poll it with `done()`, or block on it with `wait()`.

    Used by one thread at a time. Mooncake forgets a batch once it has reported it done, so its
    status is read until then only.
    """

    def __init__(
        self,
        engine: Any,
        batches: list[int],
        what: str,
        started: float,
        nbytes: int = 0,
        peer: str = "",
        rates: WriteRates | None = None,
    ) -> None:
        self._engine = engine
        self._batches = list(batches)  # those not reported done yet
        self._what = what
        self._failure: str | None = None  # the first range that failed, while the others are polled to their end
        self._failed: TransferError | None = None  # raised: what every later call raises too
        self.started = started  # perf_counter() when the write was submitted
        self._nbytes, self._peer, self._rates = nbytes, peer, rates
        self._expected = rates.expected_s(peer, nbytes) if rates is not None else None

    def done(self) -> bool:
        """True once the bytes are in the peer's memory; False while the write is under way.

        Raises TransferError if the write failed, once every range has ended (a range that failed
        while others are under way: those are polled to their end first, so that the memory they read
        can then be freed), and TransferStalled (a TransferError) once it has been pending for
        WRITE_TIMEOUT_S: the engine may still write into the peer's range (and read the local one).
        """
        if self._failed is not None:
            raise self._failed
        while self._batches:
            status = self._engine.transfer_check_status(self._batches[0])
            if status == _PENDING:
                break
            if status != _DONE and self._failure is None:
                self._failure = f"{self._what} failed (status {status})"
            self._batches.pop(0)
        if not self._batches:
            if self._failure is not None:
                self._failed = TransferError(f"{self._failure}; {_PEER_HINT}")
                raise self._failed
            if self._rates is not None:
                self._rates.observe(self._peer, self._nbytes, self.elapsed())
                self._rates = None  # observed once
            return True
        if self.elapsed() > WRITE_TIMEOUT_S:
            if self._failure is not None:
                raise TransferStalled(
                    f"{self._failure}, and {len(self._batches)} more of its ranges did not end in "
                    f"{WRITE_TIMEOUT_S:g}s, which may still write; {_PEER_HINT}"
                )
            raise TransferStalled(
                f"{self._what} did not finish in {WRITE_TIMEOUT_S:g}s; the peer may be stalled or its network congested"
            )
        return False

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def expected_s(self) -> float | None:
        """How long this write should take, from recent writes to its peer (waiting.py); None: unknown."""
        return self._expected

    def poll_interval(self) -> float:
        """How long to leave the core before the next poll, given this write's age (0: poll again at once)."""
        return poll_interval(self.elapsed(), self._expected)

    def pause(self) -> None:
        """Sleep until the next poll (`poll_interval`), if it is not due at once."""
        if (interval := self.poll_interval()) > 0:
            time.sleep(interval)

    def wait(self) -> None:
        """Block until `done()`; raises as it does."""
        while not self.done():
            self.pause()


class NoTransport:
    """A full-pipeline worker's transport (--disagg-full-pipeline): it neither sends nor receives
    tensors (only pixels to the head, over ZMQ), so no Mooncake engine starts and no memory is registered."""

    session_id = ""  # heartbeats name no transfer session: the head never reserves a slot on it

    def submit_write(self, dest_session: str, local_addr: int, dest_addr: int, nbytes: int) -> PendingWrite:
        raise TransferError("a full-pipeline worker writes no tensors to other workers")

    def close(self) -> None:
        pass
