"""Preemption benchmark: a Poisson mix of short high-priority images and long low-priority videos
over simulated workers, with --disagg-preemption on and off in the same run, on the same arrivals.

    python bench/preemption_bench.py [--denoisers 2] [--image-seconds 0.1] [--load 0.8] [--image-share 0.7]
                                     [--window 40] [--seed 1] [--image-deadline 1.0] [--video-deadline 20]
                                     [--json PATH]

One deployment per mode of simulated workers (`triptych serve --simulate`: real processes, ZMQ and
Mooncake TCP, no model) on loopback, the tiny Wan package's shapes: one encoder, --denoisers
denoisers of one slot each, one decoder. The encoder and decoder have 32 slots: an encoded
request's outputs hold an encoder slot until a denoiser takes them, and with few, images would
wait at the encoder behind videos waiting for a denoiser, which no denoiser preemption helps.
The denoiser's modelled time is proportional to the work (frames x pixels x steps): an image is
1 frame of 8 steps (--image-seconds), a video 9 frames of 20 steps (22.5 x an image: 2.25 s by
default, one of its steps 0.11 s). Requests arrive as one Poisson process of rate --load x the
denoisers' capacity, each an image with probability --image-share (priority high) else a video
(priority low), submitted straight to the head's frontend (no HTTP); the arrival schedule is drawn
once from --seed and replayed in both modes.

Prints per mode and class: SLO attainment (the share done within the class's deadline), p50 and
p99 latency; throughput (requests done / first arrival to last completion); and for preemption on,
what moves cost, from the head's /metrics: suspensions, bytes of state each kept, how many resumed
in place (nothing moved) or elsewhere (a migration), the mean milliseconds of such a move (dispatch
to the receiver told to resume) and the mean time a suspended video waited. Then the ratios: the
short class's p99 off / on (goal >= 3) and throughput on / off (goal within 5%). Writes
bench/results/preemption.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from head_bench import Frontend  # noqa: E402

from triptych.params import GenerationParams  # noqa: E402
from triptych.priority import HIGH, LOW, level  # noqa: E402
from triptych.roles import Role  # noqa: E402
from triptych_dev.localdeploy import LocalDeployment, local_deployment  # noqa: E402
from triptych_dev.tiny_models import write_tiny_models  # noqa: E402

SIDE = 64
IMAGE = GenerationParams(prompt="image", width=SIDE, height=SIDE, num_frames=1, num_inference_steps=8)
VIDEO = GenerationParams(prompt="video", width=SIDE, height=SIDE, num_frames=9, num_inference_steps=20)
CLASSES = {"image": (IMAGE, level(HIGH)), "video": (VIDEO, level(LOW))}
MEGAPIXEL = 1 << 20


def units(p: GenerationParams) -> float:
    """The simulated denoiser's work units of a request (worker/triptych_worker/simulated.py)."""
    return p.num_frames * p.width * p.height / MEGAPIXEL * p.num_inference_steps


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds from the start
    kind: str  # "image" or "video"


