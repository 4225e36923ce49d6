"""A whole disaggregated deployment as local processes: one head plus worker processes.

Used by `make demo`, the end-to-end tests and the benchmarks. Every process is a real
`triptych serve` (or, for control-plane measurements, a zero-compute null worker) talking over
loopback ZMQ and Mooncake TCP, with an authenticated control plane (a key set generated in the
workdir; `authenticated=False` runs it without). Give workers `--simulate` (worker_flags) for model-free workers of
a few tens of MB each; give `spare` ports to add workers while the deployment runs
(`LocalDeployment.start_worker`) and `stop_worker` to drain (SIGTERM) or kill one.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from triptych.config import flag
from triptych.ports import MAX_RESULT_PORT_OFFSET
from triptych.roles import COMBINED_ROLES, FULL_PIPELINE_ROLE, WORKER_ROLES, Role, is_full_pipeline
from triptych.security import generate_keys
from triptych_dev.prefork import Launcher, PreforkedProcess

ROLES = COMBINED_ROLES  # the default topology: one encoder, one denoiser, one decoder

Device = int | str
"""A GPU index, or "cpu"."""


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_port_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # the Linux default


def free_port_block(n: int) -> int:
    """A base port with n consecutive free loopback ports (the head needs scheduler_port .. +5).

    Picked between Mooncake's handshake ports (15000-17000) and the kernel's ephemeral range:
    outgoing connections (Mooncake opens one per write) take local ports from the latter, so a
    port picked there can be taken between this check and the process binding it.
    """
    low, high = 20000, max(20000, _ephemeral_port_start() - n)
    now = time.monotonic()
    for _ in range(200):
        base = random.randint(low, high)
        block = range(base, base + n)
        if not any(now - _handed_out.get(p, -HELD_FOR) < HELD_FOR for p in block) and all(map(_port_free, block)):
            _handed_out.update(dict.fromkeys(block, now))
            return base
    raise RuntimeError("no free port block on 127.0.0.1")


# Ports handed out but not yet bound look free too: a block is not handed out again for this long
# (e.g. a worker's --master-port picked after the deployment's block, before its workers bind).
HELD_FOR = 300.0
_handed_out: dict[int, float] = {}


@dataclass
class Proc:
    role: Role
    url: str
    popen: subprocess.Popen[bytes] | PreforkedProcess
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
class LocalDeployment:
    http: str
    scheduler_port: int
    procs: list[Proc] = field(default_factory=list)
    spare: dict[Role, list[int]] = field(default_factory=dict)  # ports the head lists that no worker holds yet
    # With discovery files: the file:// list of each role's endpoints, which start_worker extends.
    endpoint_files: dict[Role, Path] = field(default_factory=dict)
    spawn_worker: Callable[[Role, int], Proc] | None = None
    head_argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path = Path(".")
    keys_dir: Path | None = None  # the control plane's key set (--disagg-keys-dir), None when unauthenticated
    head_urls: list[str] = field(default_factory=list)  # every head's HTTP address (replicated heads: several)
    head_scheduler_ports: list[int] = field(default_factory=list)  # and its --scheduler-port (frontend, results)
    head_argvs: list[list[str]] = field(default_factory=list)  # and its command line

    def workers(self, role: Role) -> list[Proc]:
        return [p for p in self.procs if p.role is role]

    def start_worker(self, role: Role) -> Proc:
        """Start one more `role` worker; it joins once it heartbeats.

        With discovery files it gets a new port and is added to the role's list (the head picks it
        up at its next re-read); otherwise it takes a spare port the head already lists, and
        RuntimeError says when none is left (ask for more with `spare=`).
        """
        if self.spawn_worker is None:
            raise RuntimeError("start_worker needs a deployment started by local_deployment")
        if role in self.endpoint_files:
            port = self.spare[role].pop(0) if self.spare.get(role) else free_port_block(1)
        elif self.spare.get(role):
            port = self.spare[role].pop(0)
        else:
            raise RuntimeError(f"no spare {role.value} port left; pass spare={{Role.{role.name}: n}}")
        proc = self.spawn_worker(role, port)
        self.procs.append(proc)
        if role in self.endpoint_files:
            self.write_endpoints(role)
        return proc

    def stop_worker(self, proc: Proc, drain: bool = True, timeout: float = 30) -> int:
        """SIGTERM (drain: finish held work, then exit) or SIGKILL one worker; returns its exit status.

        Its port becomes spare again, so start_worker can bring the role back.
        """
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM if drain else signal.SIGKILL)
        code = proc.popen.wait(timeout)
        self.procs.remove(proc)
        self.spare.setdefault(proc.role, []).append(int(proc.url.rsplit(":", 1)[1]))
        return code

    def unlist_worker(self, proc: Proc) -> None:
        """Remove a worker from its role's discovery file, as a scale-down removes it from DNS."""
        self.write_endpoints(proc.role, without=proc)

    def write_endpoints(self, role: Role, without: Proc | None = None) -> None:
        urls = [p.url for p in self.workers(role) if p is not without and p.popen.poll() is None]
        path = self.endpoint_files[role]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(f"{u}\n" for u in urls))
        tmp.replace(path)  # atomic: the head never reads half a list

    @property
    def head(self) -> Proc:
        """The head started last."""
        return self.workers(Role.SERVER)[-1]

    def start_head(self) -> Proc:
        """Start another head with the same flags and ports (as a restarted pod would); the previous
        one must have exited. Its log is head-2.log, head-3.log, ..."""
        log = self.workdir / f"head-{len(self.workers(Role.SERVER)) + 1}.log"
        proc = Proc(Role.SERVER, self.http, _spawn(self.head_argv, log, self.env), log)
        self.procs.append(proc)
        return proc

    def replace_head(self, i: int, timeout: float = 60) -> Proc:
        """Roll replicated head `i` as a rollout does: SIGTERM it (it drains what it accepted), wait for
        it to exit 0, then start its replacement on the same ports. Returns the new head."""
        url = self.head_urls[i]
        old = next(p for p in reversed(self.workers(Role.SERVER)) if p.url == url and p.popen.poll() is None)
        old.popen.send_signal(signal.SIGTERM)
        code = old.popen.wait(timeout)
        if code != 0:
            raise RuntimeError(f"head {url} exited with {code} on SIGTERM:\n{old.tail()}")
        self.procs.remove(old)
        log = self.workdir / f"head-{i}-{len(self.procs)}.log"
        proc = Proc(Role.SERVER, url, _spawn(self.head_argvs[i], log, self.env), log)
        self.procs.append(proc)
        return proc

    def client(self, timeout: float = 300) -> httpx.Client:
        return httpx.Client(base_url=self.http, timeout=timeout)

    def logs(self) -> str:
        return "\n".join(f"--- {p.role.value} {p.url}\n{p.tail()}" for p in self.procs)


