"""Head rollout window: what clients see while the head is replaced, before and after replication,
both measured in the same run under the same load.

- before: one head, replaced as a `Recreate` Deployment does (SIGTERM, drain, exit, new head);
- after: two heads, replaced one at a time as a `RollingUpdate` with `maxUnavailable: 0` does
  (the head leaves the Service, its preStop pause, SIGTERM and drain, the new one joins).

The load is one image request every --interval seconds through an emulated Service
(triptych_dev.rollout: the client's list of ready endpoints), on null workers (real processes,
ZMQ and Mooncake, no model compute). Reported: failed requests, and the unavailability window
(the longest span in which every request failed).

    python bench/rollout_bench.py [--interval 0.1] [--settle 3]

Prints a table and writes bench/results/rollout.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from triptych.roles import Role  # noqa: E402
from triptych_dev.localdeploy import local_deployment  # noqa: E402
from triptych_dev.rollout import ServiceLoad, recreate_head, roll_heads  # noqa: E402
from triptych_dev.tiny_models import write_tiny_models  # noqa: E402

BODY = {"prompt": "a lighthouse at dusk", "size": "32x32", "num_inference_steps": 2}


def measure(model: Path, heads: int, args: argparse.Namespace) -> dict[str, Any]:
    counts = {Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1}
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        with local_deployment(
            model, Path(tmp), counts, null_payload_bytes=4096, worker_flags=("--step-seconds", "0.01"), heads=heads,
        ) as dep:  # fmt: skip
            with ServiceLoad(list(dep.head_urls), BODY, interval=args.interval) as load:
                time.sleep(args.settle)
                started = time.monotonic()
                if heads == 1:
                    recreate_head(dep)
                else:
                    roll_heads(dep, load)
                rollout_s = time.monotonic() - started
                time.sleep(args.settle)
    failed = load.failed()
    return {
        "heads": heads,
        "strategy": "Recreate" if heads == 1 else "RollingUpdate (maxUnavailable 0)",
        "rollout_s": rollout_s,
        "requests": len(load.answers),
        "failed": len(failed),
        "unavailable_s": load.unavailable_s(),
        "failures": sorted({f"{a.status} {a.detail[:80]}" for a in failed})[:5],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", type=float, default=0.1, help="seconds between requests")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of load before and after the rollout")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "rollout.json")
    args = p.parse_args()
    (flux,) = write_tiny_models(ROOT / ".models", families=["tiny-flux"])
    rows = [measure(flux, heads, args) for heads in (1, 2)]
    for row in rows:
        print(
            f"{row['heads']} head(s), {row['strategy']}: rollout {row['rollout_s']:.1f} s, "
            f"{row['failed']} of {row['requests']} requests failed, unavailable {row['unavailable_s']:.1f} s",
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
