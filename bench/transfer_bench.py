"""Transfer-layer benchmark: memcpy floor vs raw Mooncake write vs Triptych's stage+write+load.

Runs a receiver in a second process (this script with --role receiver, JSON lines over stdin/
stdout) and, for each payload size, measures side by side:

  memcpy   torch copy of N bytes into a preallocated CPU buffer (the floor)
  raw      TransferEngine.transfer_sync_write of N bytes from a registered buffer to the peer
  write    MooncakeTransport.write of the same bytes (our wrapper; should match raw)
  ours     what the workers run, for a FLUX-like tensor set of about N bytes: the outputs sent
           where they are (stage_in_place: CPU tensors registered with the TCP transport, one write
           per tensor, as compute.py and pushes.py do) + on the receiver the worker's InputLoader
           taking the inputs in place (views on the slot, held) and releasing the slot after the
           stage, as a CPU worker does (inputs.py). The copy a GPU receiver makes instead
           (load_tensors) is timed too, outside the total.
  pooled   the same with the outputs copied into the pool first (stage_tensors: one copy, what RDMA
           and GPU outputs still do, and what every output did before 2026-12-03).

The runs alternate in --blocks blocks in this one process lifetime: each block takes the baselines
(memcpy, raw back to back), then the measured paths in rounds, each round one run of raw, write,
ours and pooled in an order that rotates round by round, so the host's drift (large on a small
shared VM: raw alone varies 1.6-2.8 GB/s between runs at 1 MiB) falls on baseline and measured
alike. Figures are medians over at most --iterations runs per path (split over the blocks, each
block's loops bounded by --max-seconds in all); each ratio is also computed per block, and the
table gives the median of those.
Results print as a table and are written as JSON to --json (default bench/results/transfer.json).

    .venv/bin/python bench/transfer_bench.py --sizes-mib 1 16 64 --iterations 10 --blocks 5
"""

from __future__ import annotations

import argparse
import functools
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

from triptych.params import GenerationParams
from triptych_worker.inputs import InputLoader
from triptych_worker.job_groups import Job
from triptych_worker.transfer import (
    Allocation,
    InPlaceTensors,
    MooncakeTransport,
    TransferPool,
    layout,
    load_tensors,
    precise_sleeps,
    stage_in_place,
    stage_tensors,
)

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


class _NoLink:
    """The receiver reports freed space to no head."""

    def close(self) -> None:
        pass