_launcher: Launcher | None = None


def use_prefork(launcher: Launcher | None) -> None:
    """Start workers and monolithic servers from `launcher`'s preloaded interpreter (triptych_dev.prefork)
    when it can take them; None: ordinary processes only (the default)."""
    global _launcher
    _launcher = launcher


def _spawn(
    argv: list[str], log: Path, env: dict[str, str], preforked: bool = False
) -> subprocess.Popen[bytes] | PreforkedProcess:
    if preforked and _launcher is not None:
        child = _launcher.spawn(argv, log, env)
        if child is not None:
            return child
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


HEAD_PORTS = 1 + MAX_RESULT_PORT_OFFSET  # scheduler_port .. +5: the frontend and every role's result port


def deployment_ports(counts: dict[Role, int], heads: int = 1) -> tuple[list[tuple[int, int]], dict[Role, list[int]]]:
    """Distinct free ports for one deployment: per head its block (scheduler_port .. +5) and its
    HTTP port, and one port per worker.

    Taken from one contiguous free block: ports picked one by one can coincide, since nothing
    binds them until the processes start (a second head's block once landed on the first's).
    """
    n_workers = sum(counts.values())
    per_head = HEAD_PORTS + 1
    base = free_port_block(per_head * heads + n_workers)
    head_ports = [(base + i * per_head, base + i * per_head + HEAD_PORTS) for i in range(heads)]
    next_port = iter(range(base + per_head * heads, base + per_head * heads + n_workers))
    workers = {role: [next(next_port) for _ in range(n)] for role, n in counts.items()}
    return head_ports, workers


def check_devices(devices: Sequence[Device]) -> bool:
    """Raise ValueError for a device list no worker can run on; True for CPU ranks, False for GPU indices."""
    cpu = bool(devices) and all(d == "cpu" for d in devices)
    if not cpu and not (devices and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)):
        raise ValueError(f'devices {list(devices)!r}: give ["cpu"] (one per CPU rank) or GPU indices such as [0, 1]')
    if not cpu and len(set(devices)) != len(devices):
        raise ValueError(f"devices {list(devices)!r}: a GPU index appears twice; give each rank its own GPU")
    return cpu


