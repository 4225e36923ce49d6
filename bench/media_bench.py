"""What encoding answers costs the head, and what a burst of encodes does to its event loop.

    python bench/media_bench.py [--quota-cpus 1] [--burst 16] [--sizes 512,1024,2048] [--frames 33]

Prints, in one run:
- the CPU one answer's encode takes on the head (`triptych_head.media`): a PNG of a photo-like
  image (a gradient with noise, fixed seed) at each of --sizes px, and the MP4 of a clip of
  --frames frames of 480x832, against a memcpy of the same pixels (the floor of touching them
  once); hence how many such answers one CPU of a head encodes per second;
- an event loop's lag (a 1 ms timer's lateness, p50 / p99 / max) while --burst PNGs of
  --burst-size px are
  encoded at once, with no encode (the baseline), on a pool as wide as asyncio's default executor
  (host CPUs + 4: what `asyncio.to_thread` used) and on the head's MediaPool (one thread per CPU the
  process may use: triptych.cpus), and each burst's wall time.

With --quota-cpus N (root, cgroup v1 or v2) the process first moves into a new cgroup with a CPU
quota of N CPUs, as a head pod with a CPU limit runs: the default executor's width still counts the
host's CPUs, the MediaPool's the quota's. Results go to --json (default bench/results/media.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "head")]

from cgroup_quota import limited_to  # noqa: E402

from triptych.cpus import cpu_quota, usable_cpus  # noqa: E402
from triptych_head.media import ImageFormat, MediaPool, png_bytes, write_mp4  # noqa: E402

DEFAULT_JSON = ROOT / "bench" / "results" / "media.json"


def photo_like(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth gradient with noise of sigma 6: compresses like a photograph, not like noise or a flat image."""
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (h + w)], -1).astype(np.float32)
    noisy = base + np.random.default_rng(seed).normal(0, 6, base.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def cpu_ms(fn: Callable[[], Any], runs: int) -> float:
    """Median CPU milliseconds (this process, all threads) of `fn`."""
    fn()
    samples = []
    for _ in range(runs):
        t0 = time.process_time()
        fn()
        samples.append((time.process_time() - t0) * 1e3)
    return statistics.median(samples)


def encode_costs(sizes: list[int], frames: int, threads: int) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        image = photo_like(size, size)
        png = cpu_ms(partial(png_bytes, image), 3)
        rows.append(_row(f"PNG {size}x{size}", png, image, len(png_bytes(image))))
    for form in (ImageFormat("jpeg"), ImageFormat("jpeg", 75), ImageFormat("webp"), ImageFormat("webp", 75)):
        size = sizes[len(sizes) // 2]  # what an answer's output_format costs instead of the PNG
        image = photo_like(size, size)
        ms = cpu_ms(partial(form.encode, image), 3)
        rows.append(_row(f"{form.name.upper()} quality {form.quality or 100} {size}x{size}", ms, image,
                         len(form.encode(image))))  # fmt: skip
    clip = np.stack([photo_like(480, 832, seed) for seed in range(frames)])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.mp4"
        mp4 = cpu_ms(partial(write_mp4, clip, path, 16, threads), 2)
        rows.append(_row(f"MP4 {frames}x480x832", mp4, clip, path.stat().st_size))
    return rows


def _row(what: str, ms: float, pixels: np.ndarray, nbytes: int) -> dict[str, Any]:
    out = np.empty_like(pixels)
    floor = cpu_ms(partial(np.copyto, out, pixels), 5)
    return {"what": what, "cpu_ms": ms, "memcpy_ms": floor, "bytes": nbytes, "per_cpu_per_s": 1e3 / ms}


Run = Callable[[Callable[[np.ndarray], bytes], np.ndarray], Awaitable[bytes]]


async def burst(run: Run | None, images: list[np.ndarray]) -> dict[str, float]:
    """Encode `images` at once with `run` (None: no encode, 0.5 s idle) while a 1 ms timer measures the loop's lag."""
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t0 - 0.001)

    tick = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    if run is None:
        await asyncio.sleep(0.5)
    else:
        await asyncio.gather(*(run(png_bytes, image) for image in images))
    wall = time.perf_counter() - t0
    done.set()
    await tick
    lags.sort()
    return {"wall_s": wall, "lag_p50_ms": lags[len(lags) // 2] * 1e3, "lag_p99_ms": lags[int(len(lags) * 0.99)] * 1e3,
            "lag_max_ms": lags[-1] * 1e3}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quota-cpus", type=float, default=0, help="run under a cgroup CPU quota of this many CPUs (root)"
    )
    parser.add_argument("--burst", type=int, default=16, help="PNGs encoded at once")
    parser.add_argument("--burst-size", type=int, default=1024, help="their width and height in px")
    parser.add_argument("--sizes", default="512,1024,2048", help="PNG sizes (px, comma-separated) to cost")
    parser.add_argument("--frames", type=int, default=33, help="frames of the MP4 to cost")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    try:
        args.sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes takes comma-separated pixel sizes, e.g. 512,1024; got {args.sizes!r}")
    if min(args.burst, args.burst_size, args.frames, *args.sizes) < 1 or args.quota_cpus < 0:
        parser.error("--burst, --burst-size, --frames and --sizes must be >= 1, --quota-cpus >= 0")
    with ExitStack() as stack:
        try:
            quota = limited_to(args.quota_cpus, "triptych-media-bench") if args.quota_cpus else None
            group = stack.enter_context(quota) if quota is not None else None
        except OSError as exc:
            parser.error(f"--quota-cpus: {exc}")
        measure(args, group)


def measure(args: argparse.Namespace, group: Path | None) -> None:
    media = MediaPool()
    default_width = min(32, (os.cpu_count() or 1) + 4)
    where = group or "none set by this bench"
    print(f"host CPUs {os.cpu_count()}, affinity {len(os.sched_getaffinity(0))}, quota {cpu_quota()} ({where}):")
    print(f"MediaPool {media.threads} threads, default executor {default_width}")

    costs = encode_costs(args.sizes, args.frames, media.threads)
    print(f"\n{'answer':28s} {'CPU ms':>8s} {'memcpy ms':>10s} {'x memcpy':>9s} {'bytes':>10s} {'per CPU-second':>15s}")
    for r in costs:
        print(f"{r['what']:28s} {r['cpu_ms']:8.1f} {r['memcpy_ms']:10.2f} {r['cpu_ms'] / r['memcpy_ms']:9.0f} "
              f"{r['bytes']:10d} {r['per_cpu_per_s']:15.1f}")  # fmt: skip

    images = [photo_like(args.burst_size, args.burst_size, seed) for seed in range(args.burst)]
    wide = ThreadPoolExecutor(default_width)

    async def on_wide(fn: Callable[[np.ndarray], bytes], image: np.ndarray) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(wide, fn, image)

    runs: dict[str, list[dict[str, float]]] = {"idle": [], "default executor": [], "MediaPool": []}
    for _ in range(2):  # alternated, so drift falls on both
        runs["idle"].append(asyncio.run(burst(None, images)))
        runs["default executor"].append(asyncio.run(burst(on_wide, images)))
        runs["MediaPool"].append(asyncio.run(burst(media.run, images)))
    px = f"{args.burst_size}x{args.burst_size}"
    print(f"\nevent loop while {args.burst} PNGs of {px} encode at once (medians of 2 alternated runs)")
    summary: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        summary[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        s = summary[name]
        lag = f"lag p50 {s['lag_p50_ms']:6.2f} ms  p99 {s['lag_p99_ms']:6.2f} ms  max {s['lag_max_ms']:6.1f} ms"
        print(f"  {name:17s} {lag}" + ("" if name == "idle" else f"   burst {s['wall_s']:.2f} s"))
    d, m = summary["default executor"], summary["MediaPool"]
    p99, wall = m["lag_p99_ms"] / d["lag_p99_ms"], m["wall_s"] / d["wall_s"]
    print(f"  MediaPool / default executor: lag p99 {p99:.2f}x, burst time {wall:.2f}x")
    result = {
        "usable_cpus": usable_cpus(),
        "quota_cpus": cpu_quota(),
        "media_threads": media.threads,
        "default_executor_threads": default_width,
        "encode": costs,
        "burst": summary,
    }
    wide.shutdown()
    media.close()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
