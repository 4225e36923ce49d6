"""Scaling benchmark: throughput of one head as simulated denoisers are added, against linear scaling.

One head and simulated workers (`triptych serve --simulate`: real processes, ZMQ and Mooncake TCP,
no model, no torch) on loopback. Every denoiser takes a fixed modelled time per request
(--stage-seconds); encoders and decoders take --edge-seconds, and there are enough of them not to
bottleneck. Denoisers are added to the running deployment (no head restart) for each N in
--denoisers; at each N a closed loop of 2 x N clients submits requests straight to the head's
frontend (no HTTP) and the throughput over a steady window is compared with the ideal
N / --stage-seconds. At the largest N it also reads the head's CPU seconds per request
(/proc/<pid>/stat) and the memory of the simulated workers (/proc/<pid>/smaps_rollup).

    python bench/scaling_bench.py [--denoisers 1,2,4,8,16,32] [--stage-seconds 0.5] [--window 6]

Prints a table and writes bench/results/scaling.json.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from head_bench import Frontend  # noqa: E402

from triptych.roles import Role  # noqa: E402
from triptych_dev.localdeploy import LocalDeployment, local_deployment, wait_until_ready  # noqa: E402
from triptych_dev.tiny_models import write_tiny_models  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15 of stat(5))


def memory_kib(pid: int) -> dict[str, int]:
    """Rss, Pss and private (USS) memory of a process in KiB, from /proc/<pid>/smaps_rollup."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split()[:2]
        values[name.rstrip(":")] = int(value)
    return {"rss": values["Rss"], "pss": values["Pss"], "uss": values["Private_Clean"] + values["Private_Dirty"]}


async def closed_loop(front: Frontend, clients: int, warmup: float, window: float) -> dict[str, float]:
    """`clients` loops each submitting a request as soon as its last one ends; counts completions in the window."""
    done: list[float] = []
    stop = asyncio.Event()
    issued = 0

    async def client(i: int) -> None:
        nonlocal issued
        while not stop.is_set():
            issued += 1
            await asyncio.wait_for(front.request(f"c{clients}-{i}-{issued}"), timeout=60)
            done.append(time.monotonic())

    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    await asyncio.sleep(warmup)
    start = time.monotonic()
    await asyncio.sleep(window)
    end = time.monotonic()
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)  # bounded: every request ends or fails
    completed = sum(1 for t in done if start <= t < end)
    return {"completed": completed, "seconds": end - start, "window_start": start, "window_end": end}


def measure(dep: LocalDeployment, n: int, args: argparse.Namespace) -> dict[str, Any]:
    head_pid = dep.workers(Role.SERVER)[0].popen.pid
    pids = [p.popen.pid for p in dep.procs]

    async def run() -> tuple[dict[str, float], float, float]:
        front = Frontend(f"tcp://127.0.0.1:{dep.scheduler_port}")
        try:
            task = asyncio.create_task(closed_loop(front, 2 * n, args.warmup, args.window))
            await asyncio.sleep(args.warmup)  # the window starts now
            head_before, all_before = cpu_seconds(head_pid), sum(cpu_seconds(p) for p in pids)
            await asyncio.sleep(args.window)
            head_after, all_after = cpu_seconds(head_pid), sum(cpu_seconds(p) for p in pids)
            result = await task
        finally:
            front.reader.cancel()
        return result, head_after - head_before, all_after - all_before

    loop, head_cpu, all_cpu = asyncio.run(run())
    rps = loop["completed"] / loop["seconds"]
    ideal = n / args.stage_seconds
    return {
        "denoisers": n,
        "clients": 2 * n,
        "completed": loop["completed"],
        "window_s": loop["seconds"],
        "throughput_rps": rps,
        "ideal_rps": ideal,
        "of_linear": rps / ideal,
        "head_cpu_ms_per_request": 1e3 * head_cpu / max(1, loop["completed"]),
        "head_cpu_share": head_cpu / loop["seconds"],  # of one core
        "all_cpu_share": all_cpu / loop["seconds"],  # every process of the deployment, in cores
    }


def simulated_role_flags(stage_seconds: float, edge_seconds: float) -> dict[Role, tuple[str, ...]]:
    """Simulated workers' flags: a fixed modelled time per request, the denoiser's and the edges'."""
    fixed = ("--simulate-seconds-per-unit", "0")
    return {
        Role.ENCODER: ("--simulate-seconds", str(edge_seconds), *fixed),
        Role.DENOISER: ("--simulate-seconds", str(stage_seconds), *fixed),
        Role.DECODER: ("--simulate-seconds", str(edge_seconds), *fixed),
    }


