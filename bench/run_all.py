"""Run every benchmark in sequence (`make bench`); each prints its own table and writes bench/results/*.json."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

for script in (
    "transfer_bench.py",
    "head_bench.py",
    "hop_bench.py",
    "core_bench.py",
    "http_app_bench.py",
    "tracing_bench.py",
    "media_bench.py",
    "torch_threads_bench.py",
    "pipeline_bench.py",
    "scaling_bench.py",
    "heads_bench.py",
    "preemption_bench.py",
    "rollout_bench.py",
):
    print(f"\n=== {script}", flush=True)
    subprocess.run([sys.executable, str(HERE / script)], check=True)
