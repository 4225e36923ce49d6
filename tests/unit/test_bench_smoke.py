"""Every benchmark in bench/ runs briefly and exits 0 (`make test` runs this), so none rots unseen.

Each script runs in its own process with small sizes and short windows through its own flags, its
results written under tmp_path (bench/results/ keeps the real runs). The figures are not checked:
on a small shared machine they say little; that the script runs to the end and prints its table is
what is checked. The CUDA part of the benchmarks that have one (`--device cuda`) is skipped without
a CUDA GPU; scripts/gpu-check.sh runs them at full size on a GPU machine. The operator benchmark
needs the local control plane, so it is a cluster test. Total on 2 loaded cores: under 4 minutes.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from triptych_dev.localdeploy import free_port_block

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
TIMEOUT_S = 240

# script -> (smoke flags, shell-quoted, and the text its output must contain). "{tmp}" is the test's tmp_path.
SMOKE: dict[str, tuple[str, str]] = {
    "transfer_bench.py": (
        "--sizes-mib 1 --iterations 2 --blocks 2 --warmup 1 --max-seconds 2 --json {tmp}/t.json",
        "write/raw and ours/raw per block",
    ),
    "head_bench.py": (
        "--requests 20 --sequential 10 --concurrency 4 --transfer-mib 1 --auth-blocks 2 --auth-block-requests 5 "
        "--load-ahead-mib 1 --load-ahead-requests 4 --load-ahead-concurrency 2 --blocks 2 --json {tmp}/h.json",
        "overhead / floor",
    ),
    "zmq_floor.py": ("--requests 20", "raw ZMQ messages"),
    "ab_bench.py": ("--blocks 2 --requests 5 --warmup 2 --json {tmp}/ab.json", "B / A"),
    "head_pinning_bench.py": ("--blocks 1 --requests 5 --warmup 5 --json {tmp}/hp.json", "same / free"),
    "core_bench.py": ("--requests 40 --blocks 2 --json {tmp}/c.json", "loop / prometheus_client"),
    "hop_bench.py": ("--requests 20 --blocks 2 --json {tmp}/hop.json", "wire per message / floor per message"),
    "http_app_bench.py": ("--requests 20 --blocks 2 --json {tmp}/ha.json", "direct / declared"),
    "tracing_bench.py": ("--blocks 2 --block-requests 5 --json {tmp}/tr.json", "on / off"),
    "torch_threads_bench.py": ("--size 32 --steps 1 --runs 1 --threads 2 --json {tmp}/tt.json", "x fitted"),
    "media_bench.py": ("--sizes 64 --frames 3 --burst 2 --burst-size 128 --json {tmp}/m.json", "MediaPool / default"),
    "scaling_bench.py": (
        "--denoisers 1,2 --stage-seconds 0.05 --warmup 0.3 --window 1 --json {tmp}/s.json",
        "of linear",
    ),
    "heads_bench.py": (
        "--heads 1,2 --denoisers 2 --stage-seconds 0.05 --warmup 0.3 --window 1 --json {tmp}/hs.json",
        "2 heads:",
    ),
    "preemption_bench.py": ("--window 4 --json {tmp}/pr.json", "short-class p99 off/on"),
    "drain_bench.py": ("--video-seconds 3 --steps 15 --after 0.5 --repeats 1 --json {tmp}/d.json", "drain off/on"),
    "rollout_bench.py": ("--interval 0.1 --settle 0.5 --json {tmp}/r.json", "RollingUpdate"),
    "pipeline_bench.py": (
        "--size 64x64 --steps 2 --requests 2 --omp-threads 1 --json {tmp}/p.json",
        "disaggregated",
    ),
    "batching_bench.py": (
        "--sizes 64x64 --batch-sizes 1,2 --images 2 --steps 1 --rounds 1 --json {tmp}/b.json",
        "images/s",
    ),
    "parallel_bench.py": (
        "--size 64x64 --frames 5 --steps 1 --jobs 1 --configs '2 ranks cfg' --master-port {port} --json {tmp}/pp.json",
        "2 ranks cfg",
    ),
    "preview_bench.py": ("--repeats 2 --models {models}", "tiny-wan"),
    "step_cache_bench.py": (
        "--models tiny-flux,tiny-wan --size 64x64 --frames 5 --steps 2 --rounds 1 --json {tmp}/sc.json",
        "pyramid_attention_broadcast",
    ),
    "cold_start_bench.py": ("--model {models}/tiny-flux --rounds 1 --json {tmp}/cs.json", "served/mono"),
    "random_wan.py": ("--out {tmp}/random-wan --num-layers 1 --dtype bfloat16", "random-wan"),
    "lora_bench.py": ("--models {models} --size 32x32 --steps 2 --rounds 1 --json {tmp}/lora.json", "switch cost"),
}
CLUSTER_SMOKE = {"operator_bench.py": ("--pipelines 2 --steady 1 --json {tmp}/o.json", "pipelines")}
# bench/ scripts that are no benchmark of their own: run_all.py runs the others at full size (`make bench`).
NOT_BENCHMARKS = {"run_all.py"}
# The benchmarks with a CUDA part: its smoke run on a CUDA GPU, the same flags plus --device cuda.
CUDA_PARTS = ("pipeline_bench.py", "batching_bench.py", "parallel_bench.py")


def run_bench(script: str, flags: str, tmp_path: Path, models: Path) -> str:
    port = str(free_port_block(8))
    args = [f.format(tmp=tmp_path, port=port, models=models) for f in shlex.split(flags)]
    dirs = [str(ROOT / d) for d in ("", "head", "worker", "operator", "devtools")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*dirs, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}:\n{out[-6000:]}"
    return proc.stdout


def test_every_bench_script_has_a_smoke_run():
    scripts = {p.name for p in BENCH.glob("*.py") if "__main__" in p.read_text()}
    assert scripts - NOT_BENCHMARKS == set(SMOKE) | set(CLUSTER_SMOKE)
    run_all = (BENCH / "run_all.py").read_text()
    listed = {name for name in scripts if f'"{name}"' in run_all}
    assert listed, "run_all.py names no benchmark"
    assert all((BENCH / name).exists() for name in listed)


# A benchmark's other comparison, run by a flag of its own: (script, smoke flags, expected text).
SECOND_ARMS = [("http_app_bench.py", "--access-log --requests 20 --blocks 2 --json {tmp}/al.json", "on / off")]
RUNS = [pytest.param(script, *SMOKE[script], id=script) for script in sorted(SMOKE)] + [
    pytest.param(script, flags, expected, id=f"{script} {flags.split()[0]}") for script, flags, expected in SECOND_ARMS
]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "flags", "expected"), RUNS)
def test_bench_runs_briefly(script, flags, expected, tmp_path, tiny_models):
    out = run_bench(script, flags, tmp_path, next(iter(tiny_models.values())).parent)
    assert expected in out, f"{script}: {expected!r} not in its output:\n{out[-4000:]}"


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.parametrize("script", CUDA_PARTS)
def test_bench_cuda_part_runs_briefly(script, tmp_path, tiny_models):
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"{script} --device cuda needs a CUDA GPU (its CPU part runs in test_bench_runs_briefly)")
    flags, expected = SMOKE[script]
    out = run_bench(script, f"{flags} --device cuda", tmp_path, next(iter(tiny_models.values())).parent)
    assert expected in out, f"{script} --device cuda: {expected!r} not in its output:\n{out[-4000:]}"


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("script", sorted(CLUSTER_SMOKE))
def test_cluster_bench_runs_briefly(script, tmp_path, tiny_models, kube_cluster):
    flags, expected = CLUSTER_SMOKE[script]
    out = run_bench(script, flags, tmp_path, next(iter(tiny_models.values())).parent)
    assert expected in out, f"{script}: {expected!r} not in its output:\n{out[-4000:]}"
