"""Disaggregated vs monolithic latency for the same request, measured side by side in one run.

Starts `triptych serve` monolithic (one process) and the disaggregated deployment (head +
encoder + denoiser + decoder processes, Mooncake TCP between workers) on the same model, sends
the same request --requests times to each, and prints median latencies and their ratio.

    python bench/pipeline_bench.py [--model tiny-flux] [--size 256x256] [--steps 8] [--requests 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from triptych.localdeploy import local_deployment, local_monolithic  # noqa: E402
from triptych.tiny_models import write_tiny_models  # noqa: E402


def timed_requests(client: httpx.Client, body: dict, n: int) -> list[float]:
    client.post("/v1/images/generations", json=body).raise_for_status()  # warm-up
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.post("/v1/images/generations", json=body).raise_for_status()
        out.append(time.perf_counter() - t0)
    return out


def monolithic(model: Path, tmp: Path, body: dict, n: int) -> list[float]:
    with local_monolithic(model, tmp / "mono", flags=("--device", "cpu")) as dep, dep.client(600) as c:
        return timed_requests(c, body, n)


def disaggregated(model: Path, tmp: Path, body: dict, n: int) -> list[float]:
    with local_deployment(model, tmp / "disagg", worker_flags=("--device", "cpu")) as dep, dep.client(600) as c:
        return timed_requests(c, body, n)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-flux")
    p.add_argument("--size", default="256x256")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "pipeline.json")
    args = p.parse_args()
    (model,) = write_tiny_models(ROOT / ".models", families=[args.model])
    body = {"prompt": "a lighthouse at dusk", "size": args.size, "seed": 1, "num_inference_steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        mono = statistics.median(monolithic(model, Path(tmp), body, args.requests))
        disagg = statistics.median(disaggregated(model, Path(tmp), body, args.requests))
    result = {
        **{k: getattr(args, k) for k in ("model", "size", "steps", "requests")},
        **{"monolithic_s": mono, "disaggregated_s": disagg, "ratio": disagg / mono},
        "added_ms": (disagg - mono) * 1e3,
    }
    print(f"{args.model} {args.size} {args.steps} steps, median of {args.requests} sequential requests, CPU")
    print(f"  monolithic     {mono * 1e3:9.1f} ms")
    print(f"  disaggregated  {disagg * 1e3:9.1f} ms   ratio {disagg / mono:.3f}  (+{(disagg - mono) * 1e3:.1f} ms)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
