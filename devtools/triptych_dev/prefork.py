"""Start local `python -m triptych serve ...` workers from an interpreter that has imported torch already.

A worker spends ~5 s of CPU importing torch, diffusers and transformers before it does anything,
and a test suite on a 2-core machine starts hundreds of them. A prefork server imports them once
and then forks one child per request; from the fork on, the child is what `python -m <module>
<args>` would be: its own session, argv, environment, working directory and log, the same code
from `main` on. Only for deployments on one machine (the tests' local deployments): production
workers, and every process of the images, are ordinary processes.

The server runs under the worker's bind shim (triptych_worker.transfer.listeners), set up for
127.0.0.1 and Mooncake's port range, as a re-executed worker on loopback would; a request whose
process would need anything else (another address, `--disagg-transfer-listen-any`, an environment
that differs from the server's) is declined, and the caller starts an ordinary process.

`ps` lists a child under the server's command line (`python -m triptych_dev.prefork SOCKET`): its
pid (Proc.popen.pid) and its log say which worker it is.

Protocol: a Unix stream socket in a private directory, one connection per child, JSON lines (no
pickle, and only the modules in MODULES run):
    client -> {"argv": [python, "-m", module, *args], "env": {...}, "cwd": "...", "log": "..."}
    server -> {"pid": N} or {"declined": "why"}; when the child has exited, {"returncode": N}
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from triptych.config import flag
from triptych.ports import MOONCAKE_PORT_RANGE

MODULES = ("triptych", "triptych_dev.null_pipeline")  # what a child may run
# Imported once by the server: the worker's own modules, and the classes the tiny models load.
PRELOAD = (
    "torch",
    "triptych_worker.runtime",
    "triptych_worker.pipeline",
    "triptych_worker.adapters.flux",
    "triptych_worker.adapters.wan",
    "triptych_worker.parallel.ranks",
)
PRELOAD_CLASSES = {
    "diffusers": (
        "FluxPipeline",
        "FluxKontextPipeline",
        "WanPipeline",
        "AutoencoderKL",
        "AutoencoderKLWan",
        "FluxTransformer2DModel",
        "WanTransformer3DModel",
        "FlowMatchEulerDiscreteScheduler",
        "UniPCMultistepScheduler",
    ),
    "transformers": ("CLIPTextModel", "CLIPTokenizer", "T5EncoderModel", "T5TokenizerFast", "UMT5EncoderModel"),
}
# Set by the launcher for the server only: the shim's settings, which every child inherits.
ADDED_ENV = "TRIPTYCH_PREFORK_ADDED"
# May differ between the server's environment and a request's.
FREE_ENV = ("PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST")
ADDRESS = "127.0.0.1"
ORPHAN_RETURNCODE = -255  # a child that ended after the server had gone: its status is lost
OPT_OUT_FLAG = flag("disagg_transfer_listen_any")
HOSTNAME_FLAG = flag("disagg_p2p_hostname")


class Declined(Exception):
    """The request needs an ordinary process."""


# ---------------------------------------------------------------- the client (the tests' process)


class PreforkedProcess:
    """A forked child, as much of subprocess.Popen as local deployments use (pid, poll, wait, signals).

    Its exit status comes from the server (its parent); signals go through a pidfd, so a pid that was
    reused after the child ended is never signalled.
    """

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # ended already: its status is on its way
            self._pidfd = None

    def _read(self, timeout: float | None) -> None:
        if self._conn.fileno() < 0:  # the server went away: the pidfd tells when the child ends
            if self._pidfd is None or select.select([self._pidfd], [], [], timeout)[0]:
                self._ended(ORPHAN_RETURNCODE)
            return
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return
        try:
            chunk = self._conn.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:
            self._conn.close()
            return
        self._buffer += chunk
        if b"\n" in self._buffer:
            line = self._buffer.split(b"\n", 1)[0]
            self._ended(int(json.loads(line)["returncode"]))

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
        self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read(left if left is None else min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """Starts the prefork server on first use (in `workdir`) and asks it for processes; thread-safe."""

    def __init__(self, workdir: Path, ready_timeout: float = 120) -> None:
        self.workdir = workdir
        self.socket_path = workdir / "prefork.sock"
        self.ready_timeout = ready_timeout
        self._server: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._broken: str | None = None
        self.forked = 0
        self.declined: dict[str, int] = {}

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._server is not None and self._server.poll() is None:
            self._server.terminate()
            try:
                self._server.wait(10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait(10)

    def spawn(self, argv: Sequence[str], log: Path, env: Mapping[str, str]) -> PreforkedProcess | None:
        """A forked child running `argv`, or None when it needs an ordinary process (reason in `declined`)."""
        try:
            _check_no_cuda()
            _check_worker_argv(argv)
            self._ensure_server()
            return self._request(argv, log, env)
        except Declined as exc:
            reason = str(exc)
            self.declined[reason] = self.declined.get(reason, 0) + 1
            return None

    def _ensure_server(self) -> None:
        with self._lock:
            if self._broken:
                raise Declined(self._broken)
            if self._server is None:
                self._start_server()
            deadline = time.monotonic() + self.ready_timeout
            while not self.socket_path.exists():
                if self._server is not None and self._server.poll() is not None:
                    self._broken = f"the prefork server exited ({self._server.returncode}); see {self._log}"
                    raise Declined(self._broken)
                if time.monotonic() > deadline:
                    self._broken = f"the prefork server was not ready in {self.ready_timeout:.0f} s; see {self._log}"
                    raise Declined(self._broken)
                time.sleep(0.05)

    @property
    def _log(self) -> Path:
        return self.workdir / "prefork.log"

    def _start_server(self) -> None:
        from triptych_worker.transfer.listeners import bind_shim_path, shim_environment

        shim = bind_shim_path().resolve()
        if not shim.is_file():
            self._broken = f"no bind shim at {shim}"
            raise Declined(self._broken)
        low = os.environ.get("MC_MIN_RPC_PORT") or str(MOONCAKE_PORT_RANGE[0])
        high = os.environ.get("MC_MAX_RPC_PORT") or str(MOONCAKE_PORT_RANGE[1])
        added = {**shim_environment(shim, ADDRESS, f"{low}-{high}"), "MC_MIN_RPC_PORT": low, "MC_MAX_RPC_PORT": high}
        added = {k: v for k, v in added.items() if os.environ.get(k) != v}
        env = {**os.environ, **added, ADDED_ENV: ",".join(added), "PYTHONUNBUFFERED": "1"}
        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._log.open("wb") as out:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "triptych_dev.prefork", str(self.socket_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def _request(self, argv: Sequence[str], log: Path, env: Mapping[str, str]) -> PreforkedProcess:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(self.socket_path))
            request = {"argv": list(argv), "env": dict(env), "cwd": os.getcwd(), "log": str(log)}
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(_read_line(conn, timeout=60))
        except (OSError, ValueError) as exc:
            conn.close()
            raise Declined(f"the prefork server did not answer: {exc}") from None
        if "declined" in reply:
            conn.close()
            raise Declined(reply["declined"])
        self.forked += 1
        return PreforkedProcess(conn, int(reply["pid"]), argv)


def _check_no_cuda() -> None:
    """Decline on a machine with a CUDA device: the server's preload imports diffusers, which asks torch
    whether CUDA is there, and a child forked after that cannot initialise CUDA ("Cannot re-initialize
    CUDA in forked subprocess"), whatever its --device; an ordinary process can."""
    import torch

    if torch.cuda.is_available():
        raise Declined("a CUDA device is present (a child forked from the preloaded server cannot initialise CUDA)")


def _check_worker_argv(argv: Sequence[str]) -> None:
    """Decline what a child of the server could not be: a process on another address than the shim's."""
    args = list(argv)
    if OPT_OUT_FLAG in args or any(a.startswith(OPT_OUT_FLAG + "=") for a in args):
        raise Declined(f"{OPT_OUT_FLAG} (the server's shim confines Mooncake to {ADDRESS})")
    for i, arg in enumerate(args):
        value = None
        if arg == HOSTNAME_FLAG and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(HOSTNAME_FLAG + "="):
            value = arg.split("=", 1)[1]
        if value is not None and value != ADDRESS:
            raise Declined(f"{HOSTNAME_FLAG} {value} (the server's shim confines Mooncake to {ADDRESS})")


def _read_line(conn: socket.socket, timeout: float) -> bytes:
    conn.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            raise OSError("connection closed")
        data += chunk
    conn.settimeout(None)
    return data


# ---------------------------------------------------------------- the server


class _BecomeChild(BaseException):
    """Raised in a freshly forked child to leave the server's loop (its sockets close on the way)."""

    def __init__(self, module: str, argv: list[str]) -> None:
        self.module, self.argv = module, argv


def _preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    for package, classes in PRELOAD_CLASSES.items():
        module = importlib.import_module(package)
        for cls in classes:
            with contextlib.suppress(AttributeError, ImportError):
                getattr(module, cls)


class _Server:
    def __init__(self, path: Path) -> None:
        self.path = path
        added = [k for k in os.environ.get(ADDED_ENV, "").split(",") if k]
        self.own_env = {k: os.environ[k] for k in added if k in os.environ}
        self.base_env = {k: v for k, v in os.environ.items() if k not in added and k != ADDED_ENV}
        self.children: dict[int, socket.socket] = {}
        self.parent = os.getppid()
        self.import_env: dict[str, str] = {}  # what importing PRELOAD set (TORCHINDUCTOR_CACHE_DIR, ...)

    def preload(self) -> None:
        before = dict(os.environ)
        _preload()
        self.import_env = {k: v for k, v in os.environ.items() if before.get(k) != v}

    def serve(self) -> None:
        wake_r, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)
        with wake_r, wake_w, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            tmp = self.path.with_suffix(".tmp")
            listener.bind(str(tmp))
            os.chmod(tmp, 0o600)
            listener.listen(64)
            tmp.rename(self.path)  # the launcher waits for the path: it appears once we accept
            print(f"prefork: serving on {self.path}", flush=True)
            while os.getppid() == self.parent:
                ready, _, _ = select.select([listener, wake_r], [], [], 1.0)
                if wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        wake_r.recv(4096)
                self._reap()
                if listener in ready:
                    conn, _ = listener.accept()
                    self._handle(conn, listener, wake_r, wake_w)

    def _handle(self, conn: socket.socket, *own: socket.socket) -> None:
        try:
            request = json.loads(_read_line(conn, timeout=10))
            module, args = self._check(request)
        except Declined as exc:
            _reply(conn, {"declined": str(exc)})
            conn.close()
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            _reply(conn, {"declined": f"bad request: {exc}"})
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for sock in (*own, *self.children.values()):
                sock.close()
            conn.close()
            self._become_child(request)
            raise _BecomeChild(module, [request["argv"][0], *args])
        self.children[pid] = conn
        _reply(conn, {"pid": pid})

    def _check(self, request: dict[str, Any]) -> tuple[str, list[str]]:
        argv = request["argv"]
        if not (isinstance(argv, list) and len(argv) >= 3 and all(isinstance(a, str) for a in argv)):
            raise Declined("argv must be [python, '-m', module, ...]")
        if argv[1] != "-m" or argv[2] not in MODULES:
            raise Declined(f"only `python -m` {', '.join(MODULES)} run here, not {argv[1:3]}")
        env = request["env"]
        if not isinstance(env, dict):
            raise Declined("env must be an object")
        differs = self._differs(env)
        if differs:
            raise Declined(f"its environment differs from the server's in {', '.join(differs[:5])}")
        return argv[2], argv[3:]

    def _differs(self, env: dict[str, Any]) -> list[str]:
        """The variables a request's environment gives otherwise than the server's. One the server set
        itself (the launcher's shim settings, what importing PRELOAD set) every child gets anyway: a
        request may leave it out or give the same value (the tests' process sets the same ones once
        it starts a worker or imports torch's compiler in process)."""
        own = {**self.import_env, **self.own_env}
        return sorted(
            k
            for k in {*env, *self.base_env} - set(FREE_ENV)
            if env.get(k) != self.base_env.get(k) and not (k in own and env.get(k) in (None, own[k]))
        )

    def _become_child(self, request: dict[str, Any]) -> None:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(devnull)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**request["env"], **self.import_env, **self.own_env})
        sys.orig_argv[:] = request["argv"]  # a re-exec (listeners.confine_mooncake_listeners) runs the same
        _fresh_random_state()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                _reply(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                conn.close()


def _reply(conn: socket.socket, message: dict[str, Any]) -> None:
    """Send one line; a client that has gone (a test process killed) must not take the server down."""
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(message).encode() + b"\n")


def _fresh_random_state() -> None:
    """What a new interpreter would start with: numpy's global generator from fresh entropy (Python's
    `random` reseeds itself after a fork), torch's default generator at its default seed."""
    import numpy as np
    import torch

    np.random.seed()
    torch.default_generator.set_state(torch.Generator().get_state())


def _run_child(module: str, argv: list[str]) -> None:
    import runpy

    sys.argv = argv
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        raise SystemExit("usage: python -m triptych_dev.prefork SOCKET")
    started = time.monotonic()
    server = _Server(Path(args[0]))
    server.preload()
    threads = len(os.listdir("/proc/self/task"))
    print(f"prefork: preloaded in {time.monotonic() - started:.1f} s ({threads} threads)", flush=True)
    try:
        server.serve()
    except _BecomeChild as child:
        _run_child(child.module, child.argv)


if __name__ == "__main__":
    main()
