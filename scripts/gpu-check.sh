#!/usr/bin/env bash
# One prepared check for a machine with one CUDA GPU, at most 9 minutes once `make setup` has run:
#   1. the CUDA-marked tests (tests/e2e/test_cuda.py: pixels on CUDA, disaggregated == monolithic == stock diffusers;
#      the NCCL rank tests (Ulysses, TP, the Wan decoder's --decoder-sp) run where there are 2 GPUs),
#   2. a random-weight package of the Wan2.1-T2V-1.3B shape, written locally (bench/random_wan.py; no download),
#   3. the pipeline benchmark on it, disaggregated vs monolithic in the same run (bench/pipeline_bench.py),
#   4. the multi-device benchmark (bench/parallel_bench.py: denoiser CFG/Ulysses/Ring/TP and decoder --decoder-sp
#      rows against 1 rank of the same run; on one GPU only the 1-rank rows run, the others need a GPU per rank),
#   5. the batching benchmark: images/s vs batch size 1/2/4/8, tiny FLUX at 64x64 and 256x256 (bench/batching_bench.py).
# Needs about 10 GB of GPU memory (the monolithic and the disaggregated deployment hold the model side by side, in
# bfloat16: --dtype auto on a GPU).
# Writes bench/results/gpu-check/report.json (and each step's log beside it); exits non-zero when a step failed.
#   make gpu-check            or            bash scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
OUT=${GPU_CHECK_OUT:-bench/results/gpu-check}
MODEL=${GPU_CHECK_MODEL:-.models/random-wan-1.3b}

if [ ! -x "$PY" ]; then
  echo "gpu-check: no $PY; run 'make setup' first (or set VENV)" >&2
  exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: torch sees no CUDA GPU (check nvidia-smi and that torch is a CUDA build)" >&2
  exit 2
fi
# Workers start as ordinary processes: a child forked from the tests' preloaded interpreter cannot initialise
# CUDA (triptych_dev.prefork declines on a machine with a CUDA device anyway).
export TRIPTYCH_PREFORK=0
mkdir -p "$OUT"
: > "$OUT/steps.tsv"
failed=0

# step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, record status and duration.
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "gpu-check: $name (at most ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$OUT/steps.tsv"
  if [ "$rc" -ne 0 ]; then
    failed=1
    echo "gpu-check: $name failed (status $rc); last lines of $OUT/$name.log:" >&2
    tail -n 15 "$OUT/$name.log" >&2
  fi
}

step cuda-tests 150 "$PY" -m pytest -q -m cuda tests/e2e/test_cuda.py --junitxml="$OUT/cuda-tests.xml"
step random-wan 90 "$PY" bench/random_wan.py --out "$MODEL" --dtype bfloat16
step pipeline-bench 180 "$PY" bench/pipeline_bench.py --model "$MODEL" --device cuda --size 832x480 --frames 17 \
  --steps 4 --requests 2 --json "$OUT/pipeline.json"
step parallel-bench 60 "$PY" bench/parallel_bench.py --device cuda --jobs 2
step batching-bench 60 "$PY" bench/batching_bench.py --device cuda --json "$OUT/batching.json"

cp -f bench/results/parallel_bench.json "$OUT/parallel.json" 2>/dev/null || true
"$PY" - "$OUT" <<'PY'
import json, subprocess, sys, xml.etree.ElementTree as ET
from pathlib import Path

import torch

out = Path(sys.argv[1])
steps = [dict(zip(("step", "status", "seconds"), line.split("\t"))) for line in (out / "steps.tsv").read_text().splitlines()]
report = {
    "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "steps": [{**s, "status": int(s["status"]), "seconds": int(s["seconds"])} for s in steps],
}
if (out / "cuda-tests.xml").exists():
    suite = ET.parse(out / "cuda-tests.xml").getroot().find("testsuite")
    report["cuda_tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
for name in ("pipeline", "parallel", "batching"):
    if (out / f"{name}.json").exists():
        report[f"{name}_bench"] = json.loads((out / f"{name}.json").read_text())
(out / "report.json").write_text(json.dumps(report, indent=2))
print(json.dumps({k: report[k] for k in ("gpu", "steps")}, indent=2))
PY
echo "gpu-check: report in $OUT/report.json"
exit "$failed"
