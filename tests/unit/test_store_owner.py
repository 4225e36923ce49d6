"""A result store is one pipeline's (head/triptych_head/store_owner.py): the first head told its
pipeline marks the store, the heads of the same pipeline share it, and a head of another pipeline
refuses to start on it, naming both and what to do; a head not told checks nothing."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from triptych_head import store_owner
from triptych_head.objects import DirectoryObjects, StoreError
from triptych_head.store_owner import MARKER, claim_store


def test_the_first_head_marks_the_store_and_its_pipeline_s_heads_share_it(tmp_path: Path) -> None:
    heads = [DirectoryObjects(tmp_path) for _ in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(heads)) as pool:
        list(pool.map(lambda store: claim_store(store, "ml/flux"), heads))  # raises on any refusal
    assert json.loads((tmp_path / MARKER).read_text()) == {"pipeline": "ml/flux"}
    claim_store(DirectoryObjects(tmp_path), "ml/flux")  # a head that starts later


def test_a_store_another_pipeline_marked_is_refused_naming_both_and_what_to_do(tmp_path: Path) -> None:
    claim_store(DirectoryObjects(tmp_path), "ml/flux")
    with pytest.raises(StoreError) as refused:
        claim_store(DirectoryObjects(tmp_path), "ml/wan")
    message = str(refused.value)
    assert "holds the results of pipeline 'ml/flux'" in message and "not of 'ml/wan'" in message
    assert "a store of its own" in message and f"delete {MARKER}" in message
    assert f"set {store_owner.ENV}=ml/flux in its head's env" in message  # a renamed pipeline keeps its store


@pytest.mark.parametrize("content", ["", "{not json", '{"pipeline": 7}'])
def test_a_marker_this_head_cannot_read_is_refused_saying_what_to_do(tmp_path: Path, content: str) -> None:
    (tmp_path / MARKER).write_text(content)  # "": a head that died between creating it and filling it in
    with pytest.raises(StoreError, match=rf"its {MARKER} .* is not one this head reads; .*delete {MARKER} and start"):
        claim_store(DirectoryObjects(tmp_path), "ml/flux")  # at once, or after SETTLE_S for an empty one


def test_a_head_of_another_pipeline_does_not_start_on_the_store(tmp_path: Path) -> None:
    """Two pipelines given one store took over each other's video jobs (run on the wrong model) and
    webhook events (sent to the wrong receiver), and removed each other's results."""
    claim_store(DirectoryObjects(tmp_path), "ml/flux")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["--disagg-role", "server", "--encoder-urls", "tcp://127.0.0.1:1", "--denoiser-urls", "tcp://127.0.0.1:2",
            "--decoder-urls", "tcp://127.0.0.1:3", "--port", str(port), "--output-path", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "triptych", "serve", "--model-path", ".models/tiny-flux", *argv],
        capture_output=True, text=True, timeout=120, env={**os.environ, store_owner.ENV: "ml/wan"},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("triptych: error:")]
    assert errors and "holds the results of pipeline 'ml/flux'" in errors[0], proc.stderr
