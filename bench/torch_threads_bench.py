"""A CPU role's stage under a CPU quota: torch's threads fitted to the quota against torch's default and more.

    python bench/torch_threads_bench.py [--quota-cpus 1] [--threads 2,8] [--size 256] [--steps 4] [--runs 5]

Runs the stock diffusers pipeline of the tiny FLUX package (text encoding, denoising, VAE decode
on the CPU: what CPU workers compute) in a fresh process per configuration, alternated twice,
each inside this process's cgroup: with --quota-cpus N (root) a new cgroup limited to N CPUs, as a
pod with a CPU limit runs. Configurations: `fitted` (what a worker does before it loads a model:
`worker/triptych_worker/cpu_threads.py`, the quota rounded up), torch's default (one thread per
host core, whatever the quota) and each count of --threads. Prints the median milliseconds per
image of each and its ratio to `fitted` (the baseline, same run). Results go to --json (default
bench/results/torch_threads.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "devtools"), str(ROOT / "worker")]

from cgroup_quota import limited_to  # noqa: E402

from triptych.cpus import cpu_quota  # noqa: E402

DEFAULT_JSON = ROOT / "bench" / "results" / "torch_threads.json"

# One configuration in its own interpreter: its threads set before the model loads, as a worker's.
CHILD = """
import json, statistics, sys, time
import torch
threads, model, size, steps, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if threads == "fitted":
    from triptych_worker.cpu_threads import fit_torch_threads
    fit_torch_threads()
elif threads != "default":
    torch.set_num_threads(int(threads))
from diffusers import FluxPipeline
pipe = FluxPipeline.from_pretrained(model)
def once():
    t0 = time.perf_counter()
    pipe("a red square", height=size, width=size, num_inference_steps=steps,
         generator=torch.Generator().manual_seed(0), output_type="np")
    return time.perf_counter() - t0
once()
print(json.dumps({"threads": torch.get_num_threads(), "ms": statistics.median(once() for _ in range(runs)) * 1e3}))
"""


def run_child(threads: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / d) for d in ("", "worker"))
    cmd = [sys.executable, "-c", CHILD, threads, str(model), str(args.size), str(args.steps), str(args.runs)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{threads} threads: exited {out.returncode}:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quota-cpus", type=float, default=0, help="a cgroup CPU quota of this many CPUs (root)")
    parser.add_argument("--threads", default="2,8", help="more thread counts to compare (comma-separated)")
    parser.add_argument("--size", type=int, default=256, help="image width and height, px")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5, help="images per configuration and round (median)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    try:
        counts = [str(int(x)) for x in args.threads.split(",") if x]
    except ValueError:
        parser.error(f"--threads takes comma-separated counts, e.g. 2,8; got {args.threads!r}")
    if min(args.size, args.steps, args.runs, *(int(c) for c in counts)) < 1 or args.quota_cpus < 0:
        parser.error("--size, --steps, --runs and --threads must be >= 1, --quota-cpus >= 0")

    from triptych_dev.tiny_models import write_tiny_models

    (model,) = write_tiny_models(ROOT / ".models", families=["tiny-flux"])
    configs = ["fitted", "default", *counts]
    ms: dict[str, list[float]] = {c: [] for c in configs}
    threads: dict[str, int] = {}
    with ExitStack() as stack:
        if args.quota_cpus:
            try:
                stack.enter_context(limited_to(args.quota_cpus, "triptych-torch-threads-bench"))
            except OSError as exc:
                parser.error(f"--quota-cpus: {exc}")
        quota = cpu_quota()
        print(f"host CPUs {os.cpu_count()}, quota {quota} CPUs; tiny FLUX {args.size}x{args.size}, {args.steps} steps")
        for _ in range(2):  # alternated, so drift falls on every configuration
            for config in configs:
                got = run_child(config, model, args)
                ms[config].append(got["ms"])
                threads[config] = got["threads"]
    base = statistics.median(ms["fitted"])
    print(f"\n{'configuration':14s} {'threads':>7s} {'ms per image':>13s} {'x fitted':>9s}")
    rows = []
    for config in configs:
        m = statistics.median(ms[config])
        rows.append({"config": config, "threads": threads[config], "ms": m, "ratio": m / base, "rounds": ms[config]})
        print(f"{config:14s} {threads[config]:7d} {m:13.1f} {m / base:9.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"quota_cpus": quota, "size": args.size, "steps": args.steps, "rows": rows}, indent=2)
    )
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