def arrivals(args: argparse.Namespace, seconds_per_unit: float) -> list[Arrival]:
    """One Poisson process of the mixed classes at --load of the denoisers' capacity."""
    mean_s = seconds_per_unit * (
        args.image_share * units(IMAGE) + (1 - args.image_share) * units(VIDEO)
    )  # a request's denoise, on average
    rate = args.load * args.denoisers / mean_s
    rng = random.Random(args.seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= args.window:
            return out
        out.append(Arrival(t, "image" if rng.random() < args.image_share else "video"))


def metric(text: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples (those with `label` among their labels) in a /metrics page."""
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if re.fullmatch(rf"{name}(\{{.*\}})?", sample) and label in sample:
            total += float(value)
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


def replay(dep: LocalDeployment, schedule: list[Arrival], args: argparse.Namespace) -> dict[str, Any]:
    """Send the schedule to the head; per class latencies and SLO attainment, throughput, move costs."""
    deadlines = {"image": args.image_deadline, "video": args.video_deadline}

    async def run() -> tuple[dict[str, list[float]], float, float]:
        front = Frontend(f"tcp://127.0.0.1:{dep.scheduler_port}")
        latencies: dict[str, list[float]] = {"image": [], "video": []}
        ends: list[float] = []

        async def one(i: int, arrival: Arrival) -> None:
            params, priority = CLASSES[arrival.kind]
            t0 = time.perf_counter()
            await asyncio.wait_for(front.request(f"{arrival.kind}-{i}", params, priority), timeout=600)
            ends.append(time.perf_counter())
            latencies[arrival.kind].append(ends[-1] - t0)

        try:
            start = time.perf_counter()
            tasks = []
            for i, arrival in enumerate(schedule):
                await asyncio.sleep(max(0.0, start + arrival.at - time.perf_counter()))
                tasks.append(asyncio.create_task(one(i, arrival)))
            await asyncio.gather(*tasks)
            return latencies, start, max(ends)
        finally:
            front.close()

    latencies, start, end = asyncio.run(run())
    page = httpx.get(f"{dep.http}/metrics", timeout=30).text
    row: dict[str, Any] = {"requests": sum(len(v) for v in latencies.values())}
    row["throughput_rps"] = row["requests"] / (end - start)
    for kind, values in latencies.items():
        row[kind] = {
            "n": len(values),
            "slo_attainment": sum(1 for v in values if v <= deadlines[kind]) / max(len(values), 1),
            "p50_s": percentile(values, 0.5),
            "p99_s": percentile(values, 0.99),
        }
    suspensions = metric(page, "triptych_suspensions_total")
    moved = metric(page, "triptych_resumptions_total", 'where="other"')
    row["moves"] = {
        "suspensions": suspensions,
        "bytes_per_suspension": metric(page, "triptych_suspension_bytes_total") / suspensions if suspensions else 0.0,
        "resumed_in_place": metric(page, "triptych_resumptions_total", 'where="same"'),
        "resumed_elsewhere": moved,
        "move_ms": 1e3 * metric(page, "triptych_migration_seconds_sum") / moved if moved else 0.0,
        "suspended_s_mean": metric(page, "triptych_suspended_seconds_sum") / suspensions if suspensions else 0.0,
    }
    return row


def simulated_roles(seconds_per_unit: float, edge_seconds: float, edge_capacity: int) -> dict[Role, tuple[str, ...]]:
    """Flags of simulated workers: encoder and decoder take `edge_seconds` a request, with
    `edge_capacity` slots; denoisers of one slot take `seconds_per_unit` x the request's work."""
    edges = ("--simulate-seconds", str(edge_seconds), "--simulate-seconds-per-unit", "0",
             "--worker-capacity", str(edge_capacity))  # fmt: skip
    denoiser = ("--simulate-seconds", "0", "--simulate-seconds-per-unit", str(seconds_per_unit),
                "--worker-capacity", "1")  # fmt: skip
    return {Role.ENCODER: edges, Role.DECODER: edges, Role.DENOISER: denoiser}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--denoisers", type=int, default=2)
    p.add_argument("--image-seconds", type=float, default=0.1, help="an image's modelled denoise")
    p.add_argument("--edge-seconds", type=float, default=0.005, help="modelled encode and decode time")
    p.add_argument("--load", type=float, default=0.8, help="offered denoiser load, a share of its capacity")
    p.add_argument("--image-share", type=float, default=0.7, help="the share of arrivals that are images")
    p.add_argument("--window", type=float, default=40.0, help="seconds of arrivals per mode")
    p.add_argument("--image-deadline", type=float, default=1.0, help="the short class's deadline (SLO), seconds")
    p.add_argument("--video-deadline", type=float, default=20.0, help="the long class's deadline (SLO), seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "preemption.json")
    args = p.parse_args()
    # The denoiser's time is seconds_per_unit x units: the video's follows from the image's.
    seconds_per_unit = args.image_seconds / units(IMAGE)
    video_seconds = seconds_per_unit * units(VIDEO)
    (wan,) = write_tiny_models(ROOT / ".models", families=["tiny-wan"])
    schedule = arrivals(args, seconds_per_unit)
    # Room on the encoder and decoder for every request: an encoded request's outputs hold an encoder
    # slot until a denoiser takes them, and the benchmark is about the denoisers.
    role_flags = simulated_roles(seconds_per_unit, args.edge_seconds, edge_capacity=32)
    counts = {Role.ENCODER: 1, Role.DENOISER: args.denoisers, Role.DECODER: 1}
    print(
        f"{len(schedule)} arrivals in {args.window:g}s ({sum(a.kind == 'image' for a in schedule)} images of "
        f"{args.image_seconds * 1e3:.0f} ms, the others videos of {video_seconds:.2f}s) over {args.denoisers} "
        f"denoisers at {args.load:.0%} load",
        flush=True,
    )
    rows: dict[str, dict[str, Any]] = {}
    for mode in ("off", "on"):
        with tempfile.TemporaryDirectory(prefix="preemption-bench-") as tmp:
            with local_deployment(
                wan, Path(tmp), counts, worker_flags=("--simulate", "--device", "cpu"), role_flags=role_flags,
                head_flags=("--disagg-preemption", mode), ready_timeout=120,
            ) as dep:  # fmt: skip
                rows[mode] = row = replay(dep, schedule, args)
        print(
            f"preemption {mode:>3}: {row['throughput_rps']:.2f} req/s; images SLO {row['image']['slo_attainment']:.0%} "
            f"p50 {row['image']['p50_s'] * 1e3:.0f} ms p99 {row['image']['p99_s'] * 1e3:.0f} ms; videos SLO "
            f"{row['video']['slo_attainment']:.0%} p50 {row['video']['p50_s']:.2f}s p99 {row['video']['p99_s']:.2f}s",
            flush=True,
        )
    moves = rows["on"]["moves"]
    print(
        f"moves with preemption on: {moves['suspensions']:.0f} suspensions of {moves['bytes_per_suspension']:.0f} "
        f"bytes each; {moves['resumed_in_place']:.0f} resumed in place (0 bytes moved), "
        f"{moves['resumed_elsewhere']:.0f} elsewhere ({moves['move_ms']:.1f} ms per move); a suspended video "
        f"waited {moves['suspended_s_mean']:.2f}s on average"
    )
    p99_ratio = rows["off"]["image"]["p99_s"] / rows["on"]["image"]["p99_s"]
    throughput_ratio = rows["on"]["throughput_rps"] / rows["off"]["throughput_rps"]
    print(
        f"short-class p99 off/on: {p99_ratio:.1f}x (goal >= 3x); throughput on/off: {throughput_ratio:.3f} "
        f"(goal within 5%)"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    summary = {"image_p99_off_over_on": p99_ratio, "throughput_on_over_off": throughput_ratio}
    out = {"args": vars(args) | {"json": str(args.json)}, "rows": rows, "summary": summary}
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
