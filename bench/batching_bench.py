"""Batching: throughput (images/s) of one worker's stages vs the batch size, tiny FLUX.

    python bench/batching_bench.py [--device cpu|cuda] [--sizes 64x64,256x256] [--batch-sizes 1,2,4,8]
                                   [--images 8] [--steps 4] [--rounds 5] [--stat fastest|median] [--threads N]
                                   [--json PATH]

Runs every stage of the tiny FLUX package (text encoders, DiT, VAE; RolePipeline.run_many, the
code a worker runs for a batch) over `--images` compatible requests (different prompts and seeds),
as images/B batched forwards of B requests each. Each round times every batch size in turn, so all
of them see the same machine; the figure is the fastest round after a warm-up round (on a shared
machine the fastest round is the least disturbed one; --stat median for the median). Prints,
per size and batch size, images/s and the ratio to batch size 1 of the same run, and the same per
CPU-second of this process (all its threads: on a shared CPU, what batching saves of the work
itself, whatever else runs), and writes bench/results/batching_bench.json (or --json).

The tiny model is small enough that on a CPU its per-call overheads (Python, kernel launches,
tokenizers) weigh as much as its arithmetic: the ratios show what batching saves of those, not
what it saves on a GPU-sized DiT. `make gpu-check` runs it with --device cuda.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


def parse_size(text: str) -> tuple[int, int]:
    width, height = (int(v) for v in text.lower().split("x"))
    return width, height


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--sizes", default="64x64,256x256", help="WIDTHxHEIGHT list (default 64x64,256x256)")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--images", type=int, default=8, help="requests per measurement (a multiple of every batch size)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    ap.add_argument("--stat", choices=("fastest", "median"), default="fastest", help="which round's time counts")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads (default: torch's own); 1 keeps idle OpenMP threads from spinning "
                         "on a shared CPU, which would count as CPU time")  # fmt: skip
    ap.add_argument("--json", type=Path, default=RESULTS / "batching_bench.json")
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if any(b < 1 or args.images % b for b in batch_sizes):
        ap.error(f"--images {args.images} must be a multiple of every batch size ({args.batch_sizes})")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from triptych.params import GenerationParams
    from triptych.roles import Role
    from triptych_dev.tiny_models import write_tiny_models
    from triptych_worker.pipeline import load_role_pipeline
    from triptych_worker.stages import StageBatch

    model = next(p for p in write_tiny_models(ROOT / ".models", families=["tiny-flux"]) if p.name == "tiny-flux")
    pipeline = load_role_pipeline(str(model), Role.MONOLITHIC, args.device)

    def run(size: tuple[int, int], batch_size: int) -> tuple[float, float]:
        """Wall-clock and CPU seconds (this process, all threads) for --images requests as batches of
        `batch_size`."""
        width, height = size
        params = [
            GenerationParams(f"a lighthouse number {i}", width=width, height=height, seed=i,
                             num_inference_steps=args.steps, max_sequence_length=64)
            for i in range(args.images)
        ]  # fmt: skip
        if args.device == "cuda":
            torch.cuda.synchronize()
        started, cpu_started = time.perf_counter(), time.process_time()
        for start in range(0, len(params), batch_size):
            batches = [StageBatch(params=p) for p in params[start : start + batch_size]]
            errors = pipeline.run_many(batches)
            if any(errors):
                raise RuntimeError(f"batch of {batch_size} failed: {errors}")
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started, time.process_time() - cpu_started

    results = []
    for size_text in args.sizes.split(","):
        size = parse_size(size_text)
        times: dict[int, list[float]] = {b: [] for b in batch_sizes}
        cpu: dict[int, list[float]] = {b: [] for b in batch_sizes}
        for round_ in range(args.rounds + 1):
            for b in batch_sizes:
                seconds, cpu_seconds = run(size, b)
                if round_:  # the first round warms up
                    times[b].append(seconds)
                    cpu[b].append(cpu_seconds)
        pick = min if args.stat == "fastest" else statistics.median
        base = args.images / pick(times[batch_sizes[0]])
        cpu_base = args.images / pick(cpu[batch_sizes[0]])
        for b in batch_sizes:
            rate, cpu_rate = args.images / pick(times[b]), args.images / pick(cpu[b])
            results.append({"size": size_text, "batch_size": b, "images_per_s": round(rate, 2),
                            "ratio": round(rate / base, 2), "images_per_cpu_s": round(cpu_rate, 2),
                            "cpu_ratio": round(cpu_rate / cpu_base, 2)})  # fmt: skip
    what = f"{args.images} images each, {args.device}, {args.stat} of {args.rounds} rounds"
    print(f"tiny FLUX, {args.steps} steps, {what}")
    print(f"{'size':>9} {'batch':>5} {'images/s':>9} {'vs batch 1':>10} {'images/CPU-s':>12} {'vs batch 1':>10}")
    for r in results:
        print(f"{r['size']:>9} {r['batch_size']:>5} {r['images_per_s']:>9.2f} {r['ratio']:>9.2f}x "
              f"{r['images_per_cpu_s']:>12.2f} {r['cpu_ratio']:>9.2f}x")  # fmt: skip
    report = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "images": args.images,
        "rounds": args.rounds,
        "stat": args.stat,
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
