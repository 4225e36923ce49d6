"""Installs triptych_dev.hops's trace in a process started with TRIPTYCH_HOP_TRACE set (bench/hop_bench.py
puts this folder on the deployment's PYTHONPATH)."""

import os
from pathlib import Path

if os.environ.get("TRIPTYCH_HOP_TRACE"):
    from triptych_dev import hops

    hops.install(Path(os.environ["TRIPTYCH_HOP_TRACE"]))
