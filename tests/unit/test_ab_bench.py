"""bench/ab_bench.py's sides import their own tree's packages, and bench/zmq_floor.py sizes its messages
from the protocol's: the parts of the benchmarks that need no deployment (test_bench_smoke runs them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import ab_bench  # noqa: E402
import zmq_floor  # noqa: E402


def test_a_side_runs_with_its_tree_first_and_no_working_directory_on_sys_path(tmp_path: Path) -> None:
    env = ab_bench.side_environment(tmp_path / "tree")
    assert env["PYTHONSAFEPATH"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "tree")


def test_python_m_from_another_tree_imports_the_sides_package(tmp_path: Path) -> None:
    """What a revision's processes do when ab_bench runs from this tree's root: `python -m` in a directory
    holding another `triptych` (the working tree's) imports the side's, not that one."""
    tree, cwd = tmp_path / "tree", tmp_path / "cwd"
    for root, name in ((tree, "side"), (cwd, "working tree")):
        (root / "triptych").mkdir(parents=True)
        (root / "triptych" / "__init__.py").write_text(f"WHICH = {name!r}\n")
    (tree / "probe.py").write_text("import triptych\nprint(triptych.WHICH)\n")
    env = {**os.environ, **ab_bench.side_environment(tree)}
    out = subprocess.run(
        [sys.executable, "-m", "probe"], cwd=cwd, env=env, capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "side"


def test_environment_is_restored_after_the_side_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/before")
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    with ab_bench.environment({"PYTHONPATH": "/side", "PYTHONSAFEPATH": "1"}):
        assert os.environ["PYTHONPATH"] == "/side" and os.environ["PYTHONSAFEPATH"] == "1"
    assert os.environ["PYTHONPATH"] == "/before" and "PYTHONSAFEPATH" not in os.environ


def test_the_floor_sends_a_request_s_twelve_messages_with_its_pixel_frames() -> None:
    messages = zmq_floor.request_messages()
    p = zmq_floor.PARAMS
    pixels = p.num_outputs * p.num_frames * p.height * p.width * 3
    assert len(messages.hops) == len(zmq_floor.ROUTE)
    assert 2 + 2 * len(messages.hops) == zmq_floor.summary([1.0])["messages"] == 12
    assert messages.reply[1:] == messages.hops[-1][1][1:] == (pixels,)
    # Headers as a request's carry them (the request's params, ids, manifests): a few hundred bytes.
    headers = [messages.submit[0], messages.reply[0], *(m[0] for hop in messages.hops for m in hop)]
    assert all(100 < n < 1000 for n in headers)
    assert messages.hops[0][0][0] > messages.submit[0]  # work: the submit's params, and whom it is for
