# Triptych: `make setup demo` to try it, `make test` to check it.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
MODELS ?= .models

.PHONY: setup test test-fast lint demo models bench bench-smoke gpu-check images crd dashboard alerts cluster-up cluster-down clean

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q

test-fast:
	$(PY) -m pytest -q -m "not slow and not cluster"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy triptych head/triptych_head worker/triptych_worker operator/triptych_operator devtools/triptych_dev

# The local tooling (devtools/triptych_dev): also `triptych models tiny` and `triptych demo` in a dev install.
models:
	$(PY) -m triptych_dev models tiny --out $(MODELS)

demo:
	$(PY) -m triptych_dev demo --models $(MODELS) --out outputs

bench:
	$(PY) bench/run_all.py

# Every script in bench/ run briefly (small sizes, short windows); each must exit 0 (~4 min).
# `make test` runs the same test (tests/unit/test_bench_smoke.py); the operator one needs the local cluster.
bench-smoke: setup
	$(PY) -m pytest -q tests/unit/test_bench_smoke.py

# On a machine with a CUDA GPU: CUDA tests, pixels on CUDA, benchmarks on a Wan 1.3B-shaped model and batching on tiny FLUX (<= 9 min).
gpu-check:
	@bash scripts/gpu-check.sh

# The CRD (crds/ and the chart's copy) and the field tables of docs/operator.md, from the one
# declaration of the spec (operator/triptych_operator/spec/declaration.py: SPEC); a test fails when they are stale.
crd:
	PYTHONPATH=.:operator $(PY) -m triptych_operator.crd --write

# The chart's Grafana dashboard (charts/triptych/dashboards/triptych.json) from its declaration
# (operator/triptych_operator/dashboard.py); a test fails when it is stale.
dashboard:
	PYTHONPATH=.:operator $(PY) -m triptych_operator.dashboard --write

# The chart's alerting rules (charts/triptych/alerts/triptych.rules.yaml) from their declaration
# (operator/triptych_operator/alerts.py); a test fails when it is stale.
alerts:
	PYTHONPATH=.:operator $(PY) -m triptych_operator.alerts --write

# The operator, head and worker images (scripts/images.sh; IMAGES="head operator" for some).
images:
	@bash scripts/images.sh $(IMAGES)

# TRIPTYCH_REAL_NODE=1 make cluster-up: also a real node (containerd, kubelet, kube-proxy, CoreDNS; root).
cluster-up:
	@bash tests/cluster/up.sh

cluster-down:
	@bash tests/cluster/down.sh

clean:
	rm -rf $(MODELS) outputs .pytest_cache .mypy_cache .ruff_cache