def run_receiver(args: argparse.Namespace) -> None:
    """Own a pool and one slot; answer 'slot' (reallocate) and 'load' (time the worker's input path)."""
    transport = MooncakeTransport(args.hostname, args.ib_device)
    pool = TransferPool(args.receiver_pool_bytes, "bench-receiver", transport)
    # The worker's input loader as a CPU worker runs it: inputs in place, the slot held until released.
    # The slot stays allocated across runs, as a standing slot does (the release frees nothing).
    inputs = InputLoader(pool, "cpu", 0, release=lambda alloc, link: None, cancelled=lambda rid: False,
                         make_link=_NoLink, in_place=True)  # type: ignore[arg-type]  # fmt: skip
    params = GenerationParams("bench", 64, 64)
    link: Any = None  # the release above reports to no head
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
            job = Job("bench", params, (slot, command["manifest"], {}))
            t0 = time.perf_counter()
            taken = inputs.take(job, link)  # the stage would run here, on these views
            inputs.release(taken, link)
            t1 = time.perf_counter()
            assert taken.held is slot, "the inputs were used in place"
            copied = load_tensors(pool, slot, command["manifest"], "cpu")  # a GPU worker's copy (to "cpu" here)
            t2 = time.perf_counter()
            assert copied.keys() == taken.tensors.keys()
            reply = {"load_s": t1 - t0, "copy_s": t2 - t1, "count": len(taken.tensors)}
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
    """Alternating blocks (--blocks) in one process lifetime: each block takes the baselines (memcpy,
    raw back to back) and then the measured paths in rounds (one run of each per round, the order
    rotating), so drift of the shared host falls on all alike; ratios per block and medians."""
    blocks = args.blocks
    per_block = max(1, -(-args.iterations // blocks))  # --iterations over all blocks, rounded up
    src_cpu = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst_cpu = torch.empty_like(src_cpu)

    def memcpy_once() -> None:
        dst_cpu.copy_(src_cpu)

    src = pool.allocate(nbytes, "raw")
    assert src is not None
    pool.view(src).copy_(src_cpu)
    raw_dest = peer.ask({"op": "slot", "nbytes": nbytes})["addr"]
    engine = transport.engine

    def raw_once() -> None:
        rc = engine.transfer_sync_write(peer.session, src.addr, raw_dest, nbytes)
        if rc != 0:
            raise RuntimeError(f"raw transfer_sync_write returned {rc}")

    def raw_run() -> float:
        # One receiver round trip before each write, as `ours` has (it lets the peer's engine threads
        # go idle), then the write alone is timed.
        peer.ask({"op": "ping"})
        t0 = time.perf_counter()
        raw_once()
        return time.perf_counter() - t0

    def write_run() -> float:
        peer.ask({"op": "ping"})
        t0 = time.perf_counter()
        transport.write(peer.session, src.addr, raw_dest, nbytes)
        return time.perf_counter() - t0

    tensors = flux_like_tensors(nbytes)
    ours_bytes = payload_bytes(tensors)
    _, staged_extent = layout(tensors)
    ours_dest = peer.ask({"op": "slot", "nbytes": staged_extent})["addr"]
    phase: dict[str, float] = {}

    def send(in_place: bool) -> float:
        """What compute.py and pushes.py do with a role's outputs: sent where they are (TCP, CPU
        tensors: stage_in_place) or copied into the pool (stage_tensors, as over RDMA), written into
        the receiver's slot, then loaded there by the worker's InputLoader."""
        t0 = time.perf_counter()
        staged = (
            stage_in_place(transport, tensors, pool.pool_bytes) if in_place else stage_tensors(pool, tensors, "ours")
        )
        t1 = time.perf_counter()
        assert staged is not None, "in place: the bench's tensors are CPU and contiguous"
        if isinstance(staged, InPlaceTensors):
            staged.submit_write(peer.session, ours_dest).wait()
            t2 = time.perf_counter()
            staged.release()
        else:
            transport.write(peer.session, staged.allocation.addr, ours_dest, staged.nbytes)
            t2 = time.perf_counter()
            pool.free(staged.allocation)
        loaded = peer.ask({"op": "load", "manifest": staged.manifest})
        load_s = float(loaded["load_s"])
        phase.update(stage=t1 - t0, write=t2 - t1, load=load_s, copy=float(loaded["copy_s"]))
        return (t2 - t0) + load_s

    def ours() -> float:
        total = send(in_place=True)
        for k in phases:
            phases[k].append(phase[k])
        return total

    def pooled() -> float:
        total = send(in_place=False)
        for k in pooled_phases:
            pooled_phases[k].append(phase[k])
        return total

    measured: dict[str, Callable[[], float]] = {"raw": raw_run, "write": write_run, "ours": ours, "pooled": pooled}
    rounds = 0

    def one_round(block: dict[str, list[float]]) -> float:
        """Each measured path once into `block`, in an order that rotates round by round: every path
        sees the same moment of the shared host, and none is always first after the baselines or last."""
        nonlocal rounds
        names = list(measured)
        shift = rounds % len(names)
        rounds += 1
        for name in names[shift:] + names[:shift]:
            block[name].append(measured[name]())
        return 0.0

    # Warm-up runs once, before the first block, for every path.
    phases: dict[str, list[float]] = {"stage": [], "write": [], "load": [], "copy": []}
    pooled_phases: dict[str, list[float]] = {"stage": [], "write": [], "load": []}
    for fn in (memcpy_once, raw_once, raw_run, write_run, ours, pooled):
        for _ in range(args.warmup):
            fn()
    for runs in (*phases.values(), *pooled_phases.values()):
        runs.clear()  # the warm-up's are not reported
    paths = ("memcpy", "raw_b2b", "raw", "write", "ours", "pooled")
    samples: dict[str, list[float]] = {k: [] for k in paths}
    per_block_rates: list[dict[str, float]] = []
    loop = {"iterations": per_block, "warmup": 0, "max_seconds": args.max_seconds / blocks}

    def mb_s(size: int, xs: list[float]) -> float:
        return size / MB / statistics.median(xs)

    for _ in range(blocks):
        block: dict[str, list[float]] = {k: [] for k in paths}
        # baselines
        block["memcpy"] = timed_loop(memcpy_once, **loop)
        block["raw_b2b"] = timed_loop(raw_once, **loop)
        timed_loop(functools.partial(one_round, block), **loop)  # the measured paths, round by round
        for k in paths:
            samples[k] += block[k]
        rates = {k: mb_s(ours_bytes if k in ("ours", "pooled") else nbytes, block[k]) for k in paths}
        per_block_rates.append(rates)
    pool.free(src)

    def ratios(num: str, den: str) -> list[float]:
        return [r[num] / r[den] for r in per_block_rates]

    memcpy_rate, raw_rate = mb_s(nbytes, samples["memcpy"]), mb_s(nbytes, samples["raw"])
    write_rate, ours_rate = mb_s(nbytes, samples["write"]), mb_s(ours_bytes, samples["ours"])
    per_block = {
        "ours_over_raw": ratios("ours", "raw"),
        "pooled_over_raw": ratios("pooled", "raw"),
        "raw_over_memcpy": ratios("raw", "memcpy"),
        "write_over_raw": ratios("write", "raw"),
    }
    return {
        "bytes": nbytes,
        "ours_payload_bytes": ours_bytes,
        "ours_staged_bytes": staged_extent,
        "blocks": blocks,
        "iterations": {
            "memcpy": len(samples["memcpy"]),
            "raw_back_to_back": len(samples["raw_b2b"]),
            "raw": len(samples["raw"]),
            "write": len(samples["write"]),
            "ours": len(samples["ours"]),
            "pooled": len(samples["pooled"]),
        },
        "memcpy_mb_s": memcpy_rate,
        "raw_back_to_back_mb_s": mb_s(nbytes, samples["raw_b2b"]),
        "raw_mooncake_mb_s": raw_rate,
        "write_mb_s": write_rate,
        "ours_mb_s": ours_rate,
        "pooled_mb_s": mb_s(ours_bytes, samples["pooled"]),
        "ours_phase_ms": {k: statistics.median(v) * 1e3 for k, v in phases.items()},
        "pooled_phase_ms": {k: statistics.median(v) * 1e3 for k, v in pooled_phases.items()},
        # Ratios: the median over blocks of each block's ratio (a block's baseline and measured runs
        # are minutes apart at most), and each block's own.
        **{k: statistics.median(v) for k, v in per_block.items()},
        "per_block": per_block,
    }


def print_table(results: list[dict[str, Any]], protocol: str) -> None:
    header = (
        f"{'size':>8} {'memcpy':>8} {'raw b2b':>8} {'raw':>8} {'write':>8} {'ours':>8} "
        f"{'ours/raw':>9} {'pooled/raw':>11} {'raw/memcpy':>11} {'write/raw':>10}   "
        "ours phases stage/write/load (copy) ms"
    )
    print(f"\nMooncake {protocol} transfer: median MB/s (MB = 1e6 bytes) and ratios")
    print(header)
    print("-" * len(header))
    for r in results:
        p = r["ours_phase_ms"]
        print(
            f"{r['bytes'] / MIB:>5.0f}MiB {r['memcpy_mb_s']:>8.0f} {r['raw_back_to_back_mb_s']:>8.0f} "
            f"{r['raw_mooncake_mb_s']:>8.0f} {r['write_mb_s']:>8.0f} {r['ours_mb_s']:>8.0f} {r['ours_over_raw']:>9.1%} "
            f"{r['pooled_over_raw']:>11.1%} {r['raw_over_memcpy']:>11.1%} {r['write_over_raw']:>10.1%}   "
            f"{p['stage']:.2f} / {p['write']:.2f} / {p['load']:.3f} ({p['copy']:.2f})"
        )
    for r in results:
        blocks = " ".join(
            f"{a:.0%}/{b:.0%}"
            for a, b in zip(r["per_block"]["write_over_raw"], r["per_block"]["ours_over_raw"], strict=True)
        )
        print(f"{r['bytes'] / MIB:>5.0f}MiB write/raw and ours/raw per block ({r['blocks']} blocks): {blocks}")
        p = r["pooled_phase_ms"]
        print(
            f"{r['bytes'] / MIB:>5.0f}MiB pooled phases stage/write/load {p['stage']:.2f} / {p['write']:.2f} / "
            f"{p['load']:.3f} ms (the stage: the copy into the pool; the write: one range)"
        )
    print(
        "ratios are medians of the per-block ratios; each block: memcpy and raw b2b (baselines), then\n"
        "rounds of raw, write, ours and pooled (one run each, order rotating), in this one process lifetime.\n"
        "memcpy: torch copy into a preallocated buffer; raw b2b: transfer_sync_write back to back;\n"
        "raw / write: transfer_sync_write / MooncakeTransport.write, each after a receiver round trip\n"
        "(the cadence `ours` has); ours: the outputs sent in place (stage_in_place, one write per\n"
        "tensor) + the worker's InputLoader taking the inputs in place and releasing the slot, of a\n"
        "FLUX-like set; pooled: the same with the copy into the pool (stage_tensors) that RDMA and GPU\n"
        "outputs still make; (copy): load_tensors of the same slot, what a GPU worker does instead."
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
        "config": {
            k: getattr(args, k) for k in ("sizes_mib", "iterations", "blocks", "warmup", "max_seconds", "torch_threads")
        },
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
    parser.add_argument(
        "--iterations", type=int, default=10, help="measured runs per path and size over all blocks (max)"
    )
    parser.add_argument(
        "--blocks", type=int, default=5, help="alternating baseline/measured blocks per size, in one process lifetime"
    )
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured runs per path and size")
    parser.add_argument(
        "--max-seconds", type=float, default=20.0, help="time bound per path and size, shared by the blocks"
    )
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
    if args.iterations < 1 or args.blocks < 1 or args.warmup < 0 or args.max_seconds <= 0 or args.torch_threads < 1:
        parser.error("--iterations, --blocks and --torch-threads must be >= 1, --warmup >= 0 and --max-seconds > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    precise_sleeps()  # as a worker's threads sleep (triptych_worker.transfer.waiting)
    if args.role == "receiver":
        run_receiver(args)
    else:
        run_sender(args)


if __name__ == "__main__":
    main()
