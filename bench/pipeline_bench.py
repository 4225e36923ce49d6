"""Disaggregated vs monolithic latency for the same request, measured side by side in one run.

Starts `triptych serve` monolithic (one process) and the disaggregated deployment (head +
encoder + denoiser + decoder processes, Mooncake TCP between workers) on the same model, side by
side, and sends the same request --requests times to each, alternating between them so that
both see the same machine (on a shared host its speed drifts by tens of percent within
minutes). Prints median latencies and their ratio, twice: with one OpenMP thread per process
(equal compute on both sides, so the difference is what disaggregation adds) and with torch's
default threads (on a host with few cores, the worker processes' idle OpenMP threads spin
against each other, which a GPU deployment does not see).

    python bench/pipeline_bench.py [--model tiny-flux] [--size 256x256] [--steps 8] [--requests 10]
                                   [--omp-threads both|1|default]

`--model` is a tiny package's name or a package directory (a Wan package is asked for videos of
`--frames` frames); `--device cuda` runs every process on the GPU (scripts/gpu-check.sh does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from triptych_dev.localdeploy import local_deployment, local_monolithic  # noqa: E402
from triptych_dev.tiny_models import write_tiny_models  # noqa: E402


@contextmanager
def threads_per_process(threads: str | None) -> Iterator[None]:
    """OMP_NUM_THREADS for the processes started inside (None: torch's default, one per core)."""
    saved = os.environ.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = threads
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved


def post(client: httpx.Client, body: dict) -> float:
    """Seconds until the request's pixels are ready: an image's response, or a video job's completion."""
    t0 = time.perf_counter()
    if "num_frames" not in body:
        client.post("/v1/images/generations", json=body).raise_for_status()
        return time.perf_counter() - t0
    job = client.post("/v1/videos", json=body).raise_for_status().json()
    while job["status"] not in ("completed", "failed", "cancelled"):
        time.sleep(0.02)
        job = client.get(f"/v1/videos/{job['id']}").raise_for_status().json()
    if job["status"] != "completed":
        raise RuntimeError(f"video job {job['id']} {job['status']}: {job}")
    return time.perf_counter() - t0


def side_by_side(model: Path, tmp: Path, body: dict, n: int, device: str = "cpu") -> tuple[list[float], list[float]]:
    """Latencies of n requests to each deployment, one to each in turn (after one warm-up each)."""
    flags = ("--device", device)
    with (
        local_monolithic(model, tmp / "mono", flags=flags) as mono_dep,
        mono_dep.client(600) as mono,
        local_deployment(model, tmp / "disagg", worker_flags=flags) as disagg_dep,
        disagg_dep.client(600) as disagg,
    ):
        post(mono, body), post(disagg, body)
        pairs = [(post(mono, body), post(disagg, body)) for _ in range(n)]
    return [m for m, _ in pairs], [d for _, d in pairs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-flux")
    p.add_argument("--size", default="256x256")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "pipeline.json")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--frames", type=int, default=17, help="frames per video (Wan packages)")
    p.add_argument(
        "--omp-threads",
        choices=("both", "1", "default"),
        default="both",
        help="OpenMP threads per process on CPU: one, torch's default, or both in turn (default)",
    )
    args = p.parse_args()
    if Path(args.model).is_dir():
        model = Path(args.model)
    else:
        (model,) = write_tiny_models(ROOT / ".models", families=[args.model])
    body = {"prompt": "a lighthouse at dusk", "size": args.size, "seed": 1, "num_inference_steps": args.steps}
    if json.loads((model / "model_index.json").read_text())["_class_name"] == "WanPipeline":
        body["num_frames"] = args.frames
    results = []
    print(f"{args.model} {args.size} {args.steps} steps, median of {args.requests} requests to each, alternating, "
          f"{args.device}")  # fmt: skip
    # On a GPU the OpenMP threads only feed it: one setting says it all.
    modes = {"both": ("1", None), "1": ("1",), "default": (None,)}[args.omp_threads]
    for threads in modes if args.device == "cpu" else (None,):
        with threads_per_process(threads), tempfile.TemporaryDirectory() as tmp:
            mono_s, disagg_s = side_by_side(model, Path(tmp), body, args.requests, args.device)
        mono, disagg = statistics.median(mono_s), statistics.median(disagg_s)
        added = (disagg - mono) * 1e3
        results.append({"omp_threads": threads or "default", "monolithic_s": mono, "disaggregated_s": disagg,
                        "ratio": disagg / mono, "added_ms": added})  # fmt: skip
        print(f"  OpenMP threads per process: {threads or 'default'}")
        print(f"    monolithic     {mono * 1e3:9.1f} ms")
        print(f"    disaggregated  {disagg * 1e3:9.1f} ms   ratio {disagg / mono:.3f}  ({added:+.1f} ms)")
    result = {**{k: getattr(args, k) for k in ("model", "size", "steps", "requests", "device")}, "runs": results}
    if "num_frames" in body:
        result["frames"] = args.frames
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
