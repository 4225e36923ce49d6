"""triptych_dev.prefork, the preloaded interpreter the tests' local deployments fork their workers from:
a child is what `python -m <module> <args>` would be (output, exit status, signals, confined
listeners), and what it could not be is declined, to be started as an ordinary process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from triptych import __version__
from triptych.ports import MOONCAKE_PORT_RANGE
from triptych_dev.localdeploy import free_port_block
from triptych_dev.prefork import Launcher, PreforkedProcess
from triptych_worker.transfer.listeners import listening_sockets

pytestmark = pytest.mark.slow


@pytest.fixture
def launcher(preloaded_workers: Launcher | None) -> Launcher:
    if preloaded_workers is None:
        pytest.skip("TRIPTYCH_PREFORK=0: local deployments start ordinary processes")
    return preloaded_workers


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def spawn(launcher: Launcher, args: list[str], log: Path, environ: dict[str, str] | None = None) -> PreforkedProcess:
    child = launcher.spawn([sys.executable, "-m", "triptych", *args], log, environ or env())
    assert child is not None, launcher.declined
    return child


def test_a_child_prints_and_exits_as_the_ordinary_process_does(launcher: Launcher, tmp_path: Path):
    child = spawn(launcher, ["--version"], tmp_path / "version.log")
    assert child.wait(60) == 0
    assert (tmp_path / "version.log").read_text().strip() == f"triptych {__version__}"
    bad = spawn(launcher, ["serve", "--disagg-role", "nope"], tmp_path / "bad.log")
    ordinary = subprocess.run(
        [sys.executable, "-m", "triptych", "serve", "--disagg-role", "nope"], capture_output=True, text=True, timeout=60
    )
    assert bad.wait(60) == ordinary.returncode == 2
    assert (tmp_path / "bad.log").read_text() == ordinary.stderr


def test_a_forked_worker_runs_confined_to_loopback_and_dies_by_its_signal(
    launcher: Launcher, tiny_models: dict[str, Path], tmp_path: Path
):
    # A worker whose head never comes: it loads, starts Mooncake and waits.
    args = ["serve", "--model-path", str(tiny_models["tiny-flux"]), "--disagg-role", "decoder", "--device", "cpu",
            "--disagg-server-addr", "tcp://127.0.0.1:9", "--scheduler-port", str(free_port_block(1)),
            "--disagg-p2p-hostname", "127.0.0.1"]  # fmt: skip
    log = tmp_path / "decoder.log"
    child = spawn(launcher, args, log)
    try:
        deadline = time.monotonic() + 60
        while "TcpTransport: listen on port" not in (text := log.read_text(errors="replace") if log.exists() else ""):
            assert child.poll() is None, text
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        sockets = listening_sockets(child.pid)
        assert sockets and all(address == "127.0.0.1" for address, _ in sockets), sockets
        assert os.getsid(child.pid) == child.pid  # its own session, as start_new_session gives
        child.send_signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
        child.send_signal(signal.SIGKILL)  # an ended child is never signalled again (its pid may be reused)
    finally:
        child.kill()  # a failed assertion leaves no worker behind (it would wait for its head forever)


@pytest.mark.parametrize(
    "args, environ, reason",
    [
        (["serve", "--disagg-p2p-hostname", "192.0.2.7"], None, "--disagg-p2p-hostname 192.0.2.7"),
        (["serve", "--disagg-transfer-listen-any"], None, "--disagg-transfer-listen-any"),
        (
            ["serve"],
            {"TRIPTYCH_BIND_SHIM": "/nowhere.so"},
            "environment differs from the server's in TRIPTYCH_BIND_SHIM",
        ),
    ],
)
def test_what_a_child_could_not_be_is_declined(launcher: Launcher, tmp_path: Path, args, environ, reason):
    before = sum(launcher.declined.values())
    assert (
        launcher.spawn([sys.executable, "-m", "triptych", *args], tmp_path / "x.log", {**env(), **(environ or {})})
        is None
    )
    assert sum(launcher.declined.values()) == before + 1
    assert any(reason in why for why in launcher.declined), launcher.declined
    assert launcher.spawn([sys.executable, "-m", "json.tool"], tmp_path / "y.log", env()) is None
    assert any("only `python -m`" in why for why in launcher.declined), launcher.declined


def test_a_machine_with_a_cuda_device_gets_ordinary_processes(launcher: Launcher, tmp_path: Path, monkeypatch):
    # No GPU here: torch is told there is one (a stand-in for the device). A forked child could not use it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert launcher.spawn([sys.executable, "-m", "triptych", "serve"], tmp_path / "x.log", env()) is None
    assert any("a CUDA device is present" in why for why in launcher.declined), launcher.declined


def test_a_request_giving_what_the_server_set_itself_is_forked(launcher: Launcher, tmp_path: Path):
    # The tests' process sets these once it starts a worker in process or imports torch's compiler
    # (the prefork server set the same for itself): its later requests must still fork.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    same = {
        "MC_MIN_RPC_PORT": str(MOONCAKE_PORT_RANGE[0]),
        "MC_MAX_RPC_PORT": str(MOONCAKE_PORT_RANGE[1]),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir())),
    }
    forked = launcher.forked
    assert spawn(launcher, ["--version"], tmp_path / "same.log", {**env(), **same}).wait(60) == 0
    assert launcher.forked == forked + 1
    other = {**env(), **same, "MC_MIN_RPC_PORT": str(MOONCAKE_PORT_RANGE[0] + 1)}
    assert launcher.spawn([sys.executable, "-m", "triptych", "--version"], tmp_path / "other.log", other) is None
    assert any("differs from the server's in MC_MIN_RPC_PORT" in why for why in launcher.declined), launcher.declined


def test_a_client_gone_before_its_answer_leaves_the_server_serving(launcher: Launcher, tmp_path: Path):
    assert spawn(launcher, ["--version"], tmp_path / "first.log").wait(60) == 0  # the server is up
    for _ in range(3):  # a request whose client closes at once: its reply meets a closed socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
            gone.connect(str(launcher.socket_path))
            gone.sendall(b'{"argv": ["python", "-m", "json.tool"], "env": {}, "cwd": "/", "log": "/dev/null"}\n')
    time.sleep(0.5)
    forked = launcher.forked
    assert spawn(launcher, ["--version"], tmp_path / "after.log").wait(60) == 0
    assert launcher.forked == forked + 1  # forked by the same server, not started as an ordinary process
