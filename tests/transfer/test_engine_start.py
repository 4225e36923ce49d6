"""A Mooncake engine that loses its port to another process starts again on another one.

Mooncake's TCP transport binds a test socket to the port it picks, closes it, then binds its
listener there; on a host where many workers share one network (not a pod), another process can take
the port in between, and the engine fails to start ("bind: Address already in use"; seen once in a
CI run of bench/scaling_bench.py). `port_taken.c`, preloaded, makes exactly that bind fail (a fault
injected into the real engine: the race itself cannot be timed from a test).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.setup_check import missing

try:
    import mooncake.engine  # noqa: F401
except ImportError:
    missing(
        "Mooncake (mooncake.engine)", "`make setup` installs its wheel and Debian's libibverbs1, librdmacm1, libnuma1"
    )

FAULT = Path(__file__).with_name("port_taken.c")

# Starts a transport (the one whose port is taken), then a peer, and writes 1 MiB from one to the other.
SCRIPT = """
import json, sys
import numpy as np
from triptych_worker.transfer import MooncakeTransport, TransferError
try:
    first = MooncakeTransport("127.0.0.1")
except TransferError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
peer = MooncakeTransport("127.0.0.1")
src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20].copy()
dst = np.zeros(1 << 20, dtype=np.uint8)
first.register(src.ctypes.data, src.nbytes)
peer.register(dst.ctypes.data, dst.nbytes)
first.write(peer.session_id, src.ctypes.data, dst.ctypes.data, src.nbytes)
print(json.dumps({"session": first.session_id, "same": bool((src == dst).all())}))
"""


@pytest.fixture(scope="module")
def fault(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("gcc")
    assert cc, "gcc is missing: `make setup` installs it (it builds the worker's bind shim)"
    out = tmp_path_factory.mktemp("fault") / "libport_taken.so"
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(out), str(FAULT), "-ldl"], check=True)
    return out


def start(fault: Path, times: int) -> tuple[dict[str, object], str]:
    env = {**os.environ, "LD_PRELOAD": str(fault), "PORT_TAKEN_TIMES": str(times)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_an_engine_whose_port_was_taken_starts_on_another_and_moves_bytes(fault: Path) -> None:
    result, stderr = start(fault, times=1)
    assert result["same"] is True
    assert "Address already in use" in stderr  # the fault happened (Mooncake's error, as the warning quotes it)
    assert "attempt 1 of 3): starting another engine" in stderr


def test_a_port_taken_every_time_fails_with_what_to_do(fault: Path) -> None:
    result, stderr = start(fault, times=3)
    error = str(result["error"])
    assert "another process took the port it chose, 3 times" in error
    assert "--disagg-p2p-hostname 127.0.0.1" in error
    assert "MC_MIN_RPC_PORT..MC_MAX_RPC_PORT" in error
    assert stderr.count("starting another engine") == 2
