"""Transfer-layer benchmark: memcpy floor vs raw Mooncake write vs Triptych's stage+write+load.

Runs a receiver in a second process (this script with --role receiver, JSON lines over stdin/
stdout) and, for each payload size, measures side by side:

  memcpy   torch copy of N bytes into a preallocated CPU buffer (the floor)
  raw      TransferEngine.transfer_sync_write of N bytes from a registered buffer to the peer
  write    MooncakeTransport.write of the same bytes (our wrapper; should match raw)
  ours     stage_tensors (copy into the pool) + MooncakeTransport.write + load_tensors on the
           receiver, for a FLUX-like tensor set of about N bytes

Medians over at most --iterations runs per path, each loop also bounded by --max-seconds.
Results print as a table and are written as JSON to --json (default bench/results/transfer.json).

    .venv/bin/python bench/transfer_bench.py --sizes-mib 1 16 64 --iterations 10
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from triptych_worker.transfer import Allocation, MooncakeTransport, TransferPool, layout, load_tensors, stage_tensors

MIB = 1024 * 1024
MB = 1e6
REPLY_TIMEOUT_S = 60.0
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "transfer.json"


def flux_like_tensors(target_bytes: int) -> dict[str, torch.Tensor]:
    """FLUX-shaped encoder output of about `target_bytes`: T5 prompt embeds dominate, latents ~1/9.

    At 1024x1024 FLUX hands over prompt_embeds [1, 512, 4096] bf16 (4 MiB), pooled [1, 768] bf16
    and packed latents [1, 4096, 64] bf16 (512 KiB); this keeps those proportions.
    """
    g = torch.Generator().manual_seed(0)
    latent_tokens = max(1, target_bytes // 9 // (64 * 2))
    pooled_bytes = 768 * 2
    prompt_tokens = max(1, (target_bytes - latent_tokens * 64 * 2 - pooled_bytes) // (4096 * 2))
    return {
        "prompt_embeds": torch.randn(1, prompt_tokens, 4096, generator=g).to(torch.bfloat16),
        "pooled_prompt_embeds": torch.randn(1, 768, generator=g).to(torch.bfloat16),
        "latents": torch.randn(1, latent_tokens, 64, generator=g).to(torch.bfloat16),
    }


def payload_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def timed_loop(fn: Callable[[], float | None], iterations: int, warmup: int, max_seconds: float) -> list[float]:
    """Seconds per call of `fn` (or what it returns, if not None), bounded in count and time."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    deadline = time.monotonic() + max_seconds
    while len(samples) < iterations and time.monotonic() < deadline:
        t0 = time.perf_counter()
        reported = fn()
        samples.append(reported if reported is not None else time.perf_counter() - t0)
    return samples


# -- receiver process ---------------------------------------------------------------------------