def device_flags(devices: Sequence[Device]) -> tuple[list[str], dict[str, str]]:
    """`triptych serve` flags and environment for one worker on `devices`: ["cpu"] (k entries: k CPU ranks),
    or GPU indices (made visible through CUDA_VISIBLE_DEVICES, so any set of GPUs works as --num-gpus N).
    A worker of several ranks gets a free --master-port of its own, so instances on one host never share one."""
    cpu = check_devices(devices)
    ranks = ["--num-gpus", str(len(devices)), "--master-port", str(free_port_block(1))] if len(devices) > 1 else []
    if cpu:
        return ["--device", "cpu", *ranks], {}
    return ["--device", "cuda", *ranks], {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}


@contextmanager
def local_deployment(
    model: Path,
    workdir: Path,
    counts: dict[Role, int] | None = None,
    head_flags: Sequence[str] = (),
    worker_flags: Sequence[str] = (),
    role_flags: dict[Role, Sequence[str]] | None = None,
    null_payload_bytes: int | None = None,
    head_first: bool = True,
    ready_timeout: float = 180,
    worker_url_scheme: str | None = None,
    discovery_files: bool = False,
    spare: dict[Role, int] | None = None,
    authenticated: bool = True,
    devices: Mapping[Role, Sequence[Sequence[Device]]] | None = None,
    host: str = "127.0.0.1",
    full_pipeline: bool = False,
    heads: int = 1,
) -> Iterator[LocalDeployment]:
    """Start head and workers (logs under `workdir`), wait until every worker heartbeats, kill all on exit.

    `worker_url_scheme` is how the head is told where workers are: tcp://HOST (the default), or
    dns://localhost to go through name resolution as the head does behind a headless Service.
    `discovery_files`: the head reads each role's workers from a file:// list instead, which
    LocalDeployment.start_worker and unlist_worker rewrite (workers joining and leaving).
    `spare`: per role, how many more worker ports the head lists, for workers started later
    with `LocalDeployment.start_worker` (until then the head sees them as not responding).
    `authenticated`: the head and workers get --disagg-keys-dir with a key set written to
    `workdir`/keys (kept if it is there already); False runs the control plane without keys.
    `host`: the IPv4 address every process binds and is reached on (the head's --host, the workers'
    --disagg-p2p-hostname), loopback by default; another needs `authenticated`.
    The roles are the keys of `counts` (and `spare`): the three-role topology by default, or
    the split encoders (Role.PROMPT_ENCODER, Role.IMAGE_ENCODER) instead of Role.ENCODER.
    `devices`: per role, each instance's devices (device_flags); instances beyond it get worker_flags only.
    `full_pipeline`: a full-pipeline pool: denoisers only (`counts` may list no other role), each
    started with --disagg-full-pipeline, and a head with only --denoiser-urls.
    `heads`: replicated heads, each with its own ports and the same worker lists; every worker serves
    them all (--disagg-server-addr lists each). `dep.http` is the first, `dep.head_urls` all of them.
    """
    counts = counts or ({FULL_PIPELINE_ROLE: 1} if full_pipeline else dict.fromkeys(ROLES, 1))
    if full_pipeline and not is_full_pipeline({*counts, *(spare or {})}):
        listed = ", ".join(role.value for role in counts)
        raise ValueError(f"a full-pipeline pool has {FULL_PIPELINE_ROLE.value} workers only, not {listed}")
    pool_flags = ["--disagg-full-pipeline"] if full_pipeline else []
    spare = spare or {}
    devices = devices or {}
    roles = [role for role in WORKER_ROLES if role in counts or role in spare]
    worker_url_scheme = worker_url_scheme or f"tcp://{host}"
    workdir.mkdir(parents=True, exist_ok=True)
    head_ports, ports = deployment_ports({role: counts.get(role, 0) + spare.get(role, 0) for role in roles}, heads)
    sched, http = head_ports[0]
    spare_ports = {role: ports[role][counts.get(role, 0) :] for role in roles}
    ports = {role: ports[role][: counts.get(role, 0)] for role in roles}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    worker_cmd = (
        [py, "-m", "triptych_dev.null_pipeline", "--payload-bytes", str(null_payload_bytes)]
        if null_payload_bytes is not None
        else [py, "-m", "triptych", "serve"]
    )
    server_addr = ";".join(f"tcp://{host}:{s}" for s, _ in head_ports)
    dep = LocalDeployment(
        http=f"http://{host}:{http}", scheduler_port=sched, spare=spare_ports, env=env, workdir=workdir,
        head_urls=[f"http://{host}:{h}" for _, h in head_ports], head_scheduler_ports=[s for s, _ in head_ports],
    )  # fmt: skip
    if discovery_files:
        dep.endpoint_files = {role: workdir / f"{role.value}.endpoints" for role in roles}
    security_flags: list[str] = []
    if authenticated:
        dep.keys_dir = workdir / "keys"
        if not (dep.keys_dir / "head.key").exists():
            generate_keys(dep.keys_dir)
        security_flags = ["--disagg-keys-dir", str(dep.keys_dir)]
    started: dict[Role, int] = {}

    def spawn_worker(role: Role, port: int) -> Proc:
        i = started[role] = started.get(role, -1) + 1
        own = devices.get(role, ())
        placement, placement_env = device_flags(own[i]) if i < len(own) else ([], {})
        argv = [*worker_cmd, "--model-path", str(model), "--disagg-role", role.value,
                "--disagg-server-addr", server_addr, "--scheduler-port", str(port),
                "--disagg-p2p-hostname", host, *security_flags, *pool_flags, *worker_flags, *placement,
                *(role_flags or {}).get(role, ())]  # fmt: skip
        log = workdir / f"{role.value}-{i}.log"
        return Proc(role, f"tcp://{host}:{port}", _spawn(argv, log, {**env, **placement_env}, preforked=True), log)

    dep.spawn_worker = spawn_worker

    def start_head(i: int = 0) -> None:
        head_sched, head_http = head_ports[i]
        argv = [py, "-m", "triptych", "serve", "--model-path", str(model), "--disagg-role", "server",
                "--scheduler-port", str(head_sched), "--host", host, "--port", str(head_http),
                "--output-path", str(workdir / "outputs"), *security_flags, *head_flags]  # fmt: skip
        for role in roles:
            if discovery_files:
                spec = f"file://{dep.endpoint_files[role].resolve()}"
            else:
                spec = ";".join(f"{worker_url_scheme}:{p}" for p in ports[role] + spare_ports[role])
            argv += [flag(role.url_attr), spec]
        if i == 0:
            dep.head_argv = argv
        dep.head_argvs.append(argv)
        log = workdir / ("head.log" if i == 0 else f"head-{chr(ord('a') + i)}.log")
        dep.procs.append(Proc(Role.SERVER, dep.head_urls[i], _spawn(argv, log, env), log))

    def start_heads() -> None:
        for i in range(heads):
            start_head(i)

    def start_workers() -> None:
        for role in roles:
            for port in ports[role]:
                dep.procs.append(spawn_worker(role, port))
            if discovery_files:
                dep.write_endpoints(role)

    try:
        first, second = (start_heads, start_workers) if head_first else (start_workers, start_heads)
        first()
        second()
        wait_until_ready(dep, sum(counts.values()), ready_timeout)
        yield dep
    finally:
        for p in dep.procs:
            p.kill()


