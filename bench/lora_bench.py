"""LoRA adapters: what switching to an adapter the denoiser must load costs, vs one it already holds, in one run.

    python bench/lora_bench.py [--models DIR] [--size 64x64] [--steps 4] [--rounds 5] [--activations 40]
                               [--device cpu|cuda] [--json PATH]

Runs whole requests (text encoding, denoising, decoding) through the in-process stages of monolithic
mode on the tiny FLUX.1 package with its tiny adapters (`make models` writes both), interleaved round
by round so every case sees the same machine; medians over `--rounds` after a warm-up round:

- none: no adapter (the base model);
- held: flux-ink at weight 0.8, already loaded (the cache holds it): set_adapters, enable, disable;
- switch: flux-ink and flux-paper in turn on a denoiser whose --lora-cache-bytes holds only one of
  them, so every request unloads one adapter and loads the other (load_lora_weights from disk).

Prints seconds per request and each case's ratio to `held`, the switch's own cost (switch - held)
in milliseconds, and the activation alone (entering and leaving a request's adapters, no denoising),
`--activations` times per case: the figure a loaded machine disturbs least. The tiny adapters are a
few KiB: the figure is the fixed cost of a load (reading the file, peft wrapping each targeted layer,
unloading the other), not the bytes of a FLUX.1 adapter (tens of MiB), which add their read and copy.
Writes bench/results/lora_bench.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
CASES = ("none", "held", "switch")


def bench(opts: argparse.Namespace) -> dict[str, Any]:
    from triptych.lora import LoraCatalog
    from triptych.params import GenerationParams, LoraWeight
    from triptych.roles import Role
    from triptych_dev.tiny_models import write_tiny_models
    from triptych_dev.tiny_models.loras import write_tiny_loras
    from triptych_worker.pipeline import load_role_pipeline
    from triptych_worker.stages import StageBatch

    packages = {p.name: p for p in write_tiny_models(opts.models, families=["tiny-flux", "tiny-wan"])}
    adapters = write_tiny_loras(opts.models, packages)
    catalog = LoraCatalog({name: str(adapters / name) for name in ("flux-ink", "flux-paper")})
    model = str(packages["tiny-flux"])
    roomy = load_role_pipeline(model, Role.MONOLITHIC, opts.device, 0, catalog, 1 << 30)
    for name in ("flux-ink", "flux-paper"):  # their sizes, to give the other pipeline room for one only
        with roomy.loras.applied(GenerationParams("x", 16, 16, loras=(LoraWeight(name),))):
            pass
    sizes = roomy.loras.sizes()
    tight = load_role_pipeline(model, Role.MONOLITHIC, opts.device, 0, catalog, max(sizes.values()))
    width, height = (int(v) for v in opts.size.lower().split("x"))

    def request(seed: int, *loras: str) -> GenerationParams:
        return GenerationParams(
            "a lighthouse at dusk", width=width, height=height, seed=seed, num_inference_steps=opts.steps,
            loras=tuple(LoraWeight(name, 0.8) for name in loras),
        )  # fmt: skip

    times: dict[str, list[float]] = {case: [] for case in CASES}
    for round_ in range(opts.rounds + 1):
        switch_to = ("flux-ink", "flux-paper")[round_ % 2]
        runs = {"none": (roomy, request(round_)), "held": (roomy, request(round_, "flux-ink")),
                "switch": (tight, request(round_, switch_to))}  # fmt: skip
        for case, (pipeline, params) in runs.items():
            started = time.perf_counter()
            pipeline.run(StageBatch(params))
            if round_:  # the first round warms up
                times[case].append(time.perf_counter() - started)
    # The activation alone (what a request's denoising waits for before its first step), many times.
    activation: dict[str, list[float]] = {"held": [], "switch": []}
    for i in range(opts.activations + 1):
        for case, pipeline, name in (("held", roomy, "flux-ink"), ("switch", tight, ("flux-ink", "flux-paper")[i % 2])):
            started = time.perf_counter()
            with pipeline.loras.applied(request(i, name)):
                pass
            if i:
                activation[case].append(time.perf_counter() - started)
    held_s = statistics.median(times["held"])
    rows = {case: {"seconds": statistics.median(times[case]), "vs_held": statistics.median(times[case]) / held_s}
            for case in CASES}  # fmt: skip
    return {
        "model": model, "size": opts.size, "steps": opts.steps, "rounds": opts.rounds, "adapter_bytes": sizes,
        "loads": tight.loras.loads, "evictions": tight.loras.evictions, "cases": rows,
        "switch_cost_ms": (rows["switch"]["seconds"] - held_s) * 1000,
        "activation_ms": {case: statistics.median(t) * 1000 for case, t in activation.items()},
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=Path, default=ROOT / ".models", help="where the tiny packages are (written)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--size", default="64x64")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    ap.add_argument("--activations", type=int, default=40, help="timed adapter activations alone, per case")
    ap.add_argument("--json", type=Path, default=RESULTS / "lora_bench.json")
    opts = ap.parse_args()

    result = bench(opts)
    print(f"\ntiny-flux + tiny adapters ({opts.size}, {opts.steps} steps, {opts.device}); adapter bytes "
          + ", ".join(f"{n} {b}" for n, b in result["adapter_bytes"].items()))  # fmt: skip
    print(f"{'case':<8} {'s/request':>10} {'vs held':>8}")
    for case, row in result["cases"].items():
        print(f"{case:<8} {row['seconds']:>10.4f} {row['vs_held']:>8.2f}")
    print(f"switch cost (switch - held): {result['switch_cost_ms']:.1f} ms per request; "
          f"{result['loads']} loads, {result['evictions']} evictions")  # fmt: skip
    held_ms, switch_ms = result["activation_ms"]["held"], result["activation_ms"]["switch"]
    print(f"activation alone: held {held_ms:.2f} ms, switch (unload one, load the other) {switch_ms:.2f} ms: "
          f"{switch_ms / held_ms:.1f}x held")  # fmt: skip
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "device": opts.device}
    opts.json.write_text(json.dumps({"machine": machine, "result": result}, indent=2))
    print(f"\nwrote {opts.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
