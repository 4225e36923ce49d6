"""What the head's HTTP application costs per image request, without sockets or workers.

    python bench/http_app_bench.py [--requests 3000] [--blocks 5] [--size 16x16]

The head's FastAPI application (`triptych_head.api.app.create_app`) is called through ASGI in this
process, over a backend that answers at once with a black image of --size (no DiffusionServer, no
workers, no socket, no HTTP parsing): what is measured is the application alone, the CPU one
`POST /v1/images/generations` takes from its ASGI call to its last byte (the key and body limit
middlewares, routing, the body's validation, the request contract's check, admission, the PNG and
the JSON answer). Two paths of the same endpoint alternate in --blocks blocks of --requests each:
- `direct`: a JSON body (Content-Type application/json), served in front of FastAPI's router
  (`triptych_head.api.direct`), as every client's request is;
- `declared`: the same body as `application/vnd.triptych+json`, which FastAPI's declared route
  serves (what every request took before the direct routes: FastAPI's routing, dependency solving
  and body validation).
Prints each path's CPU per request (medians of the blocks) and direct / declared per block pair.
Results go to --json (default bench/results/http_app.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from triptych.families import ModelInfo
from triptych_dev import asgi_call
from triptych_dev.asgi_call import FixedPixels
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext

ROOT = Path(__file__).resolve().parents[1]

PATHS = {"direct": b"application/json", "declared": b"application/vnd.triptych+json"}
WARMUP = 200


async def block(app: Any, path: str, body: bytes, n: int) -> float:
    """CPU microseconds per request over `n` requests of `path`."""
    start = time.process_time()
    for _ in range(n):
        answer = await asgi_call.post(app, body, content_type=PATHS[path])
        if answer.status != 200:
            raise RuntimeError(f"{path} route: HTTP {answer.status}")
    return (time.process_time() - start) / n * 1e6


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    body = json.dumps({"prompt": "bench", "size": args.size, "num_inference_steps": 1, "seed": 0}).encode()
    with tempfile.TemporaryDirectory(prefix="triptych-http-app-") as folder:
        model = ModelInfo("tiny-flux", "FluxPipeline", "image", 4, 3.5)
        width, height = (int(side) for side in args.size.split("x"))
        backend = FixedPixels(np.zeros((1, 1, height, width, 3), np.uint8))
        ctx = HeadContext(backend=backend, model=model, output_path=Path(folder), registry=CollectorRegistry())
        app = create_app(ctx)  # its lifespan (the backend's start, the result sweeper) is not needed here
        for path in PATHS:
            await block(app, path, body, WARMUP)
        per_block: dict[str, list[float]] = {path: [] for path in PATHS}
        for i in range(args.blocks):
            order = list(PATHS) if i % 2 == 0 else list(reversed(PATHS))
            for path in order:
                per_block[path].append(await block(app, path, body, args.requests))
    ratios = [d / f for d, f in zip(per_block["direct"], per_block["declared"], strict=True)]
    return {
        "requests_per_block": args.requests,
        "size": args.size,
        "cpu_us_per_request": {path: statistics.median(v) for path, v in per_block.items()},
        "per_block": per_block,
        "direct_over_declared_per_block": ratios,
        "direct_over_declared": statistics.median(ratios),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3000, help="requests per block")
    p.add_argument("--blocks", type=int, default=5, help="blocks of each path, alternating")
    p.add_argument("--size", default="16x16", help="the image's WIDTHxHEIGHT")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "http_app.json")
    args = p.parse_args()
    result = asyncio.run(measure(args))
    cpu = result["cpu_us_per_request"]
    print(f"head HTTP application, POST /v1/images/generations {args.size}, instant backend, in process (ASGI)")
    print(f"  CPU per request, direct route      {cpu['direct']:7.1f} us   (application/json: api/direct.py)")
    print(f"  CPU per request, declared route    {cpu['declared']:7.1f} us   (FastAPI's routing and body validation)")
    blocks = " ".join(f"{r:.2f}" for r in result["direct_over_declared_per_block"])
    print(f"  direct / declared                  {result['direct_over_declared']:7.2f}x  per block pair: {blocks}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
