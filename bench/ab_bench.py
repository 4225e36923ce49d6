"""Two code trees side by side: the control overhead of the same deployment run from each.

Deployments measured one after the other drift by +-0.2 ms between runs on a small shared host,
more than most changes to the message path are worth. Here both deployments are up at once and
take turns, block by block (A, B, B, A, A, B, ...), so both see the same moments of the host; the
ratio B / A is taken per block and its median reported.

Each side is a git revision checked out into a temporary worktree (`--base`, default HEAD), or
this working tree as it is (`--compare`, the default), and runs through PYTHONPATH: head and
workers import that tree's triptych (PYTHONSAFEPATH keeps `python -m`'s working directory, this
tree when run from its root, off their sys.path, where it would come ahead of PYTHONPATH). The
harness (this script, head_bench's sequential requests, triptych_dev.localdeploy) is this tree's,
so a revision must take the flags it passes. The workers run head_bench's zero-compute stages with
--payload-bytes per hop; the overhead is the latency less the Mooncake writes and the stages the
workers report.

    .venv/bin/python bench/ab_bench.py --base HEAD~1                   # this tree vs its parent's
    .venv/bin/python bench/ab_bench.py --base main --compare my-branch --blocks 8 --requests 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import head_bench  # noqa: E402

from triptych_dev.localdeploy import local_deployment  # noqa: E402
from triptych_dev.tiny_models import write_tiny_models  # noqa: E402

WORKING_TREE = "."
PACKAGE_DIRS = ("", "head", "worker", "operator", "devtools")  # where each tree's packages are imported from
BUILT = ("worker/triptych_worker/transfer/libtriptych_bind.so",)  # make setup's build outputs a tree needs


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def checkout(rev: str, tree: Path) -> Iterator[tuple[Path, str]]:
    """The tree of `rev`, checked out at `tree` (WORKING_TREE: this one, as it is), and a label naming it."""
    if rev == WORKING_TREE:
        dirty = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
        yield ROOT, f"working tree ({git('rev-parse', '--short', 'HEAD')}{dirty})"
        return
    commit = resolve(rev)
    git("worktree", "prune")  # registrations of worktrees an interrupted run left behind
    git("worktree", "add", "--detach", str(tree), commit)
    try:
        for path in BUILT:
            if (ROOT / path).exists():
                shutil.copy2(ROOT / path, tree / path)
        yield tree, f"{rev} ({commit[:7]})"
    finally:
        git("worktree", "remove", "--force", str(tree))


def resolve(rev: str) -> str:
    """The commit `rev` names; ValueError saying so when it names none."""
    try:
        return git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise ValueError(
            f"{rev!r} names no commit of {ROOT} (give a branch, tag, sha or HEAD~N; '.' for the working tree)"
        ) from None


def python_path(tree: Path) -> str:
    return os.pathsep.join(str(tree / d) if d else str(tree) for d in PACKAGE_DIRS)


def side_environment(tree: Path) -> dict[str, str]:
    """The variables a side's deployment runs with: `tree`'s packages on PYTHONPATH, and PYTHONSAFEPATH,
    without which `python -m` (how local_deployment starts each process) puts the working directory
    first on sys.path, and a revision's head and workers, run from this tree's root, import its triptych."""
    return {"PYTHONPATH": python_path(tree), "PYTHONSAFEPATH": "1"}


@contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """os.environ with `variables` set (what processes started meanwhile inherit), as it was after."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


KEYS = ("latency_ms", "overhead_ms")