def run_receiver(args: argparse.Namespace) -> None:
    """Own a pool and one slot; answer 'slot' (reallocate) and 'load' (time load_tensors) commands."""
    transport = MooncakeTransport(args.hostname, args.ib_device)
    pool = TransferPool(args.receiver_pool_bytes, "bench-receiver", transport)
    slot: Allocation | None = None
    print(json.dumps({"session": transport.session_id}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "slot":
            if slot is not None:
                pool.free(slot)
            slot = pool.allocate(int(command["nbytes"]), "bench")
            assert slot is not None, "receiver pool too small for the requested slot"
            reply: dict[str, Any] = {"addr": slot.addr, "nbytes": slot.nbytes}
        elif command["op"] == "load":
            assert slot is not None
            t0 = time.perf_counter()
            tensors = load_tensors(pool, slot, command["manifest"], "cpu")
            reply = {"load_s": time.perf_counter() - t0, "count": len(tensors)}
        elif command["op"] == "ping":
            reply = {}
        else:
            break
        print(json.dumps(reply), flush=True)
    # Skip Mooncake's ~1 s engine teardown; the process is done.
    os._exit(0)


class ReceiverProcess:
    """This script started with --role receiver; bounded waits on each reply."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._log: IO[str] = tempfile.TemporaryFile("w+")
        command = [sys.executable, __file__, "--role", "receiver", "--hostname", args.hostname]
        command += ["--receiver-pool-bytes", str(args.receiver_pool_bytes), "--torch-threads", str(args.torch_threads)]
        if args.ib_device:
            command += ["--ib-device", args.ib_device]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.session: str = self._read()["session"]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def _read(self) -> dict[str, Any]:
        try:
            return json.loads(self._lines.get(timeout=REPLY_TIMEOUT_S))
        except queue.Empty:
            self._log.seek(0)
            raise RuntimeError(f"receiver did not answer; its log:\n{self._log.read()[-3000:]}") from None

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=5)
        self._log.close()


# -- sender side --------------------------------------------------------------------------------


def bench_size(
    nbytes: int, args: argparse.Namespace, transport: MooncakeTransport, pool: TransferPool, peer: ReceiverProcess
) -> dict[str, Any]:
    loop = {"iterations": args.iterations, "warmup": args.warmup, "max_seconds": args.max_seconds}

    src_cpu = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst_cpu = torch.empty_like(src_cpu)

    def memcpy_once() -> None:
        dst_cpu.copy_(src_cpu)

    memcpy = timed_loop(memcpy_once, **loop)

    src = pool.allocate(nbytes, "raw")
    assert src is not None
    pool.view(src).copy_(src_cpu)
    dest = peer.ask({"op": "slot", "nbytes": nbytes})["addr"]
    engine = transport.engine

    def raw_once() -> None:
        rc = engine.transfer_sync_write(peer.session, src.addr, dest, nbytes)
        if rc != 0:
            raise RuntimeError(f"raw transfer_sync_write returned {rc}")

    raw_b2b = timed_loop(raw_once, **loop)

    raw_samples: list[float] = []
    write_samples: list[float] = []

    def raw_then_wrapper() -> float:
        # Same cadence as `ours` (one receiver round trip before each write, which lets the peer's
        # engine threads go idle) and interleaved, so both paths see the same load on shared cores.
        peer.ask({"op": "ping"})
        t0 = time.perf_counter()
        raw_once()
        t1 = time.perf_counter()
        peer.ask({"op": "ping"})
        t2 = time.perf_counter()
        transport.write(peer.session, src.addr, dest, nbytes)
        t3 = time.perf_counter()
        raw_samples.append(t1 - t0)
        write_samples.append(t3 - t2)
        return t3 - t0

    timed_loop(raw_then_wrapper, **loop)
    warm = args.warmup
    raw, write = raw_samples[warm:], write_samples[warm:]
    pool.free(src)

    tensors = flux_like_tensors(nbytes)
    _, staged_extent = layout(tensors)
    dest = peer.ask({"op": "slot", "nbytes": staged_extent})["addr"]
    phases: dict[str, list[float]] = {"stage": [], "write": [], "load": []}

    def ours() -> float:
        t0 = time.perf_counter()
        staged = stage_tensors(pool, tensors, "ours")
        t1 = time.perf_counter()
        assert staged is not None
        transport.write(peer.session, staged.allocation.addr, dest, staged.nbytes)
        t2 = time.perf_counter()
        pool.free(staged.allocation)
        load_s = float(peer.ask({"op": "load", "manifest": staged.manifest})["load_s"])
        phases["stage"].append(t1 - t0)
        phases["write"].append(t2 - t1)
        phases["load"].append(load_s)
        return (t2 - t0) + load_s

    ours_total = timed_loop(ours, **loop)
    ours_bytes = payload_bytes(tensors)

    def mb_s(size: int, samples: list[float]) -> float:
        return size / MB / statistics.median(samples)

    memcpy_rate, raw_rate = mb_s(nbytes, memcpy), mb_s(nbytes, raw)
    write_rate, ours_rate = mb_s(nbytes, write), mb_s(ours_bytes, ours_total)
    return {
        "bytes": nbytes,
        "ours_payload_bytes": ours_bytes,
        "ours_staged_bytes": staged_extent,
        "iterations": {
            "memcpy": len(memcpy),
            "raw_back_to_back": len(raw_b2b),
            "raw": len(raw),
            "write": len(write),
            "ours": len(ours_total),
        },
        "memcpy_mb_s": memcpy_rate,
        "raw_back_to_back_mb_s": mb_s(nbytes, raw_b2b),
        "raw_mooncake_mb_s": raw_rate,
        "write_mb_s": write_rate,
        "ours_mb_s": ours_rate,
        "ours_phase_ms": {k: statistics.median(v[warm:]) * 1e3 for k, v in phases.items()},
        "ours_over_raw": ours_rate / raw_rate,
        "raw_over_memcpy": raw_rate / memcpy_rate,
        "write_over_raw": write_rate / raw_rate,
    }


def print_table(results: list[dict[str, Any]], protocol: str) -> None:
    header = (
        f"{'size':>8} {'memcpy':>8} {'raw b2b':>8} {'raw':>8} {'write':>8} {'ours':>8} "
        f"{'ours/raw':>9} {'raw/memcpy':>11} {'write/raw':>10}   ours phases stage/write/load ms"
    )
    print(f"\nMooncake {protocol} transfer: median MB/s (MB = 1e6 bytes) and ratios")
    print(header)
    print("-" * len(header))
    for r in results:
        p = r["ours_phase_ms"]
        print(
            f"{r['bytes'] / MIB:>5.0f}MiB {r['memcpy_mb_s']:>8.0f} {r['raw_back_to_back_mb_s']:>8.0f} "
            f"{r['raw_mooncake_mb_s']:>8.0f} {r['write_mb_s']:>8.0f} {r['ours_mb_s']:>8.0f} {r['ours_over_raw']:>9.1%} "
            f"{r['raw_over_memcpy']:>11.1%} {r['write_over_raw']:>10.1%}   "
            f"{p['stage']:.2f} / {p['write']:.2f} / {p['load']:.2f}"
        )
    print(
        "memcpy: torch copy into a preallocated buffer; raw b2b: transfer_sync_write back to back;\n"
        "raw / write: transfer_sync_write / MooncakeTransport.write, each after a receiver round trip\n"
        "(the cadence `ours` has); ours: stage_tensors + write + load_tensors of a FLUX-like set."
    )


def environment(protocol: str) -> dict[str, Any]:
    versions = {}
    for dist in ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "protocol": protocol,
        "torch": torch.__version__,
        "mooncake": versions,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }


def run_sender(args: argparse.Namespace) -> None:
    sizes = [int(s * MIB) for s in args.sizes_mib]
    largest = max(sizes)
    args.receiver_pool_bytes = largest + MIB
    transport = MooncakeTransport(args.hostname, args.ib_device)
    # Room for the raw-path source and one staged payload (plus alignment padding).
    pool = TransferPool(2 * largest + 2 * MIB, "bench-sender", transport)
    peer = ReceiverProcess(args)
    try:
        results = []
        for nbytes in sizes:
            print(f"measuring {nbytes / MIB:.0f} MiB ...", file=sys.stderr, flush=True)
            results.append(bench_size(nbytes, args, transport, pool, peer))
    finally:
        peer.close()
    print_table(results, transport.protocol)
    report = {
        "environment": environment(transport.protocol),
        "config": {k: getattr(args, k) for k in ("sizes_mib", "iterations", "warmup", "max_seconds", "torch_threads")},
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    sys.stdout.flush()
    os._exit(0)  # skip Mooncake's ~1 s engine teardown


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64], help="payload sizes in MiB")
    parser.add_argument("--iterations", type=int, default=10, help="measured runs per path and size (max)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured runs per path and size")
    parser.add_argument("--max-seconds", type=float, default=20.0, help="time bound per measurement loop")
    parser.add_argument("--hostname", default="127.0.0.1", help="like --disagg-p2p-hostname")
    parser.add_argument("--ib-device", default=None, help="like --disagg-ib-device; omit for TCP")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads in both processes; more than 1 makes CPU copies slower on busy shared cores",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    parser.add_argument("--role", choices=["sender", "receiver"], default="sender", help=argparse.SUPPRESS)
    parser.add_argument("--receiver-pool-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0 or args.max_seconds <= 0 or args.torch_threads < 1:
        parser.error("--iterations and --torch-threads must be >= 1, --warmup >= 0 and --max-seconds > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    if args.role == "receiver":
        run_receiver(args)
    else:
        run_sender(args)


if __name__ == "__main__":
    main()