def wait_until_ready(dep: LocalDeployment, n_workers: int, timeout: float) -> None:
    """Poll the head's /health until `n_workers` workers heartbeat (0: until it answers at all)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        for p in dep.procs:
            replaced = p.role is Role.SERVER and p is not dep.head  # an earlier head, restarted since
            if p.popen.poll() is not None and not replaced:
                raise RuntimeError(f"{p.role.value} exited with {p.popen.returncode}:\n{p.tail()}")
        try:
            ready = 0
            for url in dep.head_urls or [dep.http]:  # every head sees every worker
                health = httpx.get(f"{url}/health", timeout=2).json()
                last = str(health)
                workers = health.get("workers", {})
                ready += sum(w["alive"] for ws in workers.values() for w in ws) == n_workers
            if ready == len(dep.head_urls or [dep.http]):
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"deployment not ready in {timeout}s; last health: {last}\n{dep.logs()}")


@contextmanager
def local_monolithic(
    model: Path, workdir: Path, flags: Sequence[str] = (), ready_timeout: float = 180
) -> Iterator[LocalDeployment]:
    """`triptych serve` in monolithic mode as one local process; waits for /health."""
    workdir.mkdir(parents=True, exist_ok=True)
    http = free_port_block(1)
    argv = [sys.executable, "-m", "triptych", "serve", "--model-path", str(model), "--port", str(http),
            "--output-path", str(workdir / "outputs"), *flags]  # fmt: skip
    log = workdir / "monolithic.log"
    proc = Proc(
        Role.MONOLITHIC,
        f"http://127.0.0.1:{http}",
        _spawn(argv, log, {**os.environ, "PYTHONUNBUFFERED": "1"}, preforked=True),
        log,
    )
    dep = LocalDeployment(http=proc.url, scheduler_port=0, procs=[proc])
    try:
        wait_until_ready(dep, 0, ready_timeout)
        yield dep
    finally:
        proc.kill()
