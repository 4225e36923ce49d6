"""What the head's HTTP application costs per image request, without sockets or workers.

    python bench/http_app_bench.py [--requests 3000] [--blocks 5] [--size 16x16] [--access-log]

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
With --access-log the two alternating arms are instead the direct route without and with the access
log (`--access-log`), its lines written to a file with the head's format (triptych.launch): what a
line per request costs.
Results go to --json (default bench/results/http_app.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from triptych import log_format
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
    """Two arms alternating in blocks: the direct and declared routes, or (--access-log) the direct
    route without and with the access log."""
    body = json.dumps({"prompt": "bench", "size": args.size, "num_inference_steps": 1, "seed": 0}).encode()
    with tempfile.TemporaryDirectory(prefix="triptych-http-app-") as folder:
        model = ModelInfo("tiny-flux", "FluxPipeline", "image", 4, 3.5)
        width, height = (int(side) for side in args.size.split("x"))
        backend = FixedPixels(np.zeros((1, 1, height, width, 3), np.uint8))

        def app(access_log: bool) -> Any:  # its lifespan (the backend's start, the sweeper) is not needed here
            ctx = HeadContext(backend, model, Path(folder), CollectorRegistry(), access_log=access_log)
            return create_app(ctx)

        if args.access_log:
            _log_as_the_head_does(Path(folder) / "head.log")
            arms = {"on": (app(True), "direct"), "off": (app(False), "direct")}
        else:
            one = app(False)
            arms = {path: (one, path) for path in PATHS}
        for served, path in arms.values():
            await block(served, path, body, WARMUP)
        per_block: dict[str, list[float]] = {arm: [] for arm in arms}
        for i in range(args.blocks):
            order = list(arms) if i % 2 == 0 else list(reversed(arms))
            for arm in order:
                per_block[arm].append(await block(*arms[arm], body, args.requests))
    first, second = arms
    ratios = [a / b for a, b in zip(per_block[first], per_block[second], strict=True)]
    return {
        "requests_per_block": args.requests,
        "size": args.size,
        "cpu_us_per_request": {arm: statistics.median(v) for arm, v in per_block.items()},
        "per_block": per_block,
        f"{first}_over_{second}_per_block": ratios,
        f"{first}_over_{second}": statistics.median(ratios),
    }


def _log_as_the_head_does(path: Path) -> None:
    """INFO lines in the head's text format (triptych.log_format) to a file, as a pod's stderr."""
    handler = logging.FileHandler(path)
    handler.setFormatter(log_format.formatter(log_format.TEXT, "server"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3000, help="requests per block")
    p.add_argument("--blocks", type=int, default=5, help="blocks of each path, alternating")
    p.add_argument("--size", default="16x16", help="the image's WIDTHxHEIGHT")
    p.add_argument("--access-log", action="store_true", help="compare the direct route without and with it")
    p.add_argument("--json", type=Path, default=None, help="default bench/results/http_app[_access_log].json")
    args = p.parse_args()
    args.json = args.json or ROOT / "bench" / "results" / f"http_app{'_access_log' if args.access_log else ''}.json"
    result = asyncio.run(measure(args))
    cpu = result["cpu_us_per_request"]
    print(f"head HTTP application, POST /v1/images/generations {args.size}, instant backend, in process (ASGI)")
    if args.access_log:
        print(f"  CPU per request, access log off    {cpu['off']:7.1f} us")
        print(f"  CPU per request, access log on     {cpu['on']:7.1f} us   (a line per request to a file)")
        blocks = " ".join(f"{r:.2f}" for r in result["on_over_off_per_block"])
        print(f"  on / off                           {result['on_over_off']:7.2f}x  per block pair: {blocks}")
    else:
        print(f"  CPU per request, direct route      {cpu['direct']:7.1f} us   (application/json: api/direct.py)")
        print(f"  CPU per request, declared route    {cpu['declared']:7.1f} us   (FastAPI's routing, body validation)")
        blocks = " ".join(f"{r:.2f}" for r in result["direct_over_declared_per_block"])
        print(f"  direct / declared                  {result['direct_over_declared']:7.2f}x  per block pair: {blocks}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