def grow(dep: LocalDeployment, n: int, timeout: float = 120) -> None:
    """Start denoisers (on the head's spare ports) until n run, and wait until the head sees every one."""
    while len(dep.workers(Role.DENOISER)) < n:
        dep.start_worker(Role.DENOISER)
    wait_until_ready(dep, len(dep.procs) - 1, timeout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--denoisers", default="1,2,4,8,16,32", help="comma-separated N, ascending")
    p.add_argument("--stage-seconds", type=float, default=0.5, help="modelled denoise time per request")
    p.add_argument("--edge-seconds", type=float, default=0.005, help="modelled encode and decode time per request")
    p.add_argument("--encoders", type=int, default=2)
    p.add_argument("--decoders", type=int, default=2)
    p.add_argument("--warmup", type=float, default=1.5, help="seconds of load before each window")
    p.add_argument("--window", type=float, default=6.0, help="seconds each throughput is measured over")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "scaling.json")
    args = p.parse_args()
    sizes = sorted(int(x) for x in args.denoisers.split(","))
    (flux,) = write_tiny_models(ROOT / ".models", families=["tiny-flux"])
    role_flags = simulated_role_flags(args.stage_seconds, args.edge_seconds)
    counts = {Role.ENCODER: args.encoders, Role.DENOISER: sizes[0], Role.DECODER: args.decoders}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        with local_deployment(
            flux, Path(tmp), counts, worker_flags=("--simulate",), role_flags=role_flags,
            spare={Role.DENOISER: sizes[-1] - sizes[0]}, ready_timeout=300,
        ) as dep:  # fmt: skip
            for n in sizes:
                grow(dep, n)
                row = measure(dep, n, args)
                rows.append(row)
                print(
                    f"  N={n:3d}  {row['throughput_rps']:7.2f} req/s  ideal {row['ideal_rps']:6.1f}  "
                    f"{100 * row['of_linear']:5.1f}% of linear  head {row['head_cpu_ms_per_request']:.2f} ms CPU/req",
                    flush=True,
                )
            workers = [p for p in dep.procs if p.role is not Role.SERVER]
            memory = [memory_kib(p.popen.pid) for p in workers]
            head_memory = memory_kib(dep.workers(Role.SERVER)[0].popen.pid)
    largest = rows[-1]
    result = {
        "stage_seconds": args.stage_seconds,
        "edge_seconds": args.edge_seconds,
        "encoders": args.encoders,
        "decoders": args.decoders,
        "window_s": args.window,
        "rows": rows,
        "head_cpu_ms_per_request_at_largest": largest["head_cpu_ms_per_request"],
        "simulated_workers": len(memory),
        "worker_rss_mib_median": statistics.median(m["rss"] for m in memory) / 1024,
        "worker_pss_mib_median": statistics.median(m["pss"] for m in memory) / 1024,
        "worker_uss_mib_median": statistics.median(m["uss"] for m in memory) / 1024,
        "workers_pss_mib_total": sum(m["pss"] for m in memory) / 1024,
        "head_rss_mib": head_memory["rss"] / 1024,
    }
    print(
        f"\nscaling: one head, N simulated denoisers of {args.stage_seconds:g} s/request, {args.encoders} encoders "
        f"and {args.decoders} decoders of {args.edge_seconds:g} s, closed loop of 2N clients, {args.window:g} s windows"
    )
    print("| denoisers | clients | requests/s | ideal (N / stage time) | of linear | head CPU per request |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['denoisers']} | {r['clients']} | {r['throughput_rps']:.2f} | {r['ideal_rps']:.1f} | "
            f"{100 * r['of_linear']:.1f}% | {r['head_cpu_ms_per_request']:.2f} ms |"
        )
    print(
        f"simulated workers ({len(memory)}): RSS {result['worker_rss_mib_median']:.1f} MiB, "
        f"PSS {result['worker_pss_mib_median']:.1f} MiB, private (USS) {result['worker_uss_mib_median']:.1f} MiB "
        f"each (median); PSS of all {result['workers_pss_mib_total']:.0f} MiB; "
        f"head RSS {result['head_rss_mib']:.0f} MiB"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
