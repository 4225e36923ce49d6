"""Where the head's two busy threads run: its loop thread and ZMQ's I/O thread, on one CPU or two.

Each message the head sends wakes ZMQ's I/O thread (an eventfd write), which then does the TCP
send; a wake-up on another CPU is an inter-processor interrupt, dearer than a context switch on a
small VM. One deployment of zero-compute workers (head_bench's), its head's threads re-pinned
block by block (os.sched_setaffinity on each thread), alternating three settings:

  free    every thread may run on any of the host's CPUs (the deployment's default)
  split   the loop thread on one CPU, the I/O thread on another
  same    both on the same CPU (the head's other threads stay free)

The loop thread is the head's Python thread that used the most CPU in the warm-up requests.
Medians of the blocks' per-request control overhead (latency less writes and stages).

    .venv/bin/python bench/head_pinning_bench.py --blocks 5 --requests 400
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import head_bench  # noqa: E402

from triptych.roles import Role  # noqa: E402
from triptych_dev.localdeploy import local_deployment  # noqa: E402
from triptych_dev.tiny_models import write_tiny_models  # noqa: E402

SETTINGS = ("free", "split", "same")


def threads(pid: int) -> dict[int, tuple[str, int]]:
    """Each thread of `pid`: its name and CPU ticks used so far (user + system)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        out[int(tid)] = (name, int(fields[11]) + int(fields[12]))
    return out


def set_affinity(tid: int, cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except ProcessLookupError:
        pass  # the thread ended meanwhile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=5, help="rounds of the three settings")
    p.add_argument("--requests", type=int, default=400, help="sequential requests per block")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--payload-bytes", type=int, default=64 * 1024)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "head_pinning.json")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        p.error(f"this process may run on {len(cpus)} CPU; the comparison needs two")
    (flux,) = write_tiny_models(ROOT / ".models", families=["tiny-flux"])
    overhead: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with (
        tempfile.TemporaryDirectory() as tmp,
        local_deployment(
            flux, Path(tmp), worker_flags=("--device", "cpu"), null_payload_bytes=args.payload_bytes
        ) as dep,
    ):
        endpoint = f"tcp://127.0.0.1:{dep.scheduler_port}"
        head = next(proc.popen.pid for proc in dep.procs if proc.role is Role.SERVER)
        before = threads(head)
        head_bench.sequential_samples(endpoint, args.warmup)
        used = {tid: (name, ticks - before.get(tid, (name, 0))[1]) for tid, (name, ticks) in threads(head).items()}
        io = [tid for tid, (name, _) in used.items() if name.startswith("ZMQbg/IO")]
        loop = max((ticks, tid) for tid, (name, ticks) in used.items() if not name.startswith("ZMQbg"))[1]

        def pin(setting: str) -> None:
            for tid in threads(head):
                set_affinity(tid, set(cpus))
            if setting != "free":
                set_affinity(loop, {cpus[0]})
                for tid in io:
                    set_affinity(tid, {cpus[0] if setting == "same" else cpus[1]})

        try:
            for _ in range(args.blocks):
                for setting in SETTINGS:
                    pin(setting)
                    lat, writes, stages = head_bench.sequential_samples(endpoint, args.requests)
                    overhead[setting].append(
                        statistics.median(head_bench.per_request_overheads(lat, writes, stages)) * 1e3
                    )
        finally:
            pin("free")
    result = {name: statistics.median(v) for name, v in overhead.items()}
    print(f"head's loop thread and ZMQ I/O thread ({len(io)}), {args.blocks} rounds of {args.requests} requests each")
    for name in SETTINGS:
        blocks = " ".join(f"{v:.2f}" for v in overhead[name])
        print(f"  {name:5}  control overhead {result[name]:.3f} ms (median)   blocks {blocks}")
    print(f"  same / free {result['same'] / result['free']:.2f}, split / free {result['split'] / result['free']:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    record = {"overhead_ms": result, "blocks_ms": overhead, "io_threads": len(io), **vars(args)}
    args.json.write_text(json.dumps(record, default=str, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
