"""Drain benchmark: how long a busy denoiser takes to drain (SIGTERM to exit) with migration off and
on, in the same run, alternating.

    python bench/drain_bench.py [--video-seconds 20] [--steps 50] [--after 2] [--repeats 3] [--json PATH]

Each round starts a deployment of simulated workers (`triptych serve --simulate`: real processes,
ZMQ and Mooncake TCP, no model; the tiny Wan package's shapes): one encoder, two denoisers of one
slot each, one decoder. One video whose denoise the simulated denoiser models as --video-seconds
over --steps steps is submitted to the head's frontend; --after seconds into its denoising, the
denoiser running it gets SIGTERM, and the time until that process exits is its drain. With
`--disagg-migration off` (before) the denoiser finishes the video first; with `on` (after) the head
asks it to hand the video off at its next step boundary to the idle peer, and it exits once the
state has moved. Both ways the video must complete (the bench fails otherwise).

Prints per mode the median drain, the video's latency, and for migration on what the move cost
from the head's /metrics (migrations, bytes, seconds from the state staged to the receiver told to
resume); then drain off / on. Writes bench/results/drain.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from head_bench import Frontend  # noqa: E402
from preemption_bench import metric, simulated_roles, units  # noqa: E402

from triptych.params import GenerationParams  # noqa: E402
from triptych.roles import Role  # noqa: E402
from triptych_dev.localdeploy import LocalDeployment, Proc, local_deployment  # noqa: E402
from triptych_dev.tiny_models import write_tiny_models  # noqa: E402

MODES = ("off", "on")  # --disagg-migration: before, after
RUNNING = "DENOISING_RUNNING"


async def _running_on(dep: LocalDeployment, client: httpx.AsyncClient, timeout: float = 60) -> Proc:
    """The denoiser process the (only) request is denoising on, once it is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in (await client.get(f"{dep.http}/v1/pipeline")).json()["requests"]:
            if rec["state"] == RUNNING and rec["instance"]:
                return next(p for p in dep.workers(Role.DENOISER) if p.url == rec["instance"])
        await asyncio.sleep(0.02)
    raise RuntimeError(f"the video was not denoising after {timeout:g}s")


def drain_round(dep: LocalDeployment, video: GenerationParams, after: float) -> dict[str, float]:
    """Submit the video, SIGTERM its denoiser `after` seconds into its denoising; the drain and the video."""

    async def run() -> dict[str, float]:
        front = Frontend(f"tcp://127.0.0.1:{dep.scheduler_port}")
        async with httpx.AsyncClient(timeout=30) as client:
            try:
                submitted = time.perf_counter()
                result = asyncio.create_task(front.request("video", video))
                victim = await _running_on(dep, client)
                await asyncio.sleep(after)
                if result.done():
                    raise RuntimeError("the video ended before the drain: raise --video-seconds")
                signalled = time.perf_counter()
                victim.popen.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(victim.popen.wait, 600)
                drained = time.perf_counter() - signalled
                if code != 0:
                    raise RuntimeError(f"the drained denoiser exited with status {code}:\n{victim.tail()}")
                await asyncio.wait_for(result, timeout=600)  # raises if the video failed
                latency = time.perf_counter() - submitted
                page = (await client.get(f"{dep.http}/metrics")).text
            finally:
                front.close()
        return {
            "drain_s": drained,
            "video_s": latency,
            "migrations": metric(page, "triptych_migrations_total"),
            "migration_bytes": metric(page, "triptych_migration_bytes_total"),
            "migration_s": metric(page, "triptych_migration_seconds_sum"),
        }

    return asyncio.run(run())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--video-seconds", type=float, default=20.0, help="the video's modelled denoise")
    p.add_argument("--steps", type=int, default=50, help="its denoising steps")
    p.add_argument("--after", type=float, default=2.0, help="seconds into its denoising the denoiser is drained")
    p.add_argument("--repeats", type=int, default=3, help="rounds per mode, alternating off and on")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "drain.json")
    args = p.parse_args()
    video = GenerationParams(prompt="video", width=64, height=64, num_frames=9, num_inference_steps=args.steps)
    seconds_per_unit = args.video_seconds / units(video)
    (wan,) = write_tiny_models(ROOT / ".models", families=["tiny-wan"])
    role_flags = simulated_roles(seconds_per_unit, edge_seconds=0.005, edge_capacity=2)
    counts = {Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1}
    step_ms = args.video_seconds / args.steps * 1e3
    print(
        f"a video of {args.steps} steps, {args.video_seconds:g}s of denoising ({step_ms:.0f} ms a step) on one of "
        f"2 simulated denoisers, drained {args.after:g}s into it; {args.repeats} rounds per mode",
        flush=True,
    )
    rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            with tempfile.TemporaryDirectory(prefix="drain-bench-") as tmp:
                with local_deployment(
                    wan, Path(tmp), counts, worker_flags=("--simulate", "--device", "cpu"), role_flags=role_flags,
                    head_flags=("--disagg-migration", mode), ready_timeout=120,
                ) as dep:  # fmt: skip
                    row = drain_round(dep, video, args.after)
            rounds[mode].append(row)
            drained, done = row["drain_s"], row["video_s"]
            print(f"migration {mode:>3}: drained in {drained:.2f}s, video done in {done:.2f}s", flush=True)
    summary: dict[str, Any] = {}
    for mode in MODES:
        rows = rounds[mode]
        moves = sum(r["migrations"] for r in rows)
        summary[mode] = {
            "drain_s": statistics.median(r["drain_s"] for r in rows),
            "video_s": statistics.median(r["video_s"] for r in rows),
            "moves": moves,
            "bytes_per_move": sum(r["migration_bytes"] for r in rows) / moves if moves else 0.0,
            "ms_per_move": 1e3 * sum(r["migration_s"] for r in rows) / moves if moves else 0.0,
        }
    for mode in MODES:
        s = summary[mode]
        print(
            f"migration {mode:>3}: median drain {s['drain_s']:.2f}s, video {s['video_s']:.2f}s; {s['moves']:.0f} moves"
            + (f" of {s['bytes_per_move']:.0f} bytes, {s['ms_per_move']:.1f} ms each" if s["moves"] else "")
        )
    ratio = summary["off"]["drain_s"] / summary["on"]["drain_s"]
    summary["drain_off_over_on"] = ratio
    print(f"drain off/on: {ratio:.1f}x (a step is {step_ms:.0f} ms)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    out = {"args": vars(args) | {"json": str(args.json)}, "rounds": rounds, "summary": summary}
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
