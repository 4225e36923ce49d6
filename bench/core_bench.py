"""The head's decision core per request, with no socket: what its own Python costs, and what the
loop thread's metrics cost in it.

The core (head/triptych_head/core.py) is driven by the tests' harness (tests/unit/core_harness.py:
simulated workers answer its messages as the protocol says, a hand-moved clock, sends recorded
instead of sent) through whole requests of three roles, one at a time; the time inside the core's
entry points (a message from the frontend or a worker, and the dispatch after it) is summed per
request. Blocks alternate between the core as it is, whose per-request counters and histograms
are loop_metrics.py's, and the same core with those metrics as prometheus_client's Counter and
Histogram (what they were before): the ratio per block pair and its median.

    python bench/core_bench.py [--requests 3600] [--blocks 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "head", ROOT / "worker", ROOT / "devtools"):
    sys.path.insert(0, str(path))

from tests.unit.core_harness import Harness  # noqa: E402
from triptych.roles import Role  # noqa: E402
from triptych_head.loop_metrics import LoopCounter, LoopHistogram  # noqa: E402
from triptych_head.metrics import HeadMetrics  # noqa: E402

ENTRY_POINTS = ("on_frontend", "on_worker", "dispatch")


class CoreTimer:
    """Seconds spent inside the core's entry points since the last reset."""

    def __init__(self, core: Any) -> None:
        self.spent = 0.0
        for name in ENTRY_POINTS:
            setattr(core, name, self._timed(getattr(core, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - t0

        return timed


class MetricSets:
    """The head's loop metrics and prometheus_client twins of them (same names, labels, buckets),
    either set put in place on the head's HeadMetrics."""

    def __init__(self, metrics: HeadMetrics) -> None:
        self.metrics = metrics
        self.loop = {k: v for k, v in vars(metrics).items() if isinstance(v, (LoopCounter, LoopHistogram))}
        registry = CollectorRegistry()
        self.prometheus: dict[str, Any] = {}
        for attr, m in self.loop.items():
            if isinstance(m, LoopCounter):
                self.prometheus[attr] = Counter(m.name, m.documentation, m.labelnames, registry=registry)
            else:
                self.prometheus[attr] = Histogram(
                    m.name, m.documentation, m.labelnames, buckets=m.bounds, registry=registry
                )

    def use(self, which: dict[str, Any]) -> None:
        for attr, metric in which.items():
            setattr(self.metrics, attr, metric)
        self.metrics._children.clear()  # its cached children are the other set's


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3600, help="requests per variant, over all blocks")
    p.add_argument("--blocks", type=int, default=12, help="alternating blocks of each variant")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "core.json")
    args = p.parse_args()
    if args.blocks < 1 or args.requests < args.blocks:
        p.error("--blocks must be >= 1 and --requests >= --blocks")
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    timer = CoreTimer(h.core)
    sets = MetricSets(h.core.metrics)
    count = 0

    def block(n: int) -> float:
        """Microseconds of core time per request, over n requests one at a time."""
        nonlocal count
        timer.spent = 0.0
        for _ in range(n):
            count += 1
            h.submit(f"r{count}")
            for _ in range(50):  # a request takes 5 deliveries here; bounded all the same
                if not h.pending:
                    break
                h.deliver()
                h.answer()
            h.collect()
        return timer.spent / n * 1e6

    for which in (sets.prometheus, sets.loop):  # warm both
        sets.use(which)
        block(200)
    if h.core.requests:
        raise RuntimeError(f"requests left unfinished: {list(h.core.requests)[:5]}")
    per_block = args.requests // args.blocks
    loop_us: list[float] = []
    prom_us: list[float] = []
    for _ in range(args.blocks):
        sets.use(sets.prometheus)
        prom_us.append(block(per_block))
        sets.use(sets.loop)
        loop_us.append(block(per_block))
    if h.core.requests:
        raise RuntimeError(f"requests left unfinished: {list(h.core.requests)[:5]}")
    ratios = [a / b for a, b in zip(loop_us, prom_us, strict=True)]
    result = {
        "core_us_per_request": statistics.median(loop_us),
        "core_us_per_request_prometheus_client": statistics.median(prom_us),
        "loop_over_prometheus_client": statistics.median(ratios),
        "per_block": {"loop_us": loop_us, "prometheus_client_us": prom_us, "ratios": ratios},
        "requests_per_block": per_block,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"the head's decision core, no sockets, 3 roles, {args.blocks} alternating blocks of {per_block} requests")
    print(f"  core time per request, loop metrics        {result['core_us_per_request']:8.1f} us")
    print(f"  ... with prometheus_client for them        {result['core_us_per_request_prometheus_client']:8.1f} us")
    blocks = " ".join(f"{r:.2f}" for r in ratios)
    print(f"  loop / prometheus_client  {result['loop_over_prometheus_client']:8.2f}x  per block: {blocks}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
