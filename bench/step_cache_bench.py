"""Step caching: time per request and how far the pixels move, each step cache mode vs none, in one run.

    python bench/step_cache_bench.py [--models tiny-flux,wan-medium] [--wan-package PATH] [--steps 20]
                                     [--size 256x256] [--frames 9] [--rounds 3] [--device cpu|cuda] [--json PATH]

Runs whole requests (text encoding, denoising, decoding: what a client waits for) through the
in-process stages of monolithic mode, for every step cache mode the model's family serves at its
default knob (first_block 0.05, pyramid_attention_broadcast every 2, taylorseer every 5) and
without one, interleaved round by round so every mode sees the same machine; medians over
`--rounds` after a warm-up round. Models:

- tiny-flux: the tiny FLUX.1 package (make models), 1 double and 1 single block: the hooks' own cost;
- wan-medium: the tiny Wan package with parallel_bench's random-weight transformer (Wan2.1's layout,
  8 heads of 32, 4 layers), written once under bench/results/;
- `--wan-package PATH`: any Wan2.1 package, e.g. the full Wan2.1-1.3B shape `python bench/random_wan.py
  --out .models/random-wan-1.3b` writes (too slow for a CPU at useful sizes: a GPU run).

Prints per model and mode: seconds per request, its ratio to none, the share of attention
computations skipped (the denoiser's own count, as /metrics has it), and the pixels' distance from
the uncached ones of the same seed: PSNR in dB (inf: identical) and the mean absolute difference in
levels. Random weights make noise, not pictures: the figures say what a mode skips and how much it
moves the output, not how a picture looks. Writes bench/results/step_cache_bench.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


def package(name: str, wan_package: Path | None) -> Path:
    from triptych_dev.tiny_models import write_tiny_models

    if name == "wan-medium":
        from parallel_bench import bench_package  # bench/ is the script's folder, first on sys.path

        return bench_package(RESULTS / "parallel-bench-wan")
    if name == "wan-package":
        assert wan_package is not None
        return wan_package
    return next(p for p in write_tiny_models(ROOT / ".models", families=[name]) if p.name == name)


def psnr(a: Any, b: Any) -> float:
    mse = float(((a.astype("float64") - b.astype("float64")) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def bench_model(name: str, path: Path, opts: argparse.Namespace) -> dict[str, Any]:
    from triptych.families import read_rules
    from triptych.params import GenerationParams
    from triptych.roles import Role
    from triptych_worker.pipeline import load_role_pipeline
    from triptych_worker.stages import PIXELS, StageBatch

    rules = read_rules(path)
    pipeline = load_role_pipeline(str(path), Role.MONOLITHIC, opts.device)
    width, height = (int(v) for v in opts.size.lower().split("x"))
    video = rules.kind == "video"
    base = GenerationParams(
        "a lighthouse at dusk, waves breaking on the rocks", width=width, height=height, seed=7,
        num_inference_steps=opts.steps, guidance_scale=5.0 if video else 3.5, num_frames=opts.frames if video else 1,
    )  # fmt: skip
    modes = ("none", *rules.step_cache_modes)
    times: dict[str, list[float]] = {m: [] for m in modes}
    pixels: dict[str, Any] = {}
    for round_ in range(opts.rounds + 1):
        for mode in modes:
            params = GenerationParams(**{**_fields(base), "step_cache": mode})
            started = time.perf_counter()
            out = pipeline.run(StageBatch(params)).tensors[PIXELS]
            if round_:  # the first round warms up
                times[mode].append(time.perf_counter() - started)
            pixels[mode] = out.cpu().numpy()
    counts = {s.mode: s for s in pipeline.step_cache.stats()} if pipeline.step_cache else {}
    none_s = statistics.median(times["none"])
    rows = {}
    for mode in modes:
        seconds = statistics.median(times[mode])
        stats = counts.get(mode)
        skipped = stats.skipped / (stats.skipped + stats.computed) if stats and stats.computed else 0.0
        diff = abs(pixels[mode].astype("int16") - pixels["none"].astype("int16"))
        rows[mode] = {
            "seconds": seconds, "vs_none": seconds / none_s, "skipped_share": skipped,
            "psnr_db": psnr(pixels[mode], pixels["none"]), "mean_abs_levels": float(diff.mean()),
        }  # fmt: skip
    return {"model": name, "path": str(path), "pipeline": rules.pipeline_class, "size": opts.size,
            "frames": base.num_frames, "steps": opts.steps, "modes": rows}  # fmt: skip


def _fields(params: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.structs.asdict(params)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny-flux,wan-medium", help="of tiny-flux, tiny-wan, wan-medium")
    ap.add_argument("--wan-package", type=Path, help="also bench this Wan2.1 package (a full-size-shaped one)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--size", default="256x256")
    ap.add_argument("--frames", type=int, default=9, help="video models' frames")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    ap.add_argument("--json", type=Path, default=RESULTS / "step_cache_bench.json")
    opts = ap.parse_args()

    names = [n for n in opts.models.split(",") if n] + (["wan-package"] if opts.wan_package else [])
    results = []
    for name in names:
        result = bench_model(name, package(name, opts.wan_package), opts)
        results.append(result)
        frames = f"x{result['frames']} frames" if result["frames"] > 1 else ""
        print(f"\n{name} ({result['pipeline']}, {opts.size}{frames}, {opts.steps} steps, {opts.device})")
        print(f"{'mode':<30} {'s/request':>10} {'vs none':>8} {'skipped':>8} {'PSNR dB':>8} {'mean |d|':>9}")
        for mode, row in result["modes"].items():
            print(f"{mode:<30} {row['seconds']:>10.3f} {row['vs_none']:>8.2f} {row['skipped_share']:>8.0%} "
                  f"{row['psnr_db']:>8.1f} {row['mean_abs_levels']:>9.2f}")  # fmt: skip
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "device": opts.device}
    opts.json.write_text(json.dumps({"machine": machine, "results": results}, indent=2))
    print(f"\nwrote {opts.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
