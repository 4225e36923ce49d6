"""Rank 0 of a multi-device denoiser resolves a request's adapter names with the catalogue the worker
checked at start-up (worker/triptych_worker/parallel/ranks.py, triptych/lora.py).

Rank 0 runs in this process with one real follower process (tests.worker.test_resume_ranks), in a
module of its own: torch.distributed allows one default process group per process, and another
module's ranks (a module-scoped fixture) would still hold it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec
import pytest

from tests.worker.test_ranks_adapters import adapters
from tests.worker.test_resume import CASES
from tests.worker.test_resume_ranks import two_ranks
from triptych.lora import LoraCatalog
from triptych_worker.stages import StageBatch


def test_rank_0_resolves_with_the_worker_s_checked_catalogue_and_logs_a_re_read_bad_entry_once(
    tiny_models: dict[str, Path], tiny_loras: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 alone resolves a request's adapter names, with the catalogue the worker checked at start-up
    (runtime.py passes it to start_ranks): an entry a re-read of its file brings without adapter weights
    is logged there, once, and kept. The follower never re-reads its own: it loads what each job names."""
    path = tmp_path / "loras.txt"
    path.write_text(f"flux-ink={tiny_loras['flux-ink']}\n")
    catalog = LoraCatalog.from_flags([], str(path))
    assert catalog.check_sources("denoiser") is None  # as the worker does before its model loads
    with two_ranks(tiny_models["tiny-flux"], ("--num-gpus", "2"), lora_catalog=catalog) as ranks:
        assert ranks.loras is not None and ranks.loras.catalog is catalog
        path.write_text(f"flux-ink={tiny_loras['flux-ink']}\ngone=/nonexistent/adapter\n")
        os.utime(path, ns=(1, 1))  # a new stamp even within the file system's time resolution
        batch = StageBatch(msgspec.structs.replace(CASES["flux"][1], loras=adapters(("gone", 1.0))))
        with caplog.at_level(logging.WARNING, logger="triptych.lora"):
            for _ in range(2):  # each job rank 0 sends resolves its adapters
                assert ranks.rank.lora_sources([batch]) == {"gone": "/nonexistent/adapter"}
        (record,) = [r for r in caplog.records if "gone=" in r.getMessage()]
        assert "/nonexistent/adapter does not exist on this denoiser; kept" in record.getMessage()
