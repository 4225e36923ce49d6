"""Where a request's control time goes, message by message: the hop trace of bench/head_bench.py's
sequential requests beside the raw ZMQ floor, in one run.

    python bench/hop_bench.py [--requests 400] [--blocks 3]

A local deployment as head_bench.py runs it (head and three zero-compute workers, authenticated,
64 KiB per hop) is started with triptych_dev.hops's trace in every process: each control message's
encode, send, receive and decode is time-stamped on the host's one monotonic clock. This process
sends --requests sequential requests (in --blocks blocks alternating with blocks of
bench/zmq_floor.py's 12 forwarded messages) and lines their events up. Each gap of a request's path
is one of:
- send: the sender's encode and ZMQ send call;
- wire: from the send call's return to the receiver's receive returning (ZMQ's I/O threads on both
  ends, CURVE, TCP, waking the receiver): what the floor's messages are made of, but for their sends;
- receive: from the receive's return to the message decoded;
- <role> work: a process between decoding a message and encoding the next (a worker's includes its
  stage and its Mooncake write, which the results report and which are taken out below).
Prints each gap's median, the sums per request by kind against the floor's median (per message:
its send, wire and receive together), and what decoding one control header costs with warm caches
and after 32 MiB went through them, which is how a message finds them after a process slept.
Results go to --json (default bench/results/hops.json). The trace adds about 1.4 µs per event
(triptych_dev.hops), some 60 µs over a request's 46 events: the gaps include it, the floor does not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zmq_floor
from head_bench import PARAMS, ROOT, sequential_requests

from triptych.protocol import TransferReady, decode, encode
from triptych_dev import hops
from triptych_dev.localdeploy import local_deployment
from triptych_dev.tiny_models import write_tiny_models

PAYLOAD_BYTES = 64 * 1024
COLD_BYTES = 32 << 20


def traced_block(
    sock: zmq.Socket[Any], n: int, start: int, clients: dict[str, tuple[int, int]], timings: list[dict[str, float]]
) -> None:
    """n sequential requests; their client-side times into `clients`, their reported timings into `timings`."""
    for rid, t0, t1, result in sequential_requests(sock, (f"hop-{i}" for i in range(start, start + n))):
        clients[rid] = (t0, t1)
        timings.append(dict(result.timings))


def decode_cost() -> dict[str, float]:
    """Microseconds to decode a transfer_ready header: in a tight loop, and after COLD_BYTES streamed
    through the caches (as after a process slept while others ran)."""
    manifest = [{"name": n, "dtype": "bfloat16", "shape": [1, 16, 64], "offset": i * 4096} for i, n in enumerate("abc")]
    parts = encode(TransferReady("req-1", "tcp://127.0.0.1:1", PARAMS, manifest, {}))
    junk = np.ones(COLD_BYTES // 4, dtype=np.float32)

    def median_us(before: Callable[[], object], runs: int) -> float:
        samples = []
        for _ in range(runs):
            before()
            t0 = time.perf_counter_ns()
            decode(parts)
            samples.append(time.perf_counter_ns() - t0)
        return statistics.median(samples) / 1e3

    median_us(lambda: None, 200)
    return {"hot_us": median_us(lambda: None, 2000), "cold_us": median_us(junk.sum, 200)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--blocks", type=int, default=3, help="traced and floor blocks, alternating")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "hops.json")
    args = p.parse_args()
    (flux,) = write_tiny_models(ROOT / ".models", families=["tiny-flux"])
    per_block = max(1, -(-args.requests // args.blocks))
    clients: dict[str, tuple[int, int]] = {}
    timings: list[dict[str, float]] = []
    floor_samples: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        trace = Path(tmp) / "trace"
        trace.mkdir()
        # Only the deployment's processes are traced (not this one, nor the floor's). A process stopped
        # with events still buffered loses them: its last requests drop off the common path.
        site = os.pathsep.join(filter(None, [str(hops.site_dir()), os.environ.get("PYTHONPATH")]))
        with mock.patch.dict(os.environ, {hops.ENV: str(trace), "PYTHONPATH": site}):
            dep = stack.enter_context(
                local_deployment(flux, Path(tmp), worker_flags=("--device", "cpu"), null_payload_bytes=PAYLOAD_BYTES)
            )
        roles = {proc.popen.pid: proc.role.value for proc in dep.procs}
        sock = zmq.Context.instance().socket(zmq.DEALER)
        stack.callback(sock.close)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 30_000)
        sock.connect(f"tcp://127.0.0.1:{dep.scheduler_port}")
        traced_block(sock, 30, -30, {}, [])  # warm up
        with zmq_floor.Floor() as floor:
            for b in range(args.blocks):
                floor_samples += floor.block(per_block)
                traced_block(sock, per_block, b * per_block, clients, timings)
        stack.close()  # the deployment stops before its events are read
        segments = hops.hops(trace, roles, clients)
    if not segments:
        raise RuntimeError("no request's events were traced")
    sums = hops.totals(segments)
    stage_us = statistics.median(sum(v for k, v in t.items() if k.startswith("worker_")) for t in timings) * 1e6
    write_us = statistics.median(sum(v for k, v in t.items() if k.startswith("transfer_")) for t in timings) * 1e6
    worker_work = sum(v for k, v in sums.items() if k.endswith(" work") and not k.startswith(("server", "client")))
    floor_us = statistics.median(floor_samples) * 1e6
    messages = int(sums["messages"])
    latency_us = statistics.median((t1 - t0) / 1e3 for t0, t1 in clients.values())
    cost = decode_cost()
    result: dict[str, Any] = {
        "requests": len(clients),
        "latency_us": latency_us,
        "segments": [{"from": s.start, "to": s.end, "kind": s.kind, "median_us": s.median_us} for s in segments],
        "totals_us": sums,
        "worker_stages_us": stage_us,
        "mooncake_writes_us": write_us,
        "worker_work_beyond_stage_and_write_us": worker_work - stage_us - write_us,
        "floor_us": floor_us,
        "floor_per_message_us": floor_us / zmq_floor.summary(floor_samples)["messages"],
        "wire_per_message_us": sums.get("wire", 0.0) / messages,
        "decode_hot_us": cost["hot_us"],
        "decode_cold_us": cost["cold_us"],
    }
    print(f"hop trace: {len(clients)} sequential requests (zero-compute stages, {PAYLOAD_BYTES} B per hop), "
          f"median of each gap, latency {latency_us:.0f} us")  # fmt: skip
    for s in segments:
        print(f"  {s.median_us:7.1f} us  {s.kind:15s} {s.start} -> {s.end}")
    print("per request (us, sums of the medians):")
    wire = sums.get("wire", 0.0)
    print(f"  wire            {wire:7.0f}   ({messages} messages, {result['wire_per_message_us']:.0f} each)")
    print(f"  send            {sums.get('send', 0):7.0f}   (encode + ZMQ send, where send_message sends)")
    print(f"  receive         {sums.get('receive', 0):7.0f}   (receive returned -> decoded)")
    for kind in sorted(k for k in sums if k.endswith(" work")):
        print(f"  {kind:15s} {sums[kind]:7.0f}")
    print(f"  of the workers' work: stages {stage_us:.0f}, Mooncake writes {write_us:.0f}, the rest "
          f"{result['worker_work_beyond_stage_and_write_us']:.0f}")  # fmt: skip
    print(f"  raw ZMQ floor   {floor_us:7.0f}   ({result['floor_per_message_us']:.0f} per message: its send, wire and "
          f"receive; same run)")  # fmt: skip
    ratio = result["wire_per_message_us"] / result["floor_per_message_us"]
    print(f"  wire per message / floor per message  {ratio:.2f}x")
    print(f"decode of a transfer_ready header: {cost['hot_us']:.1f} us with warm caches, {cost['cold_us']:.1f} us "
          f"after {COLD_BYTES >> 20} MiB went through them")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
