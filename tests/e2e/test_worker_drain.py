"""SIGTERM drains a real worker process: held work is finished and pushed, then it exits 0.

The head side is scripted here over real ZMQ sockets (the worker's work socket and the head's
denoiser result port), and the receiver of the push is a real Mooncake transport and pool in
this process, so the test fixes exactly when the head acknowledges the drain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from triptych.params import GenerationParams
from triptych.protocol import Heartbeat, Ping, TransferPush, TransferPushed, TransferStaged, Work, decode, encode
from triptych_dev.localdeploy import free_port_block
from triptych_worker.transfer import MooncakeTransport, TransferPool

pytestmark = pytest.mark.slow

HEAD_ID = "scripted-head"
INSTANCE = "w"
STAGE_SECONDS = 3.0  # long enough that "at once" and "once the running job is done" differ by seconds
DRAIN_TIMEOUT_S = 30.0
# A drained worker exits within a second or so of its last duty (a few on a loaded machine); one that
# missed the end of its drain would run on until DRAIN_TIMEOUT_S. A third of that tells them apart.
EXIT_BOUND_S = DRAIN_TIMEOUT_S / 3


class ScriptedHead:
    """The head's two ends of a denoiser's conversation, plus a ping every PING_S like the real head."""

    PING_S = 0.5

    def __init__(self, base: int, worker_port: int):
        ctx = zmq.Context.instance()
        self.results = ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.bind(f"tcp://127.0.0.1:{base + 2}")  # the denoiser result port of a head at `base`
        self.work = ctx.socket(zmq.PUSH)
        self.work.setsockopt(zmq.LINGER, 0)
        self.work.connect(f"tcp://127.0.0.1:{worker_port}")
        self.acknowledge = False  # send drain_acknowledged (a head does once it has seen a draining heartbeat)
        self.draining_seen_at: float | None = None
        self._next_ping = 0.0

    def send(self, msg: Any) -> None:
        self.work.send_multipart(encode(msg))

    def wait_for(self, kind: type, timeout: float, process: subprocess.Popen[bytes]) -> Any:
        """The next message of `kind`, pinging meanwhile; fails if the worker exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if time.monotonic() >= self._next_ping:
                self._next_ping = time.monotonic() + self.PING_S
                self.send(Ping(INSTANCE, HEAD_ID, drain_acknowledged=self.acknowledge))
            if self.results.poll(50):
                msg, _ = decode(self.results.recv_multipart())
                if isinstance(msg, Heartbeat) and msg.draining and self.draining_seen_at is None:
                    self.draining_seen_at = time.monotonic()
                if isinstance(msg, kind):
                    return msg
            assert process.poll() is None, f"the worker exited with {process.returncode} while {kind.__name__} was due"
        raise AssertionError(f"no {kind.__name__} within {timeout}s")

    def wait_for_exit(self, process: subprocess.Popen[bytes], timeout: float) -> float:
        """Keep pinging (as the head does) until the worker exits; returns when it did."""
        deadline = time.monotonic() + timeout
        while process.poll() is None:
            assert time.monotonic() < deadline, f"the worker did not exit within {timeout}s"
            try:
                self.wait_for(type(None), 0.05, process)
            except AssertionError:
                pass
        return time.monotonic()

    def close(self) -> None:
        self.results.close()
        self.work.close()


@pytest.fixture
def denoiser(tiny_models, tmp_path: Path):
    """A simulated denoiser process (STAGE_SECONDS per request) and the scripted head it reports to."""
    base = free_port_block(8)
    log = tmp_path / "denoiser.log"
    argv = [sys.executable, "-m", "triptych", "serve", "--model-path", str(tiny_models["tiny-flux"]),
            "--disagg-role", "denoiser", "--disagg-server-addr", f"tcp://127.0.0.1:{base}",
            "--scheduler-port", str(base + 6), "--disagg-p2p-hostname", "127.0.0.1",
            "--disagg-transfer-pool-size", "4MiB", "--disagg-drain-timeout", str(DRAIN_TIMEOUT_S),
            "--simulate", "--simulate-seconds", str(STAGE_SECONDS), "--simulate-seconds-per-unit", "0"]  # fmt: skip
    head = ScriptedHead(base, base + 6)
    with log.open("wb") as out:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        head.wait_for(Heartbeat, 60, process)  # answers pings: it is up
        yield process, head, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        head.close()


def test_sigterm_while_busy_finishes_and_pushes_held_work_then_exits_0(denoiser) -> None:
    process, head, log = denoiser
    peer = MooncakeTransport("127.0.0.1")  # the decoder the outputs go to
    pool = TransferPool(1 << 20, "decoder", peer, memory="numpy")
    params = GenerationParams("x", width=64, height=64, num_inference_steps=2)
    try:
        head.send(Work("r1", INSTANCE, params))
        time.sleep(0.2)  # r1 is running
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        head.send(Work("r2", INSTANCE, params))  # raced the draining heartbeat: still run
        head.wait_for(Heartbeat, 5, process)
        while head.draining_seen_at is None:
            head.wait_for(Heartbeat, 2, process)
        seen = head.draining_seen_at - signalled
        # At once (the worker polls every 0.1 s), not once r1 is done (STAGE_SECONDS - 0.2 s from now).
        assert seen < STAGE_SECONDS / 2, f"the draining heartbeat came {seen:.1f}s after SIGTERM"
        head.acknowledge = True  # from now on every ping acknowledges the drain

        for rid in ("r1", "r2"):
            staged = head.wait_for(TransferStaged, 10, process)
            assert staged.request_id == rid
            slot = pool.allocate(staged.nbytes, rid)
            assert slot is not None
            pool.view(slot)[:] = 0xFF
            head.send(TransferPush(rid, INSTANCE, dest_session=peer.session_id, dest_addr=slot.addr))
            pushed = head.wait_for(TransferPushed, 10, process)
            assert (pushed.request_id, pushed.nbytes) == (rid, staged.nbytes)
            assert not pool.view(slot).any(), f"{rid}'s latents (zeros) are in the receiver's slot"
        last_push = time.monotonic()

        exited = head.wait_for_exit(process, EXIT_BOUND_S)
        assert process.returncode == 0, log.read_text()[-3000:]
        assert exited - last_push < EXIT_BOUND_S, f"exited {exited - last_push:.1f}s after its last push"
        text = log.read_text()
        assert "draining: 2 jobs left" in text and "drained in" in text, text[-3000:]
    finally:
        peer.close()


def test_sigterm_while_idle_exits_0_soon_after_the_acknowledgement(denoiser) -> None:
    process, head, log = denoiser
    process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    while head.draining_seen_at is None:
        head.wait_for(Heartbeat, 3, process)
    head.acknowledge = True
    exited = head.wait_for_exit(process, EXIT_BOUND_S)
    assert process.returncode == 0, log.read_text()[-3000:]
    assert exited - signalled < EXIT_BOUND_S, f"exited {exited - signalled:.1f}s after SIGTERM"
    assert "the head acknowledged and nothing is held" in log.read_text()
