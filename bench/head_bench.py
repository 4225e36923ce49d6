"""Head control-plane benchmark: requests/second and per-request control overhead.

Workers run zero-compute stages (triptych_dev.null_pipeline) in real processes, with real
ZMQ and Mooncake TCP transfers, so what is measured is routing, dispatch and the transfer
protocol. Requests go straight to the DiffusionServer frontend (no HTTP) and also through HTTP.

    python bench/head_bench.py [--requests 400] [--concurrency 32] [--payload-bytes 65536]

Prints, side by side in one run:
- sequential latency per request, the Mooncake write time inside it (reported by the senders),
  the time workers spend in their (zero-compute) stages loading inputs and staging outputs (also
  reported by the workers), and the control overhead = latency - writes - stages: routing,
  dispatch, messages and thread hand-offs (target: < 2 ms), as medians, and the 50th, 90th and
  99th percentiles of each request's own overhead and p99 / p50 (target: <= 3x);
- the floor under that overhead: the same 12 messages (sizes, frames, CURVE on the head <-> worker
  sockets) sent between this client and 4 processes that only forward them (bench/zmq_floor.py),
  in --blocks blocks alternating with the head's (floor, head, floor, head, ...) in this one
  process lifetime; the overhead / floor ratio per block pair and its median (target: <= 1.5x);
- the same sequential measurement and the floor with every thread of every process (head,
  workers, the floor's, this client) pinned to one CPU: no message then wakes a thread on another
  CPU (on a small VM such a wake-up costs more than handling the message, the floor's most), and
  their ratio, which is then the per-message work alone;
- throughput in requests/second at --concurrency, frontend and HTTP in --blocks alternating blocks
  (HTTP from a lean keep-alive client, http_load.py), their ratio and the head's CPU per request;
- the cost of the authenticated control plane: a deployment with CURVE keys (the default, measured
  above) and one without, both up side by side, measured in alternating blocks of sequential
  requests (--auth-blocks, 0: skip);
- with --transfer-mib N: the encoder->denoiser hand-off of an N MiB payload through the whole
  transfer flow (slot, push, write, report) against a raw Mooncake transfer_sync_write of the
  same bytes between this process and a receiver (bench/transfer_bench.py's pair), in --blocks
  alternating blocks (raw, ours, raw, ours, ...) while the deployment is up, as a throughput
  ratio per block and its median (target >= 90%).
- with --load-ahead-mib N: back-to-back requests (--load-ahead-concurrency of them in flight, so the
  next one's inputs wait at the denoiser and decoder while the current one computes) of N MiB per
  hop, the denoiser computing --load-ahead-step-ms per request, on two deployments up side by side:
  receivers that copy inputs out of their slots ahead of compute (--disagg-load-ahead 1, the default)
  and ones whose computing thread copies them (0, before), in --blocks alternating blocks; medians
  of the receivers' stage time (inputs loaded + compute + outputs staged), request latency and
  throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import psutil
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import http_load  # noqa: E402
import zmq_floor  # noqa: E402

from triptych.params import GenerationParams  # noqa: E402
from triptych.protocol import RequestEvent, RequestResult, Submit, decode, encode  # noqa: E402
from triptych.roles import Role  # noqa: E402
from triptych_dev.localdeploy import local_deployment  # noqa: E402
from triptych_dev.tiny_models import write_tiny_models  # noqa: E402

PARAMS = zmq_floor.PARAMS  # what every request asks for: the floor's messages are sized from it


class Frontend:
    """A DEALER on the head's frontend: submits requests and awaits each one's result."""

    def __init__(self, endpoint: str):
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.endpoint = endpoint
        self.waiting: dict[str, asyncio.Future[RequestResult]] = {}
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            msg, _ = decode(await self.sock.recv_multipart())
            fut = self.waiting.get(msg.request_id)
            if fut is None or fut.done():
                continue
            if isinstance(msg, RequestResult):
                fut.set_result(msg)
            elif isinstance(msg, RequestEvent) and msg.error:
                fut.set_exception(RuntimeError(msg.error))

    async def request(self, rid: str, params: GenerationParams = PARAMS, priority: int = 1) -> RequestResult:
        """`priority`: triptych.priority's level (1, normal, by default)."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        await self.sock.send_multipart(encode(Submit(rid, params, priority=priority)))
        try:
            return await fut
        finally:
            self.waiting.pop(rid, None)

    def close(self) -> None:
        self.reader.cancel()
        self.sock.close()


