"""The bind shim (bind_shim.c) and the worker's use of it: real processes, real sockets, real Mooncake.

What it rewrites is read back with getsockname() in a process the shim is preloaded into; what a
worker listens on is read from /proc (listening_sockets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from triptych.ports import MOONCAKE_PORT_RANGE
from triptych_worker.transfer.listeners import ADDRESS_ENV, PORTS_ENV, SHIM_ENV, SHIM_NAME, listening_sockets

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 60.0

# Binds each (family, address, port) given on argv as JSON and prints where each socket ended up.
BINDER = """
import json, socket, sys
out = []
for family, address, port in json.loads(sys.argv[1]):
    s = socket.socket(getattr(socket, family), socket.SOCK_STREAM)
    try:
        s.bind((address, port))
        out.append(s.getsockname()[0])
    except OSError as exc:
        out.append(f"errno {exc.errno}")
    s.close()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    """The shim as `make setup` builds it (scripts/build-bind-shim.sh, into a fresh path)."""
    out = tmp_path_factory.mktemp("shim") / SHIM_NAME
    subprocess.run(["bash", str(ROOT / "scripts/build-bind-shim.sh"), str(out)], check=True, timeout=120)
    return out


def bind_under_shim(shim: Path, address: str, ports: str, binds: list[tuple[str, str, int]]) -> list[str]:
    env = {**os.environ, "LD_PRELOAD": str(shim), ADDRESS_ENV: address, PORTS_ENV: ports}
    out = subprocess.run(
        [sys.executable, "-c", BINDER, json.dumps(binds)], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


def test_wildcard_binds_in_the_range_go_to_the_ipv4_address(shim):
    """Port 0 is the range here, so the kernel picks free ports and nothing collides."""
    got = bind_under_shim(shim, "127.0.0.1", "0-0", [("AF_INET", "0.0.0.0", 0), ("AF_INET6", "::", 0)])
    assert got == ["127.0.0.1", "::ffff:127.0.0.1"]  # the dual-stack [::] becomes the IPv4-mapped address


def test_wildcard_binds_in_the_range_go_to_the_ipv6_address_and_ipv4_ones_fail(shim):
    got = bind_under_shim(shim, "::1", "0-0", [("AF_INET6", "::", 0), ("AF_INET", "0.0.0.0", 0)])
    assert got == ["::1", "errno 99"]  # EADDRNOTAVAIL: an IPv4 socket cannot listen on ::1, nor everywhere


def test_other_binds_are_left_alone(shim):
    """A port outside the range, a specific address, and everything when no address is configured."""
    binds = [("AF_INET", "0.0.0.0", 0), ("AF_INET6", "::", 0), ("AF_INET", "127.0.0.2", 0)]
    assert bind_under_shim(shim, "127.0.0.1", "1-65535", binds) == ["0.0.0.0", "::", "127.0.0.2"]
    assert bind_under_shim(shim, "", "0-0", binds) == ["0.0.0.0", "::", "127.0.0.2"]


def test_the_build_is_skipped_when_the_source_is_unchanged(shim):
    before = shim.stat().st_mtime_ns
    out = subprocess.run(
        ["bash", str(ROOT / "scripts/build-bind-shim.sh"), str(shim)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout == "" and shim.stat().st_mtime_ns == before


def worker_argv(model: Path, *flags: str, host: str = "127.0.0.1") -> list[str]:
    """A simulated encoder (a real worker process with its Mooncake engine, no torch); no head is needed
    for it to start listening."""
    return [sys.executable, "-m", "triptych", "serve", "--model-path", str(model), "--disagg-role", "encoder",
            "--simulate", "--disagg-server-addr", "tcp://127.0.0.1:9", "--scheduler-port", str(free_port()),
            "--disagg-transfer-pool-size", "4MiB", "--disagg-p2p-hostname", host, *flags]  # fmt: skip


def free_port() -> int:
    from triptych_dev.localdeploy import free_port_block

    return free_port_block(1)


@pytest.fixture
def worker(tiny_models, shim, tmp_path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(*flags: str, host: str = "127.0.0.1") -> subprocess.Popen[bytes]:
        env = {**os.environ, SHIM_ENV: str(shim)}
        with (tmp_path / f"worker-{len(procs)}.log").open("wb") as log:
            argv = worker_argv(tiny_models["tiny-flux"], *flags, host=host)
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(10)


def listeners_once_up(proc: subprocess.Popen[bytes]) -> set[tuple[str, int]]:
    """What `proc` listens on once its work socket and Mooncake's two listeners are up."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"worker exited with {proc.returncode} (its log is in the test's tmp_path)"
        sockets = listening_sockets(proc.pid)
        if len(sockets) == 3:
            return sockets
        time.sleep(0.2)
    raise TimeoutError(f"worker listens on {sockets} after {WAIT_S}s")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_worker_reexecutes_itself_under_the_shim_and_listens_on_its_address_only(worker, shim, host):
    """IPv6 too: the worker also has Mooncake open IPv6 sockets (MC_USE_IPV6), which the shim confines."""
    proc = worker(host=host)
    sockets = listeners_once_up(proc)
    assert {address for address, _ in sockets} == {host}, sockets
    assert str(shim) in Path(f"/proc/{proc.pid}/maps").read_text()  # the same pid, now under the shim
    low, high = MOONCAKE_PORT_RANGE
    assert sum(low <= port <= high for _, port in sockets) == 2, sockets


def test_a_worker_given_listen_any_leaves_mooncake_on_every_address(worker):
    sockets = listeners_once_up(worker("--disagg-transfer-listen-any"))
    assert {"0.0.0.0", "::"} <= {address for address, _ in sockets}, sockets


def test_a_worker_without_its_shim_refuses_to_start_and_says_what_to_do(tiny_models, tmp_path):
    missing = tmp_path / SHIM_NAME
    env = {**os.environ, SHIM_ENV: str(missing)}
    out = subprocess.run(worker_argv(tiny_models["tiny-flux"]), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    message = out.stderr.strip().splitlines()[-1]
    assert message.startswith("triptych: error: Mooncake would listen on every address"), out.stderr
    assert str(missing) in message and "make setup" in message and "--disagg-transfer-listen-any" in message


# Runs `triptych serve` with os.execve replaced: prints what the first image had imported when it
# re-executed, and the start-up time it handed to the new image, instead of re-executing.
AT_REEXEC = """
import json, os, sys
from triptych.startup import REEXEC_ENV
def execve(path, argv, env):
    print(json.dumps({"modules": sorted(sys.modules), "argv": argv, "reexec": env[REEXEC_ENV]}), flush=True)
    os._exit(0)
os.execve = execve
from triptych.cli import main
main(sys.argv[1:])
"""


def test_a_worker_reexecutes_under_the_shim_before_its_own_imports(tiny_models, shim):
    """The first image of a worker process is thrown away: it imports only what deciding to re-execute needs."""
    argv = worker_argv(tiny_models["tiny-flux"])
    out = subprocess.run(
        [sys.executable, "-c", AT_REEXEC, *argv[3:]],  # argv[3:]: after `python -m triptych`
        env={**os.environ, SHIM_ENV: str(shim)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    first_image = json.loads(out.stdout)
    assert first_image["argv"][-len(argv) + 3 :] == argv[3:]
    assert float(first_image["reexec"]) > 0
    imported = set(first_image["modules"])
    assert "triptych_worker.transfer.listeners" in imported
    too_early = imported & {"triptych_worker.runtime", "torch", "diffusers", "zmq"}
    assert not too_early, f"imported before re-executing (done again after): {sorted(too_early)}"


@pytest.mark.parametrize(("low", "high"), [(43800, 43999), (900, 2000), (17000, 15000), (16000, 70000)])
def test_a_port_range_mooncake_would_refuse_is_refused_naming_it(monkeypatch, low, high):
    """Mooncake falls back to its default range, without a word, on a range it refuses (ephemeral
    ports included): the shim and the listener check would then look where it does not listen."""
    from triptych.config import ConfigError
    from triptych_worker.transfer.listeners import mooncake_port_range

    monkeypatch.setenv("MC_MIN_RPC_PORT", str(low))
    monkeypatch.setenv("MC_MAX_RPC_PORT", str(high))
    with pytest.raises(ConfigError, match=rf"MC_MIN_RPC_PORT '{low}' / MC_MAX_RPC_PORT '{high}': Mooncake refuses"):
        mooncake_port_range()
    monkeypatch.setenv("MC_MIN_RPC_PORT", "20000")
    monkeypatch.setenv("MC_MAX_RPC_PORT", "20100")
    assert mooncake_port_range() == (20000, 20100)
