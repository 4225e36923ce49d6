"""Replicated heads benchmark: throughput and overhead with 1, 2 and 4 heads over the same kind of
simulated workers, each head's ratio to one head measured in the same run.

For each H in --heads, a deployment of H heads and simulated workers (`triptych serve --simulate`:
real processes, ZMQ and Mooncake TCP, no model) on loopback, every worker serving every head.
Clients submit straight to the heads' frontends (no HTTP), spread evenly over the heads:
- saturation: a closed loop of 2 x --denoisers clients; throughput against the ideal
  denoisers / --stage-seconds;
- fixed rate: --rate-share of that ideal, one request every 1/rate seconds (open loop); each
  request's overhead is its latency less the modelled work (stage + 2 x edge seconds), p50 and p99.

    python bench/heads_bench.py [--heads 1,2,4] [--denoisers 4] [--stage-seconds 0.2] [--window 5]

Prints a table and writes bench/results/heads.json. On a 2-core machine every head and worker
shares two cores: the ratios say what replicating the head costs here, not what it buys on a
cluster where each head has its own node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from head_bench import Frontend  # noqa: E402
from scaling_bench import closed_loop, simulated_role_flags  # noqa: E402

from triptych.roles import Role  # noqa: E402
from triptych_dev.localdeploy import LocalDeployment, local_deployment  # noqa: E402
from triptych_dev.tiny_models import write_tiny_models  # noqa: E402


class Spread:
    """Requests spread round-robin over several heads' frontends (as a Service spreads connections)."""

    def __init__(self, fronts: list[Frontend]):
        self.fronts = fronts
        self.next = 0

    async def request(self, rid: str) -> Any:
        front = self.fronts[self.next % len(self.fronts)]
        self.next += 1
        return await front.request(rid)


async def fixed_rate(spread: Spread, rate: float, window: float) -> list[float]:
    """Latencies of requests sent every 1/rate seconds for `window` seconds (each bounded to 60 s)."""
    latencies: list[float] = []

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        await asyncio.wait_for(spread.request(f"rate-{i}"), timeout=60)
        latencies.append(time.perf_counter() - t0)

    tasks = []
    start = time.perf_counter()
    for i in range(int(rate * window)):
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return latencies


def measure(dep: LocalDeployment, args: argparse.Namespace) -> dict[str, Any]:
    ideal = args.denoisers / args.stage_seconds
    work = args.stage_seconds + 2 * args.edge_seconds

    async def run() -> tuple[dict[str, float], list[float]]:
        fronts = [Frontend(f"tcp://127.0.0.1:{port}") for port in dep.head_scheduler_ports]
        spread = Spread(fronts)
        try:
            saturated = await closed_loop(spread, 2 * args.denoisers, args.warmup, args.window)  # type: ignore[arg-type]
            latencies = await fixed_rate(spread, args.rate_share * ideal, args.window)
        finally:
            for front in fronts:
                front.reader.cancel()
        return saturated, latencies

    saturated, latencies = asyncio.run(run())
    overhead = sorted(max(0.0, lat - work) * 1e3 for lat in latencies)
    rps = saturated["completed"] / saturated["seconds"]
    return {
        "heads": len(dep.head_scheduler_ports),
        "throughput_rps": rps,
        "of_ideal": rps / ideal,
        "overhead_p50_ms": statistics.median(overhead),
        "overhead_p99_ms": overhead[min(len(overhead) - 1, int(0.99 * len(overhead)))],
        "requests_at_rate": len(latencies),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="1,2,4", help="comma-separated head counts; the first is the baseline")
    p.add_argument("--denoisers", type=int, default=4)
    p.add_argument("--stage-seconds", type=float, default=0.2, help="modelled denoise time per request")
    p.add_argument("--edge-seconds", type=float, default=0.005, help="modelled encode and decode time")
    p.add_argument("--rate-share", type=float, default=0.5, help="the fixed rate, as a share of the ideal throughput")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--window", type=float, default=5.0)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "heads.json")
    args = p.parse_args()
    (flux,) = write_tiny_models(ROOT / ".models", families=["tiny-flux"])
    role_flags = simulated_role_flags(args.stage_seconds, args.edge_seconds)
    counts = {Role.ENCODER: 2, Role.DENOISER: args.denoisers, Role.DECODER: 2}
    rows = []
    for heads in (int(h) for h in args.heads.split(",")):
        with tempfile.TemporaryDirectory(prefix="heads-bench-") as tmp:
            with local_deployment(
                flux, Path(tmp), counts, worker_flags=("--simulate", "--device", "cpu"), role_flags=role_flags,
                heads=heads, ready_timeout=120,
            ) as dep:  # fmt: skip
                rows.append(measure(dep, args))
        base = rows[0]
        row = rows[-1]
        row["throughput_vs_first"] = row["throughput_rps"] / base["throughput_rps"]
        print(
            f"{row['heads']} heads: {row['throughput_rps']:.1f} req/s ({row['of_ideal']:.0%} of ideal, "
            f"{row['throughput_vs_first']:.2f}x of {base['heads']} head(s)), overhead at "
            f"{args.rate_share:.0%} load p50 {row['overhead_p50_ms']:.1f} ms p99 {row['overhead_p99_ms']:.1f} ms",
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