def sequential_requests(sock: zmq.Socket[Any], rids: Iterable[str]) -> Iterator[tuple[str, int, int, RequestResult]]:
    """Each of `rids` in turn from a blocking DEALER, so the client adds no event-loop latency: its id,
    the client's clock (ns) at its send and at its answer, and its result."""
    for rid in rids:
        t0 = time.perf_counter_ns()
        sock.send_multipart(encode(Submit(rid, PARAMS)))
        result, _ = decode(sock.recv_multipart())
        t1 = time.perf_counter_ns()
        if not isinstance(result, RequestResult):
            raise RuntimeError(f"request {rid} failed: {result}")
        yield rid, t0, t1, result


def sequential_samples(endpoint: str, n: int) -> tuple[list[float], list[float], list[float]]:
    """Latency, Mooncake write and worker stage seconds of n requests, one at a time."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(endpoint)
    latencies, writes, stages = [], [], []
    try:
        for _, t0, t1, result in sequential_requests(sock, (f"seq-{i}" for i in range(n))):
            latencies.append((t1 - t0) / 1e9)
            writes.append(sum(v for k, v in result.timings.items() if k.startswith("transfer_")))
            stages.append(sum(v for k, v in result.timings.items() if k.startswith("worker_")))
    finally:
        sock.close()
    return latencies, writes, stages


def per_request_overheads(latencies: list[float], writes: list[float], stages: list[float]) -> list[float]:
    """Each request's control overhead, seconds: its latency less the writes and stages its workers report."""
    return [x - w - s for x, w, s in zip(latencies, writes, stages, strict=True)]