def compare(args: argparse.Namespace) -> dict[str, Any]:
    (flux,) = write_tiny_models(ROOT / ".models", families=["tiny-flux"])
    blocks: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    every: dict[str, list[float]] = {"a": [], "b": []}  # each request's overhead, every block
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        labels, endpoints = {}, {}
        for side, rev in (("a", args.base), ("b", args.compare)):
            tree, labels[side] = stack.enter_context(checkout(rev, Path(tmp) / f"tree-{side}"))
            with environment(side_environment(tree)):  # what local_deployment's processes inherit
                dep = stack.enter_context(
                    local_deployment(
                        flux,
                        Path(tmp) / side,
                        worker_flags=("--device", "cpu"),
                        null_payload_bytes=args.payload_bytes,
                    )
                )
            endpoints[side] = f"tcp://127.0.0.1:{dep.scheduler_port}"
        for endpoint in endpoints.values():
            head_bench.sequential_samples(endpoint, args.warmup)
        for i in range(args.blocks):
            # A B, B A, A B, ...: neither side always runs first after the other.
            for side in ("a", "b") if i % 2 == 0 else ("b", "a"):
                latencies, writes, stages = head_bench.sequential_samples(endpoints[side], args.requests)
                overheads = [o * 1e3 for o in head_bench.per_request_overheads(latencies, writes, stages)]
                every[side] += overheads
                blocks[side].append(
                    {"latency_ms": statistics.median(latencies) * 1e3, "overhead_ms": statistics.median(overheads)}
                )
    ratios = [b["overhead_ms"] / a["overhead_ms"] for a, b in zip(blocks["a"], blocks["b"], strict=True)]
    return {
        "a": labels["a"],
        "b": labels["b"],
        "payload_bytes": args.payload_bytes,
        "requests_per_block": args.requests,
        "blocks": blocks,
        **{f"{side}_{key}": statistics.median(b[key] for b in blocks[side]) for side in "ab" for key in KEYS},
        "b_over_a": statistics.median(ratios),
        "b_over_a_per_block": ratios,
        **{f"{side}_overhead_p{q}_ms": head_bench.percentile(every[side], q / 100) for side in "ab" for q in (90, 99)},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="A: a git revision (default HEAD), or '.' for this working tree")
    p.add_argument("--compare", default=WORKING_TREE, help="B: a git revision, or '.' for this working tree (default)")
    p.add_argument("--blocks", type=int, default=8, help="alternating blocks per side")
    p.add_argument("--requests", type=int, default=200, help="sequential requests per block")
    p.add_argument("--warmup", type=int, default=100, help="sequential requests per side before the first block")
    p.add_argument("--payload-bytes", type=int, default=64 * 1024, help="bytes each hop hands over")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "ab.json")
    args = p.parse_args()
    if args.blocks < 1 or args.requests < 1:
        p.error("--blocks and --requests must be >= 1")
    for flag, rev in (("--base", args.base), ("--compare", args.compare)):
        if rev != WORKING_TREE:
            try:
                resolve(rev)
            except ValueError as exc:
                p.error(f"{flag}: {exc}")
    try:
        result = compare(args)
    except subprocess.CalledProcessError as exc:
        print(f"git {' '.join(exc.cmd[3:])} failed: {exc.stderr.strip()}", file=sys.stderr)
        return 2
    print(f"A: {result['a']}\nB: {result['b']}")
    print(
        f"zero-compute deployments side by side, {args.payload_bytes} B per hop, {args.blocks} alternating blocks "
        f"of {args.requests} sequential requests each; medians"
    )
    print(f"{'block':>5} {'A overhead':>11} {'B overhead':>11} {'B / A':>6}")
    for i, (a, b) in enumerate(zip(result["blocks"]["a"], result["blocks"]["b"], strict=True)):
        a_ms, b_ms = a["overhead_ms"], b["overhead_ms"]
        print(f"{i:>5} {a_ms:>8.3f} ms {b_ms:>8.3f} ms {b_ms / a_ms:>6.2f}")
    print(
        f"  control overhead  A {result['a_overhead_ms']:.3f} ms, B {result['b_overhead_ms']:.3f} ms; "
        f"B / A {result['b_over_a']:.2f} (median of the blocks' ratios)"
    )
    print(f"  latency           A {result['a_latency_ms']:.3f} ms, B {result['b_latency_ms']:.3f} ms")
    for q in (90, 99):
        a, b = result[f"a_overhead_p{q}_ms"], result[f"b_overhead_p{q}_ms"]
        print(f"  overhead p{q}      A {a:.3f} ms, B {b:.3f} ms (every request of every block)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
