"""Multi-device roles: denoiser step time for 1, 2 and 4 ranks (CFG, Ulysses, Ring, TP) and the Wan
decoder's decode time for 1 and 2 ranks (--decoder-sp), the communication share, the fan-out cost.

    python bench/parallel_bench.py [--device cpu|cuda] [--steps 4] [--jobs 3] [--size 256x256] [--frames 9]
                                  [--configs '1 rank,2 ranks cfg,...'] [--json PATH]

Runs the real denoiser and decoder stages of a Wan-shaped package (the tiny Wan package's text
encoder, scheduler and VAE, with a larger random-weight transformer written locally: no
download) for each configuration in its own process group, all started at once and given one job
each in turn (`--jobs` rounds after a warm-up round; medians), so every configuration sees the
same machine: denoisers of 1 rank (the plain single-device pipeline), 2 ranks CFG parallel, 2
ranks Ulysses, 4 ranks Ulysses 2 x Ring 2, 2 ranks TP; decoders of 1 and 2 ranks (random latents
of the request's shape). On CPU the ranks use gloo and are pinned to distinct cores where the
machine has them, one OpenMP thread each; on CUDA, NCCL with one GPU per rank (configurations
needing more GPUs than there are are skipped). Prints, per configuration: the time per
denoising step (per decode for decoders) and its ratio to the same role's 1-rank baseline of the
same run, the share of rank time spent in collectives, the time rank 0 takes to hand a job's
inputs to the other ranks, and the largest difference of the output (latents; pixels for
decoders) from that baseline. Denoiser jobs are asked before every step whether to hand off, as a
worker's are (on several ranks: one broadcast more per step); "2 ranks ulysses no hand-off" runs
without, so that its ratio to "2 ranks ulysses" is that broadcast's cost. Writes
bench/results/parallel_bench.json (--json PATH elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from triptych.params import GenerationParams
    from triptych_worker.stages import StageBatch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

# name -> (role, flags); the first configuration of a role, with no flags, is its 1-rank baseline.
CONFIGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "1 rank": ("denoiser", ()),
    "2 ranks cfg": ("denoiser", ("--num-gpus", "2", "--cfg-parallel-size", "2")),
    "2 ranks ulysses": ("denoiser", ("--num-gpus", "2", "--denoiser-ulysses", "2")),
    "4 ranks ulysses2 x ring2": ("denoiser", ("--num-gpus", "4", "--denoiser-ulysses", "2", "--denoiser-ring", "2")),
    "2 ranks tp": ("denoiser", ("--num-gpus", "2", "--denoiser-tp", "2")),
    "2 ranks ulysses no hand-off": ("denoiser", ("--num-gpus", "2", "--denoiser-ulysses", "2")),
    "decoder 1 rank": ("decoder", ()),
    "decoder 2 ranks sp": ("decoder", ("--num-gpus", "2", "--decoder-sp", "2")),
}
# A denoiser's jobs are asked before every step whether to hand off (as the worker asks them; on several
# ranks one more broadcast per step, parallel/handoff.py); these run without it, to show that broadcast's cost.
NO_HAND_OFF = {"2 ranks ulysses no hand-off"}
OUTPUT = {"denoiser": "latents", "decoder": "pixels"}
# The bench transformer: Wan's layout at a size a CPU steps through in about a second.
BENCH_TRANSFORMER = {"num_attention_heads": 8, "attention_head_dim": 32, "ffn_dim": 1024, "num_layers": 4}


def bench_package(out: Path) -> Path:
    """The tiny Wan package with a larger random-weight transformer (written once)."""
    import torch
    from diffusers import WanTransformer3DModel

    from triptych_dev.tiny_models import write_tiny_models

    if (out / "transformer" / "config.json").exists():
        return out
    tiny = next(p for p in write_tiny_models(ROOT / ".models", families=["tiny-wan"]) if p.name == "tiny-wan")
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("transformer"), dirs_exist_ok=True)
    config = {k: v for k, v in json.loads((tiny / "transformer" / "config.json").read_text()).items()}
    config = {k: v for k, v in config.items() if not k.startswith("_")} | BENCH_TRANSFORMER
    torch.manual_seed(0)
    WanTransformer3DModel(**config).save_pretrained(out / "transformer")
    return out


def child(opts: argparse.Namespace) -> None:
    """One configuration: run the jobs, write the figures and the latents."""
    import numpy as np
    import torch

    from triptych.cli import build_parser
    from triptych.config import ServeArgs
    from triptych.lora import LoraCatalog
    from triptych.params import GenerationParams
    from triptych.roles import Role
    from triptych_worker.pipeline import load_role_pipeline
    from triptych_worker.stages import StageBatch

    w, h = map(int, opts.size.split("x"))
    params = GenerationParams(prompt="waves on a beach", negative_prompt="blurry", width=w, height=h,
                              num_frames=opts.frames, seed=7, num_inference_steps=opts.steps, guidance_scale=5.0,
                              max_sequence_length=64)  # fmt: skip
    role = Role(opts.role)
    if role is Role.DENOISER:
        encoded = load_role_pipeline(opts.model, Role.ENCODER, "cpu").run(StageBatch(params))
    else:  # what a denoiser hands the decoder: latents of the request's shape (random: the decode costs the same)
        encoded = decoder_inputs(opts.model, params)
    flags = json.loads(opts.child)
    cores = os.cpu_count() or 1
    if flags:
        head = "tcp://127.0.0.1:1"  # never contacted: the bench runs the ranks without a head
        argv = ["serve", "--model-path", opts.model, "--disagg-role", role.value, "--device", opts.device,
                "--disagg-server-addr", head, "--master-port", str(opts.master_port), *flags]  # fmt: skip
        from triptych_worker.parallel.ranks import start_ranks

        args = ServeArgs.from_namespace(build_parser().parse_args(argv))
        pipeline = start_ranks(args, LoraCatalog.from_flags(args.lora, args.lora_catalog))
        if opts.device == "cpu" and cores >= len(pipeline.followers) + 1:
            os.sched_setaffinity(0, {0})
            for i, follower in enumerate(pipeline.followers, start=1):
                os.sched_setaffinity(follower.pid, {i})
    else:
        # The dtype the ranks compute in (start_ranks: --dtype auto, bfloat16 on a GPU), so both sides compare alike.
        one_rank = ServeArgs.from_namespace(build_parser().parse_args(["serve", "--model-path", opts.model]))
        dtype = one_rank.compute_dtype(opts.device)
        pipeline = load_role_pipeline(opts.model, role, opts.device, dtype=dtype)  # type: ignore[assignment]
        if opts.device == "cpu" and cores >= 1:
            os.sched_setaffinity(0, {0})
    print("ready", flush=True)
    for line in sys.stdin:  # one job per "run" from the parent, so that configurations alternate
        if line.strip() != "run":
            break
        batch = StageBatch(params, dict(encoded.tensors), dict(encoded.meta))
        if getattr(pipeline, "hands_off", False) and not opts.no_hand_off:
            batch.hand_off = lambda: False  # as compute._prepare: asked before every step, never stopping
        started = time.perf_counter()
        out = pipeline.run(batch)
        if opts.device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        counters = getattr(pipeline, "last_counters", [])
        run = {
            "unit_s": elapsed / (opts.steps if role is Role.DENOISER else 1),
            "comm_share": [s / elapsed for _, s, _ in counters] or [0.0],
            "fanout_s": getattr(pipeline, "last_fanout_s", 0.0),
        }
        np.save(opts.latents, out.tensors[OUTPUT[role.value]].float().cpu().numpy())
        print(json.dumps(run), flush=True)
    os._exit(0)  # the followers die with this process


def decoder_inputs(model: str, params: GenerationParams) -> StageBatch:
    import torch

    from triptych.roles import Role
    from triptych_worker.adapters import adapter_for
    from triptych_worker.stages import StageBatch

    _, adapter = adapter_for(model)
    spec = next(s for s in adapter.output_specs(Role.DENOISER, params) if s.name == "latents")
    latents = torch.randn(spec.shape, generator=torch.Generator().manual_seed(params.seed))
    return StageBatch(params, {"latents": latents})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--size", default="256x256")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--role", default="denoiser", help=argparse.SUPPRESS)
    parser.add_argument("--master-port", type=int, default=29731, help=f"first of {len(CONFIGS)} rendezvous ports")
    parser.add_argument("--latents", help=argparse.SUPPRESS)
    parser.add_argument("--no-hand-off", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=RESULTS / "parallel_bench.json", help="where to write the results")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="comma-separated configurations (default all); each role's 1-rank baseline is always run",
    )
    opts = parser.parse_args()
    if opts.child is not None:
        child(opts)
        return
    selected = {name.strip() for name in opts.configs.split(",") if name.strip()}
    if unknown := selected - set(CONFIGS):
        parser.error(f"--configs: unknown {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    selected |= {
        name for name, (role, flags) in CONFIGS.items() if not flags and role in {CONFIGS[n][0] for n in selected}
    }
    import numpy as np

    RESULTS.mkdir(exist_ok=True)
    model = bench_package(RESULTS / "parallel-bench-wan")
    devices = (os.cpu_count() or 1) if opts.device == "cpu" else _cuda_count()
    children: dict[str, subprocess.Popen[str]] = {}
    for i, (name, (role, flags)) in enumerate(CONFIGS.items()):
        if name not in selected:
            continue
        ranks = int(flags[1]) if flags else 1
        if opts.device == "cuda" and ranks > devices:
            print(f"{name:26} skipped: {ranks} GPUs needed, {devices} here", flush=True)
            continue
        cmd = [sys.executable, __file__, "--child", json.dumps(flags), "--role", role, "--model", str(model),
               "--device", opts.device,
               "--steps", str(opts.steps), "--size", opts.size, "--frames", str(opts.frames),
               "--master-port", str(opts.master_port + i),
               "--latents", str(RESULTS / f"parallel-output-{i}.npy"),
               *(["--no-hand-off"] if name in NO_HAND_OFF else [])]  # fmt: skip
        # One OpenMP thread per rank, as one core each: idle OpenMP threads spinning on a shared core
        # would measure the machine, not the parallelism.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        children[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for proc in children.values():
        _reply(proc)
    # Rounds: one job per configuration in turn (the first round warms up), so all see the same machine.
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in children}
    for round_ in range(opts.jobs + 1):
        for name, proc in children.items():
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("run\n")
            proc.stdin.flush()
            result = json.loads(_reply(proc))
            if round_:
                runs[name].append(result)
    for proc in children.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
    rows = []
    baselines: dict[str, tuple[float, np.ndarray]] = {}
    for i, (name, (role, flags)) in enumerate(CONFIGS.items()):
        if name not in runs:
            continue
        unit = statistics.median(float(r["unit_s"]) for r in runs[name])  # type: ignore[arg-type]
        output = np.load(RESULTS / f"parallel-output-{i}.npy")
        if not flags:
            baselines[role] = (unit, output)
        base_unit, base_output = baselines[role]
        shares = [statistics.mean(r["comm_share"]) for r in runs[name]]  # type: ignore[arg-type]
        row = {
            "config": name, "role": role, "ranks": int(flags[1]) if flags else 1,
            "unit": "step" if role == "denoiser" else "decode", "unit_s": unit, "vs_1_rank": unit / base_unit,
            "comm_share": statistics.median(shares),
            "fanout_s": statistics.median(float(r["fanout_s"]) for r in runs[name]),  # type: ignore[arg-type]
            "max_abs_diff": float(np.abs(output - base_output).max()), "output": OUTPUT[role],
        }  # fmt: skip
        rows.append(row)
        print(
            f"{name:26} {row['unit']} {unit * 1000:8.1f} ms  x{row['vs_1_rank']:.2f} of 1 rank  "
            f"collectives {100 * row['comm_share']:5.1f}% of rank time  "
            f"fan-out {row['fanout_s'] * 1000:6.2f} ms  max |{OUTPUT[role]} - 1 rank| {row['max_abs_diff']:.2e}",
            flush=True,
        )
    report = {"device": opts.device, "cores": os.cpu_count(), "size": opts.size, "frames": opts.frames,
              "steps": opts.steps, "transformer": BENCH_TRANSFORMER, "rows": rows}  # fmt: skip
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(report, indent=2))


def _reply(proc: subprocess.Popen[str]) -> str:
    """The child's next protocol line ("ready" or a JSON object), past anything else a library printed."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(("ready", "{")):
            return line
    raise RuntimeError(f"a bench process exited with {proc.wait()}")


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


if __name__ == "__main__":
    main()