def percentile(values: list[float], q: float) -> float:
    """The value at fraction `q` (0..1) of `values` in order (the nearest rank below)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(latencies: list[float], writes: list[float], stages: list[float]) -> dict[str, float]:
    lat, wr, st = statistics.median(latencies), statistics.median(writes), statistics.median(stages)
    per_request = per_request_overheads(latencies, writes, stages)
    p50, p90, p99 = (percentile(per_request, q) for q in (0.5, 0.9, 0.99))
    return {
        "latency_ms": lat * 1e3,
        "mooncake_write_ms": wr * 1e3,
        "worker_stages_ms": st * 1e3,
        "control_overhead_ms": (lat - wr - st) * 1e3,
        "control_overhead_p50_ms": p50 * 1e3,
        "control_overhead_p90_ms": p90 * 1e3,
        "control_overhead_p99_ms": p99 * 1e3,
        "control_overhead_p99_over_p50": p99 / p50 if p50 > 0 else float("nan"),
    }


def sequential(endpoint: str, n: int) -> dict[str, float]:
    return summarize(*sequential_samples(endpoint, n))


async def throughput_frontend(front: Frontend, n: int, concurrency: int, tag: str = "tp") -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await front.request(f"{tag}-{i}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


async def throughput_http(base: str, n: int, concurrency: int) -> float:
    """Through the HTTP API, from keep-alive connections of a lean client (http_load.py: httpx costs
    the client about as much CPU per request as the head, which on a small machine would measure it)."""
    body = {"prompt": "bench", "size": "16x16", "num_inference_steps": 1, "seed": 0}
    request = http_load.post_json("/v1/images/generations", base.removeprefix("http://"), body)
    return await http_load.closed_loop(base, request, n, concurrency)


async def throughput(dep, front: Frontend, args) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Frontend and HTTP requests/second at --concurrency in alternating blocks (frontend, HTTP, ...)
    of --requests each in all, so the host's drift falls on both; the head's CPU per request of each."""
    per_block = max(args.concurrency, -(-args.requests // args.blocks))
    await throughput_http(dep.http, args.concurrency, args.concurrency)  # warm up (connections, first requests)
    rps: dict[str, list[float]] = {"frontend": [], "http": []}
    head_cpu: dict[str, float] = {"frontend": 0.0, "http": 0.0}
    for b in range(args.blocks):
        for path in ("frontend", "http") if b % 2 == 0 else ("http", "frontend"):
            before = cpu_seconds(dep)["server"]
            if path == "frontend":
                rps[path].append(await throughput_frontend(front, per_block, args.concurrency, f"tp-{b}"))
            else:
                rps[path].append(await throughput_http(dep.http, per_block, args.concurrency))
            head_cpu[path] += cpu_seconds(dep)["server"] - before
    ratios = [h / f for h, f in zip(rps["http"], rps["frontend"], strict=True)]
    return {
        "frontend_rps": statistics.median(rps["frontend"]),
        "http_rps": statistics.median(rps["http"]),
        "http_over_frontend": statistics.median(ratios),
        "http_over_frontend_per_block": ratios,
        "throughput_requests_per_block": per_block,
        "head_cpu_ms_per_request_frontend": head_cpu["frontend"] / (per_block * args.blocks) * 1e3,
        "head_cpu_ms_per_request_http": head_cpu["http"] / (per_block * args.blocks) * 1e3,
    }


def process_cpu_seconds(pids: Iterable[int | None]) -> float:
    """CPU time (user + system) these processes have used so far, together."""
    total = 0.0
    for pid in pids:
        if pid is not None:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def cpu_seconds(dep) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """CPU time (user + system) each process of the deployment has used so far, by role."""
    out: dict[str, float] = {}
    for p in dep.procs:
        out[p.role.value] = out.get(p.role.value, 0.0) + process_cpu_seconds([p.popen.pid])
    return out


@contextmanager
def on_one_cpu(pids: list[int]) -> Iterator[bool]:
    """Every thread of these processes and of this one on a single CPU; yields False if there is only one."""
    cpus = os.sched_getaffinity(0)
    everyone = [os.getpid(), *pids]

    def set_all(mask: set[int]) -> None:
        for pid in everyone:
            for thread in psutil.Process(pid).threads():
                try:
                    os.sched_setaffinity(thread.id, mask)
                except ProcessLookupError:
                    pass  # the thread ended meanwhile

    if len(cpus) < 2:
        yield False
        return
    set_all({min(cpus)})
    try:
        yield True
    finally:
        set_all(cpus)


def on_one_cpu_figures(endpoint: str, pids: list[int], floor: zmq_floor.Floor, n: int) -> dict[str, float]:
    """The sequential overhead and the floor with every thread of both (and of this client) on one CPU.

    On a small VM the placement the scheduler picks by itself costs the floor more than the head: a
    wake-up on another (often idle) vCPU costs more than the floor's handling of the message. Once
    pinned, nothing wakes across CPUs and the ratio shows the per-message work alone. Empty with one CPU.
    """
    with on_one_cpu([*pids, *(p.pid for p in floor.procs if p.pid is not None)]) as pinned:
        if not pinned:
            return {}
        floor.block(20)  # settle on the new placement
        floor_ms = zmq_floor.summary(floor.block(n))["floor_ms"]
        sequential(endpoint, 20)
        ours = sequential(endpoint, n)
    return {
        "one_cpu_latency_ms": ours["latency_ms"],
        "one_cpu_control_overhead_ms": ours["control_overhead_ms"],
        "one_cpu_zmq_floor_ms": floor_ms,
        "one_cpu_overhead_over_floor": ours["control_overhead_ms"] / floor_ms,
    }


async def measure(dep, args) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    front = Frontend(f"tcp://127.0.0.1:{dep.scheduler_port}")
    await front.request("warmup")
    # The ZMQ floor and the head in alternating blocks (floor, head, floor, head, ...) in this one
    # process lifetime, so the host's drift falls on both; the ratio per block pair and its median.
    per_block = max(1, -(-args.sequential // args.blocks))
    runs: tuple[list[float], list[float], list[float]] = ([], [], [])
    floor_samples: list[float] = []
    ratios: list[float] = []
    cpu_used = dict.fromkeys(cpu_seconds(dep), 0.0)
    floor_cpu = 0.0
    with zmq_floor.Floor(args.payload_bytes) as floor:
        for _ in range(args.blocks):
            floor_before = process_cpu_seconds(p.pid for p in floor.procs)
            floor_block = floor.block(per_block)
            floor_cpu += process_cpu_seconds(p.pid for p in floor.procs) - floor_before
            before = cpu_seconds(dep)
            block = sequential_samples(front.endpoint, per_block)
            for role, used in cpu_seconds(dep).items():
                cpu_used[role] += used - before[role]
            floor_samples += floor_block
            for acc, xs in zip(runs, block, strict=True):
                acc += xs
            ratios.append(summarize(*block)["control_overhead_ms"] / zmq_floor.summary(floor_block)["floor_ms"])
        one_cpu = on_one_cpu_figures(front.endpoint, [p.popen.pid for p in dep.procs], floor, args.sequential)
    out: dict[str, Any] = dict(summarize(*runs))
    for role, used in cpu_used.items():
        out[f"cpu_ms_per_request_{role}"] = used / len(runs[0]) * 1e3
    out["zmq_floor_cpu_ms_per_request"] = floor_cpu / len(floor_samples) * 1e3
    floor_summary = zmq_floor.summary(floor_samples)
    out["zmq_floor_ms"], out["zmq_floor_messages"] = floor_summary["floor_ms"], floor_summary["messages"]
    out["zmq_floor_p99_ms"] = floor_summary["floor_p99_ms"]
    out["overhead_over_floor_per_block"] = ratios
    out["overhead_over_floor"] = statistics.median(ratios)
    out.update(one_cpu)
    out.update(await throughput(dep, front, args))
    front.reader.cancel()
    return out


def auth_comparison(flux: Path, payload_bytes: int, blocks: int, per_block: int) -> dict[str, float]:
    """Control overhead with CURVE authentication on and off: two deployments up at once, alternating
    blocks of `per_block` sequential requests (so the host's drift falls on both); medians of blocks."""
    figures: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        deps = {
            auth: stack.enter_context(
                local_deployment(
                    flux,
                    Path(tmp) / ("on" if auth else "off"),
                    worker_flags=("--device", "cpu"),
                    null_payload_bytes=payload_bytes,
                    authenticated=auth,
                )
            )
            for auth in (True, False)
        }
        for dep in deps.values():
            sequential(f"tcp://127.0.0.1:{dep.scheduler_port}", 20)  # warm up
        for i in range(blocks):
            for auth in (True, False) if i % 2 == 0 else (False, True):
                figures[auth].append(sequential(f"tcp://127.0.0.1:{deps[auth].scheduler_port}", per_block))
    out: dict[str, float] = {}
    for auth, name in ((True, "auth_on"), (False, "auth_off")):
        for key in ("latency_ms", "control_overhead_ms"):
            out[f"{name}_{key}"] = statistics.median(f[key] for f in figures[auth])
    out["auth_requests_each"] = blocks * per_block
    return out


class RawMooncake:
    """A raw TransferEngine.transfer_sync_write of nbytes to a receiver process (bench/transfer_bench.py's
    pair: registered buffers, a receiver round trip before each write, the cadence of `raw` there),
    up for the `with` block so its blocks alternate with the deployment's in one process lifetime."""

    def __init__(self, nbytes: int):
        import transfer_bench

        from triptych_worker.transfer import MooncakeTransport, TransferPool

        self.nbytes = nbytes
        pool_bytes = nbytes + (2 << 20)
        self.transport = MooncakeTransport("127.0.0.1", None)
        self.pool = TransferPool(pool_bytes, "bench-raw", self.transport)
        self.peer = transfer_bench.ReceiverProcess(
            argparse.Namespace(hostname="127.0.0.1", ib_device=None, receiver_pool_bytes=pool_bytes, torch_threads=1)
        )
        src = self.pool.allocate(nbytes, "raw")
        assert src is not None
        self.src = src.addr
        self.dest = self.peer.ask({"op": "slot", "nbytes": nbytes})["addr"]
        self.block(2)  # warm up

    def block(self, n: int) -> list[float]:
        samples = []
        for _ in range(n):
            self.peer.ask({"op": "ping"})
            t0 = time.perf_counter()
            rc = self.transport.engine.transfer_sync_write(self.peer.session, self.src, self.dest, self.nbytes)
            samples.append(time.perf_counter() - t0)
            if rc != 0:
                raise RuntimeError(f"raw transfer_sync_write returned {rc}")
        return samples

    def close(self) -> None:
        self.peer.close()


def transfer_comparison(flux: Path, mib: int, n: int, blocks: int) -> dict[str, Any]:
    """The encoder->denoiser hand-off (slot, push, write, report) of mib MiB against a raw Mooncake
    write of the same bytes, in alternating blocks (raw, ours, raw, ours, ...) of n requests in all."""
    nbytes = mib << 20
    per_block = max(1, -(-n // blocks))
    raw_s: list[float] = []
    handoff_s: list[float] = []
    write_s: list[float] = []
    handoff_ratios: list[float] = []
    write_ratios: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        with local_deployment(flux, Path(tmp), worker_flags=("--device", "cpu"), null_payload_bytes=nbytes) as dep:
            raw = RawMooncake(nbytes)
            try:

                async def run() -> None:
                    front = Frontend(f"tcp://127.0.0.1:{dep.scheduler_port}")
                    await front.request("warmup-handoff")
                    for b in range(blocks):
                        raw_block = raw.block(per_block)
                        results = [await front.request(f"handoff-{b}-{i}") for i in range(per_block)]
                        hand = [r.timings["handoff_encoder_denoiser"] for r in results]
                        write = [r.timings["transfer_encoder_denoiser"] for r in results]
                        raw_s.extend(raw_block)
                        handoff_s.extend(hand)
                        write_s.extend(write)
                        handoff_ratios.append(statistics.median(raw_block) / statistics.median(hand))
                        write_ratios.append(statistics.median(raw_block) / statistics.median(write))
                    front.reader.cancel()

                asyncio.run(run())
            finally:
                raw.close()
    return {
        "transfer_bytes": nbytes,
        "transfer_blocks": blocks,
        "handoff_requests_per_block": per_block,  # n rounded up to a multiple of the blocks
        "handoff_ms": statistics.median(handoff_s) * 1e3,
        "write_ms": statistics.median(write_s) * 1e3,
        "raw_mooncake_ms": statistics.median(raw_s) * 1e3,
        # throughput ratios to raw: the median of the per-block ratios, and each block's own
        "handoff_vs_raw": statistics.median(handoff_ratios),
        "write_vs_raw": statistics.median(write_ratios),
        "handoff_vs_raw_per_block": handoff_ratios,
        "write_vs_raw_per_block": write_ratios,
    }


def load_ahead_comparison(
    flux: Path, mib: int, step_ms: float, concurrency: int, n: int, blocks: int
) -> dict[str, Any]:
    """Receivers loading inputs ahead of compute (--disagg-load-ahead 1) against loading them on the
    computing thread (0): two deployments up at once, alternating blocks of n requests in all, each
    block `concurrency` requests in flight (so one waits at each receiver while another computes)."""
    per_block = max(concurrency, -(-n // blocks))
    receivers = (Role.DENOISER, Role.DECODER)
    figures: dict[int, dict[str, list[float]]] = {a: {"stage": [], "latency": [], "rps": []} for a in (1, 0)}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        deps = {}
        for ahead in (1, 0):
            flags = ("--disagg-load-ahead", str(ahead))
            role_flags = {role: flags for role in receivers}
            role_flags[Role.DENOISER] = (*flags, "--step-seconds", str(step_ms / 1e3))
            workdir = Path(tmp) / f"ahead-{ahead}"
            deps[ahead] = stack.enter_context(
                local_deployment(
                    flux, workdir, worker_flags=("--device", "cpu"), role_flags=role_flags, null_payload_bytes=mib << 20
                )
            )

        async def block(front: Frontend, tag: str) -> tuple[list[RequestResult], float, list[float]]:
            started = time.perf_counter()
            latencies: list[float] = []

            async def one(i: int) -> RequestResult:
                t0 = time.perf_counter()
                result = await front.request(f"{tag}-{i}")
                latencies.append(time.perf_counter() - t0)
                return result

            results: list[RequestResult] = []
            for first in range(0, per_block, concurrency):  # waves of `concurrency` back-to-back requests
                results += await asyncio.gather(*(one(i) for i in range(first, min(first + concurrency, per_block))))
            return results, per_block / (time.perf_counter() - started), latencies

        async def run() -> None:
            fronts = {a: Frontend(f"tcp://127.0.0.1:{dep.scheduler_port}") for a, dep in deps.items()}
            for a, front in fronts.items():
                await block(front, f"warmup-{a}")
            for b in range(blocks):
                for a in (1, 0) if b % 2 == 0 else (0, 1):
                    results, rps, latencies = await block(fronts[a], f"ahead-{a}-{b}")
                    stages = [sum(r.timings[f"worker_{role.value}"] for role in receivers) for r in results]
                    figures[a]["stage"] += stages
                    figures[a]["latency"] += latencies
                    figures[a]["rps"].append(rps)
            for front in fronts.values():
                front.reader.cancel()

        asyncio.run(run())
    out: dict[str, Any] = {"load_ahead_bytes": mib << 20, "load_ahead_step_ms": step_ms}
    for a, name in ((1, "load_ahead"), (0, "load_inline")):
        out[f"{name}_receiver_stages_ms"] = statistics.median(figures[a]["stage"]) * 1e3
        out[f"{name}_latency_ms"] = statistics.median(figures[a]["latency"]) * 1e3
        out[f"{name}_rps"] = statistics.median(figures[a]["rps"])
    out["load_ahead_rps_gain"] = out["load_ahead_rps"] / out["load_inline_rps"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--sequential", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--payload-bytes", type=int, default=64 * 1024)
    p.add_argument("--transfer-mib", type=int, default=32, help="payload for the hand-off comparison (0: skip)")
    p.add_argument("--load-ahead-mib", type=int, default=32, help="payload for the load-ahead comparison (0: skip)")
    p.add_argument("--load-ahead-step-ms", type=float, default=40.0, help="the denoiser's compute per request there")
    p.add_argument("--load-ahead-concurrency", type=int, default=3)
    p.add_argument("--load-ahead-requests", type=int, default=60)
    p.add_argument("--auth-blocks", type=int, default=8, help="alternating blocks for authentication on/off (0: skip)")
    p.add_argument("--auth-block-requests", type=int, default=100)
    p.add_argument(
        "--blocks",
        type=int,
        default=5,
        help="alternating blocks of baseline and measured runs (ZMQ floor / head; raw Mooncake / hand-off)",
    )
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "head.json")
    args = p.parse_args()
    if args.blocks < 1:
        p.error("--blocks must be >= 1")
    (flux,) = write_tiny_models(ROOT / ".models", families=["tiny-flux"])
    with tempfile.TemporaryDirectory() as tmp:
        # The closed loop of --concurrency HTTP clients is load the head should take, not refuse (429).
        head_flags = ("--max-queued-requests", str(args.concurrency))
        with local_deployment(flux, Path(tmp), worker_flags=("--device", "cpu"), head_flags=head_flags,
                              null_payload_bytes=args.payload_bytes) as dep:  # fmt: skip
            result = asyncio.run(measure(dep, args))
    result["payload_bytes"] = args.payload_bytes
    print(
        f"head control plane (authenticated), zero-compute stages, {args.payload_bytes} B per hop, "
        "2 Mooncake hops/request"
    )
    print(f"  sequential latency      {result['latency_ms']:8.2f} ms (median of {args.sequential})")
    print(f"  of which Mooncake write {result['mooncake_write_ms']:8.2f} ms")
    print(
        f"  of which worker stages  {result['worker_stages_ms']:8.2f} ms   (load inputs, zero compute, stage outputs)"
    )
    print(f"  control overhead        {result['control_overhead_ms']:8.2f} ms   (the rest; target < 2 ms)")
    p50, p90, p99 = (result[f"control_overhead_{p}_ms"] for p in ("p50", "p90", "p99"))
    print(
        f"  ... per request p50/p90/p99 {p50:.2f} / {p90:.2f} / {p99:.2f} ms   "
        f"(p99 / p50 {result['control_overhead_p99_over_p50']:.2f}x; target <= 3x)"
    )
    if "one_cpu_control_overhead_ms" in result:
        print(
            f"  ... all on one CPU      {result['one_cpu_control_overhead_ms']:8.2f} ms   (every process's threads "
            f"pinned to one CPU: no cross-CPU wake-ups; latency {result['one_cpu_latency_ms']:.2f} ms; the floor "
            f"pinned the same {result['one_cpu_zmq_floor_ms']:.2f} ms: {result['one_cpu_overhead_over_floor']:.2f}x)"
        )
    print(
        f"  raw ZMQ floor           {result['zmq_floor_ms']:8.2f} ms   (the same {result['zmq_floor_messages']} "
        f"messages, sizes and CURVE between a client and 4 forwarding-only processes, in {args.blocks} blocks "
        f"alternating with the head's; p99 {result['zmq_floor_p99_ms']:.2f} ms)"
    )
    per_block = " ".join(f"{r:.2f}" for r in result["overhead_over_floor_per_block"])
    print(f"  overhead / floor        {result['overhead_over_floor']:8.2f}x  median of the block pairs: {per_block}")
    cpu = ", ".join(
        f"{k.removeprefix('cpu_ms_per_request_')} {v:.2f}" for k, v in result.items() if k.startswith("cpu_ms")
    )
    print(
        f"  CPU per request (ms)    {cpu}; the floor's 4 forwarding processes (head, 3 workers) "
        f"{result['zmq_floor_cpu_ms_per_request']:.2f}"
    )
    print(f"  throughput, frontend    {result['frontend_rps']:8.1f} req/s at concurrency {args.concurrency}   "
          f"(head CPU {result['head_cpu_ms_per_request_frontend']:.2f} ms/request)")  # fmt: skip
    print(f"  throughput, HTTP        {result['http_rps']:8.1f} req/s at concurrency {args.concurrency}   "
          f"(head CPU {result['head_cpu_ms_per_request_http']:.2f} ms/request)")  # fmt: skip
    per_block = " ".join(f"{r:.2f}" for r in result["http_over_frontend_per_block"])
    print(f"  HTTP / frontend         {result['http_over_frontend']:8.2f}x  median of {args.blocks} alternating "
          f"blocks of {result['throughput_requests_per_block']} requests: {per_block}")  # fmt: skip
    if args.auth_blocks:
        a = auth_comparison(flux, args.payload_bytes, args.auth_blocks, args.auth_block_requests)
        result.update(a)
        print(f"control plane authenticated (CURVE) vs not: two deployments side by side, {args.auth_blocks} "
              f"alternating blocks of {args.auth_block_requests} sequential requests, medians")  # fmt: skip
        on, off = a["auth_on_control_overhead_ms"], a["auth_off_control_overhead_ms"]
        print(f"  control overhead        {on:8.2f} ms with keys, {off:.2f} ms without ({on - off:+.2f} ms)")
        on, off = a["auth_on_latency_ms"], a["auth_off_latency_ms"]
        print(f"  latency                 {on:8.2f} ms with keys, {off:.2f} ms without")
    if args.transfer_mib:
        t = transfer_comparison(flux, args.transfer_mib, 10, args.blocks)
        result.update(t)
        handoffs = t["handoff_requests_per_block"] * args.blocks
        print(
            f"encoder->denoiser hand-off of {args.transfer_mib} MiB ({handoffs} requests), vs raw Mooncake in "
            f"{args.blocks} alternating blocks (raw, ours, raw, ours, ...); medians, ratios the median of the blocks'"
        )
        print(f"  raw transfer_sync_write {t['raw_mooncake_ms']:8.2f} ms")
        print(f"  our write               {t['write_ms']:8.2f} ms   throughput {100 * t['write_vs_raw']:5.1f}% of raw")
        print(
            f"  our whole hand-off      {t['handoff_ms']:8.2f} ms   throughput {100 * t['handoff_vs_raw']:5.1f}% of raw"
        )
        blocks = " ".join(f"{100 * r:.0f}%" for r in t["handoff_vs_raw_per_block"])
        print(f"  ... hand-off per block  {blocks}")
    if args.load_ahead_mib:
        la = load_ahead_comparison(
            flux, args.load_ahead_mib, args.load_ahead_step_ms, args.load_ahead_concurrency,
            args.load_ahead_requests, args.blocks,
        )  # fmt: skip
        result.update(la)
        print(
            f"receivers loading inputs ahead of compute (--disagg-load-ahead 1) vs on the computing thread (0): "
            f"{args.load_ahead_mib} MiB per hop, denoiser compute {args.load_ahead_step_ms:g} ms, "
            f"{args.load_ahead_concurrency} requests in flight, {args.blocks} alternating blocks; medians"
        )
        for name, key, unit in (
            ("denoiser+decoder stages", "receiver_stages_ms", "ms"),
            ("request latency", "latency_ms", "ms"),
            ("throughput", "rps", "req/s"),
        ):
            ahead, inline = la[f"load_ahead_{key}"], la[f"load_inline_{key}"]
            print(f"  {name:23} {ahead:8.2f} {unit} ahead, {inline:.2f} {unit} inline ({ahead / inline:.2f}x)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
