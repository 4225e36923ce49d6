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
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext
from triptych_head.backend import GenerationOutput

ROOT = Path(__file__).resolve().parents[1]

PATHS = {"direct": b"application/json", "declared": b"application/vnd.triptych+json"}
WARMUP = 200


class InstantBackend:
    """Answers every request at once with a black image (a head's backend: triptych_head.backend)."""

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def cancel(self, request_id: str) -> None:
        pass

    async def generate(self, request_id: str, params: Any, on_event: Any = None, preview_every: int = 0,
                       priority: int = 1) -> GenerationOutput:  # fmt: skip
        pixels = np.zeros((params.num_outputs, 1, params.height, params.width, 3), np.uint8)
        return GenerationOutput(pixels=pixels, server_timing="denoiser;dur=1.0")


def scope(body: bytes, content_type: bytes) -> dict[str, Any]:
    headers = [(b"host", b"head"), (b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/images/generations", "raw_path": b"/v1/images/generations", "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip


async def one(app: Any, request_scope: dict[str, Any], body: bytes) -> None:
    """One request through ASGI: its body, then (as a server does once it is read) nothing until a disconnect."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays; the handler cancels this watcher when it answers
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(dict(request_scope), receive, send)
    if sent[0]["status"] != 200:
        raise RuntimeError(f"HTTP {sent[0]['status']}: {b''.join(m.get('body', b'') for m in sent[1:])[:300]!r}")


async def block(app: Any, path: str, body: bytes, n: int) -> float:
    """CPU microseconds per request over `n` requests of `path`."""
    request_scope = scope(body, PATHS[path])
    start = time.process_time()
    for _ in range(n):
        await one(app, request_scope, body)
    return (time.process_time() - start) / n * 1e6


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    body = json.dumps({"prompt": "bench", "size": args.size, "num_inference_steps": 1, "seed": 0}).encode()
    with tempfile.TemporaryDirectory(prefix="triptych-http-app-") as folder:
        model = ModelInfo("tiny-flux", "FluxPipeline", "image", 4, 3.5)
        ctx = HeadContext(backend=InstantBackend(), model=model, output_path=Path(folder), registry=CollectorRegistry())
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
