"""Real Mooncake TCP transfers: this process sends, a separate receiver process owns the slot."""

from __future__ import annotations

import hashlib
import json
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from tests.setup_check import missing
from triptych_worker.transfer import (
    MooncakeNotInstalled,
    MooncakeTransport,
    TransferError,
    TransferPool,
    TransferStalled,
    stage_tensors,
)

try:
    import mooncake.engine  # noqa: F401
except ImportError:
    missing(
        "Mooncake (mooncake.engine)", "`make setup` installs its wheel and Debian's libibverbs1, librdmacm1, libnuma1"
    )

MIB = 1024 * 1024
RECEIVER = Path(__file__).with_name("mooncake_receiver.py")
REPLY_TIMEOUT_S = 30.0


class Receiver:
    """The receiver process, with a bounded wait on each JSON line it prints."""

    def __init__(self, pool_bytes: int, slot_bytes: int) -> None:
        self._stderr: IO[str] = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(RECEIVER), str(pool_bytes), str(slot_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def read(self) -> Any:
        try:
            return json.loads(self._lines.get(timeout=REPLY_TIMEOUT_S))
        except queue.Empty:
            self._stderr.seek(0)
            log = self._stderr.read()[-3000:]
            raise AssertionError(f"receiver sent nothing in {REPLY_TIMEOUT_S}s; stderr:\n{log}") from None

    def send(self, message: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=REPLY_TIMEOUT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=5)
            self._stderr.close()


# Engines are shared per module: tearing one down takes Mooncake about a second.
@pytest.fixture(scope="module")
def transport() -> Iterator[MooncakeTransport]:
    with MooncakeTransport("127.0.0.1", None) as t:
        yield t


@pytest.fixture(scope="module")
def pool(transport: MooncakeTransport) -> TransferPool:
    return TransferPool(8 * MIB, "encoder", transport)


@pytest.fixture
def sender(transport: MooncakeTransport, pool: TransferPool) -> Iterator[tuple[MooncakeTransport, TransferPool]]:
    yield transport, pool
    pool.free_owner("req-1")


@pytest.fixture(scope="module")
def peer() -> Iterator[tuple[MooncakeTransport, TransferPool]]:
    with MooncakeTransport("127.0.0.1", None) as t:
        yield t, TransferPool(MIB, "denoiser", t)


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def test_session_id_is_host_and_rpc_port(transport: MooncakeTransport) -> None:
    host, port = transport.session_id.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert transport.protocol == "tcp"


def test_tensors_written_to_another_process_arrive_bit_exact(sender: tuple[MooncakeTransport, TransferPool]) -> None:
    transport, pool = sender
    g = torch.Generator().manual_seed(0)
    tensors = {
        "prompt_embeds": torch.randn(1, 77, 4096, generator=g).to(torch.bfloat16),
        "pooled": torch.randn(1, 768, generator=g).t(),  # non-contiguous
        "latents": torch.randint(0, 256, (1, 4096, 64 * 4), dtype=torch.uint8, generator=g).view(torch.float32),
        "text_ids": torch.arange(77 * 3, dtype=torch.int64).reshape(77, 3),
        "mask": torch.rand(77, generator=g) > 0.5,
        "empty": torch.empty(0, 16),
    }
    staged = stage_tensors(pool, tensors, "req-1")
    assert staged is not None
    receiver = Receiver(pool_bytes=8 * MIB, slot_bytes=staged.nbytes)
    try:
        hello = receiver.read()
        assert hello["slot_nbytes"] >= staged.nbytes
        transport.write(hello["session"], staged.allocation.addr, hello["slot_addr"], staged.nbytes)
        pool.free(staged.allocation)
        receiver.send(staged.manifest)
        report = receiver.read()
    finally:
        assert receiver.close() == 0
    expected = {
        name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": sha256(t)}
        for name, t in tensors.items()
    }
    assert report == expected


def test_write_to_an_unreachable_session_raises_transfer_error(sender: tuple[MooncakeTransport, TransferPool]) -> None:
    transport, pool = sender
    with pytest.raises(TransferError, match=r"1024 bytes to peer 127\.0\.0\.1:1 .*(could not start|failed)"):
        transport.write("127.0.0.1:1", pool.base_addr, 0x10000, 1024)


def test_write_outside_the_peer_pool_raises_and_the_engine_keeps_working(
    sender: tuple[MooncakeTransport, TransferPool], peer: tuple[MooncakeTransport, TransferPool]
) -> None:
    transport, pool = sender
    peer_transport, peer_pool = peer
    src = pool.allocate(4096, "req-1")
    assert src is not None
    pool.view(src).fill_(0xAB)
    with pytest.raises(TransferError, match=r"could not start|failed \(status"):
        transport.write(peer_transport.session_id, src.addr, peer_pool.base_addr + MIB - 100, 4096)
    # Polled instead of waited on, the write fails the same way, and stays failed.
    pending = transport.submit_write(peer_transport.session_id, src.addr, peer_pool.base_addr + MIB - 100, 4096)
    with pytest.raises(TransferError, match=r"failed \(status"):
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not pending.done():
            assert time.monotonic() < deadline, "the write never ended"
            pending.pause()
    with pytest.raises(TransferError, match=r"failed \(status"):
        pending.done()
    transport.write(peer_transport.session_id, src.addr, peer_pool.base_addr, 4096)
    assert bool((peer_pool.buffer[:4096] == 0xAB).all())


def test_write_from_unregistered_local_memory_is_refused_before_the_engine(transport: MooncakeTransport) -> None:
    stray = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(TransferError, match="not inside memory registered"):
        transport.write(transport.session_id, stray.data_ptr(), 0, 4096)


def test_closed_transport_refuses_writes() -> None:
    transport = MooncakeTransport("127.0.0.1", None)
    transport.close()
    transport.close()
    with pytest.raises(TransferError, match="closed"):
        transport.write("127.0.0.1:1", 0, 0, 1)


def test_missing_mooncake_names_both_wheels_and_the_system_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(MooncakeNotInstalled) as info:
        MooncakeTransport("127.0.0.1", None)
    message = str(info.value)
    for needle in ("pip install mooncake-transfer-engine`", "mooncake-transfer-engine-non-cuda", "libibverbs1"):
        assert needle in message


def test_a_write_to_a_stalled_peer_times_out_as_stalled(
    transport: MooncakeTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that stops reading (SIGSTOP) leaves the write pending: it ends as TransferStalled."""
    from triptych_worker.transfer import TransferStalled, engine

    big = TransferPool(64 * MIB, "encoder", transport)
    receiver = Receiver(pool_bytes=64 * MIB, slot_bytes=64 * MIB)
    try:
        hello = receiver.read()
        src = big.allocate(64 * MIB, "req-big")
        assert src is not None
        transport.write(hello["session"], src.addr, hello["slot_addr"], 4096)  # connected while it answers
        receiver.proc.send_signal(signal.SIGSTOP)
        monkeypatch.setattr(engine, "WRITE_TIMEOUT_S", 1.0)
        started = time.monotonic()
        with pytest.raises(TransferStalled, match=r"did not finish in 1s"):
            transport.write(hello["session"], src.addr, hello["slot_addr"], 64 * MIB)
        took = time.monotonic() - started
        # Given up at the 1 s timeout set above; without it the write would wait the default 120 s.
        assert took < 10, f"the stalled write was given up after {took:.1f}s"
    finally:
        receiver.proc.send_signal(signal.SIGCONT)
        receiver.send(None)
        assert receiver.close() == 0


def test_a_submitted_write_returns_at_once_and_lands_once_polled_done() -> None:
    """submit_write does not wait for the peer (here SIGSTOPped); done() turns True once it resumes."""
    with MooncakeTransport("127.0.0.1", None) as transport:  # its own: the module's has a 64 MiB pool already
        _submit_and_poll(transport)


def _submit_and_poll(transport: MooncakeTransport) -> None:
    big = TransferPool(64 * MIB, "encoder", transport)
    payload = {
        "latents": torch.randint(0, 256, (32 * MIB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    }
    staged = stage_tensors(big, payload, "req-submit")
    assert staged is not None
    receiver = Receiver(pool_bytes=64 * MIB, slot_bytes=staged.nbytes)
    try:
        hello = receiver.read()
        transport.write(hello["session"], staged.allocation.addr, hello["slot_addr"], 4096)  # connect first
        receiver.proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        pending = transport.submit_write(hello["session"], staged.allocation.addr, hello["slot_addr"], staged.nbytes)
        # submit returns without waiting for the transfer, which to a stopped peer never ends: any
        # bound well under the test's own timeout tells the two apart, on a loaded machine too.
        took = time.monotonic() - started
        assert took < 5.0, f"submit_write took {took:.1f}s to return"
        assert not pending.done(), "32 MiB cannot have reached a stopped peer"
        receiver.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not pending.done():
            assert time.monotonic() < deadline, "the write never finished after the peer resumed"
            pending.pause()
        assert pending.done(), "a finished write stays done (Mooncake forgets the batch once it reported it)"
        receiver.send(staged.manifest)
        report = receiver.read()
    finally:
        receiver.proc.send_signal(signal.SIGCONT)
        big.free(staged.allocation)
        receiver.close()
    assert report["latents"]["sha256"] == sha256(payload["latents"])


class _OneRangeRefused:
    """The real engine, but its `refuse`-th write submission is refused (returns no batch) or, with
    `fail_status`, its first batch reads failed: a peer's refusal of one range of several, which a
    loopback peer cannot be made to give at will. Everything else is the engine's own."""

    def __init__(
        self, engine: Any, refuse: int | None = None, fail_first: bool = False, last_ends: bool = False
    ) -> None:
        self._engine, self._refuse, self._fail_first, self._last_ends = engine, refuse, fail_first, last_ends
        self.submitted: list[int] = []

    def transfer_submit_write(self, *args: Any) -> int:
        if len(self.submitted) + 1 == self._refuse:
            return 0
        batch = int(self._engine.transfer_submit_write(*args))
        self.submitted.append(batch)
        return batch

    def transfer_check_status(self, batch: int) -> int:
        if self._fail_first and batch == self.submitted[0]:
            return -1  # failed
        if batch == self.submitted[-1] and not self._last_ends:
            return 0  # the last range still under way
        return int(self._engine.transfer_check_status(batch))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@pytest.mark.parametrize("how", ["second range refused", "first range failed, second under way"])
def test_a_write_of_several_ranges_whose_range_fails_while_another_may_write_is_a_stalled_write(
    how: str,
    sender: tuple[MooncakeTransport, TransferPool],
    peer: tuple[MooncakeTransport, TransferPool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A range under way still writes into the peer (and reads the local bytes) after another range of
    the same write failed: the write is reported stalled (TransferStalled) once it has not ended in
    WRITE_TIMEOUT_S (or at once where it could not be submitted), so the worker keeps its tensors and
    the head keeps the receiver's slot out of use, rather than failed and forgotten."""
    from triptych_worker.transfer import engine as engine_module

    transport, pool = sender
    peer_transport, peer_pool = peer
    src = pool.allocate(8192, "req-1")
    assert src is not None
    engine = _OneRangeRefused(transport.engine, refuse=2) if how.startswith("second") else None
    engine = engine or _OneRangeRefused(transport.engine, fail_first=True)
    monkeypatch.setattr(transport, "_engine", engine)
    monkeypatch.setattr(engine_module, "WRITE_TIMEOUT_S", 0.2)
    ranges = [(src.addr, peer_pool.base_addr, 4096), (src.addr + 4096, peer_pool.base_addr + 4096, 4096)]
    with pytest.raises(TransferStalled, match="may still write") as stalled:
        transport.submit_writes(peer_transport.session_id, ranges).wait()
    assert len(engine.submitted) == 1 if how.startswith("second") else len(engine.submitted) == 2
    assert "127.0.0.1" in str(stalled.value)


def test_a_write_of_several_ranges_whose_range_failed_fails_once_the_others_have_ended(
    sender: tuple[MooncakeTransport, TransferPool],
    peer: tuple[MooncakeTransport, TransferPool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once every range has ended, nothing reads the local bytes any more: a failed range makes the write
    failed, not stalled, so the worker frees its outputs (a receiver gone under autoscaling used to leave
    every push to it held for the worker's life)."""
    transport, pool = sender
    peer_transport, peer_pool = peer
    src = pool.allocate(8192, "req-1")
    assert src is not None
    monkeypatch.setattr(transport, "_engine", _OneRangeRefused(transport.engine, fail_first=True, last_ends=True))
    ranges = [(src.addr, peer_pool.base_addr, 4096), (src.addr + 4096, peer_pool.base_addr + 4096, 4096)]
    with pytest.raises(TransferError, match=r"failed \(status -1\)") as failed:
        transport.submit_writes(peer_transport.session_id, ranges).wait()
    assert not isinstance(failed.value, TransferStalled)


def test_a_write_of_one_range_that_fails_is_failed_not_stalled(
    sender: tuple[MooncakeTransport, TransferPool],
    peer: tuple[MooncakeTransport, TransferPool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transport, pool = sender
    peer_transport, peer_pool = peer
    src = pool.allocate(4096, "req-1")
    assert src is not None
    monkeypatch.setattr(transport, "_engine", _OneRangeRefused(transport.engine, refuse=1))
    with pytest.raises(TransferError, match="could not start") as refused:
        transport.submit_writes(peer_transport.session_id, [(src.addr, peer_pool.base_addr, 4096)])
    assert not isinstance(refused.value, TransferStalled)
