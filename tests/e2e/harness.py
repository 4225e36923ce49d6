"""Start a real disaggregated deployment as local processes: head + workers on loopback."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from triptych.roles import Role

ROOT = Path(__file__).resolve().parents[2]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int) -> int:
    """A base port with n consecutive free ports (the head needs scheduler_port .. +5)."""
    for _ in range(200):
        base = random.randint(20000, 45000)
        if all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free port block on 127.0.0.1")


@dataclass
class Proc:
    role: Role
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Deployment:
    http: str
    scheduler_port: int
    procs: list[Proc] = field(default_factory=list)

    def workers(self, role: Role) -> list[Proc]:
        return [p for p in self.procs if p.role is role]

    def head(self) -> Proc:
        return next(p for p in self.procs if p.role is Role.SERVER)

    def client(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.http, timeout=timeout)

    def logs(self) -> str:
        return "\n".join(f"--- {p.role.value} {p.url}\n{p.tail()}" for p in self.procs)


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


@contextmanager
def deployment(
    model: Path,
    tmp: Path,
    encoders: int = 1,
    denoisers: int = 1,
    decoders: int = 1,
    head_flags: tuple[str, ...] = (),
    worker_flags: tuple[str, ...] = (),
    null_payload: int | None = None,
    head_first: bool = True,
    ready_timeout: float = 120,
) -> Iterator[Deployment]:
    """Head and workers as separate processes; waits until every worker heartbeats."""
    sched = free_port_block(6)
    http = free_port_block(1)
    counts = {Role.ENCODER: encoders, Role.DENOISER: denoisers, Role.DECODER: decoders}
    worker_ports = {role: [free_port_block(1) for _ in range(n)] for role, n in counts.items()}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    py = sys.executable
    worker_module = ["-m", "triptych_worker.null_pipeline", "--payload-bytes", str(null_payload)] if null_payload else ["-m", "triptych"]
    dep = Deployment(http=f"http://127.0.0.1:{http}", scheduler_port=sched)
    urls = {role: [f"tcp://127.0.0.1:{p}" for p in ports] for role, ports in worker_ports.items()}

    def start_head() -> None:
        args = [py, "-m", "triptych", "serve", "--model-path", str(model), "--disagg-role", "server",
                "--scheduler-port", str(sched), "--host", "127.0.0.1", "--port", str(http),
                "--encoder-urls", ";".join(urls[Role.ENCODER]), "--denoiser-urls", ";".join(urls[Role.DENOISER]),
                "--decoder-urls", ";".join(urls[Role.DECODER]), "--output-path", str(tmp / "outputs"),
                "--device", "cpu", *head_flags]  # fmt: skip
        log = tmp / "head.log"
        dep.procs.append(Proc(Role.SERVER, dep.http, _spawn(args, log, env), log))

    def start_workers() -> None:
        for role, ports in worker_ports.items():
            for i, port in enumerate(ports):
                args = [py, *worker_module, "serve", "--model-path", str(model), "--disagg-role", role.value,
                        "--disagg-server-addr", f"tcp://127.0.0.1:{sched}", "--scheduler-port", str(port),
                        "--disagg-p2p-hostname", "127.0.0.1", "--device", "cpu", *worker_flags]  # fmt: skip
                if null_payload:
                    args.remove("serve")
                log = tmp / f"{role.value}-{i}.log"
                dep.procs.append(Proc(role, f"tcp://127.0.0.1:{port}", _spawn(args, log, env), log))

    try:
        if head_first:
            start_head()
            start_workers()
        else:
            start_workers()
            time.sleep(1.0)
            start_head()
        wait_ready(dep, sum(counts.values()), ready_timeout)
        yield dep
    finally:
        for p in dep.procs:
            p.kill()


def wait_ready(dep: Deployment, n_workers: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        for p in dep.procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.role.value} exited with {p.popen.returncode}:\n{p.tail()}")
        try:
            health = httpx.get(f"{dep.http}/health", timeout=2).json()
            alive = sum(w["alive"] for ws in health["workers"].values() for w in ws)
            last = str(health)
            if alive == n_workers:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"deployment not ready in {timeout}s; last health: {last}\n{dep.logs()}")
