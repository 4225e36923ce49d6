"""--model-path resolution: local packages as they are; hub ids through the hub client; clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from triptych.model_source import ModelSourceError, resolve_model_path


def test_local_package_is_used_as_is(tmp_path):
    (tmp_path / "model_index.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_directory_without_model_index_is_rejected(tmp_path):
    with pytest.raises(ModelSourceError, match=r"no model_index\.json"):
        resolve_model_path(str(tmp_path))


def test_missing_path_that_is_not_a_hub_id_is_rejected(tmp_path):
    with pytest.raises(ModelSourceError, match="not a hub id"):
        resolve_model_path(str(tmp_path / "nope" / "deeper"))


def test_unreachable_hub_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelSourceError, match="mount the package"):
        resolve_model_path("example-org/not-cached-model")


def test_serve_exits_with_one_line_for_a_bad_model_path(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "triptych", "serve", "--model-path", str(tmp_path / "missing"), "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("triptych: error: --model-path")
