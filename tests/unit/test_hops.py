"""triptych_dev.hops: a request's traced events lined up into named gaps (bench/hop_bench.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from triptych_dev import hops


def _write(directory: Path, pid: int, lines: list[str]) -> None:
    (directory / f"{pid}.txt").write_text("".join(f"{line}\n" for line in lines))


def test_each_gap_of_the_common_path_is_named_and_its_median_taken(tmp_path: Path) -> None:
    # Two requests through a head (pid 1) and one worker (pid 2), times in ns; r2's stage is 10 us longer.
    _write(tmp_path, 1, [
        "2000 recvd submit r1", "3000 dec submit r1", "5000 enc work r1", "6000 sent work r1",
        "20000 recvd worker_result r1", "21000 dec worker_result r1", "23000 enc result r1",
        "10002000 recvd submit r2", "10003000 dec submit r2", "10005000 enc work r2", "10006000 sent work r2",
        "10030000 recvd worker_result r2", "10031000 dec worker_result r2", "10033000 enc result r2",
    ])  # fmt: skip
    _write(tmp_path, 2, [
        "8000 recvd work r1", "9000 dec work r1", "15000 enc worker_result r1", "16000 sent worker_result r1",
        "10008000 recvd work r2", "10009000 dec work r2", "10025000 enc worker_result r2",
        "10026000 sent worker_result r2",
    ])  # fmt: skip
    clients = {"r1": (0, 25_000), "r2": (10_000_000, 10_035_000)}
    segments = hops.hops(tmp_path, {1: "server", 2: "encoder"}, clients)
    assert [s.kind for s in segments] == [
        "wire", "receive", "server work", "send", "wire", "receive", "encoder work", "send", "wire",
        "receive", "server work", "wire",
    ]  # fmt: skip
    assert segments[0].start == "client:enc:submit" and segments[-1].end == "client:dec:result"
    encoder_work = segments[6]
    assert encoder_work.median_us == pytest.approx((6 + 16) / 2)  # 6 us for r1, 16 us for r2
    totals = hops.totals(segments)
    assert totals["messages"] == 4
    assert totals["wire"] == pytest.approx(2 + 2 + 4 + 2)
    assert totals["send"] == pytest.approx(2) and totals["receive"] == pytest.approx(3)
    assert totals["server work"] == pytest.approx(4)


def test_a_request_off_the_common_path_is_left_out(tmp_path: Path) -> None:
    _write(tmp_path, 1, ["2000 dec submit r1", "5000 enc result r1", "2000 dec submit r2", "3000 dec submit r4",
                         "6000 enc result r4"])  # fmt: skip
    # r2 lost its result's events and r3 has none: r1 and r4's path is the common one.
    clients = {"r2": (0, 9000), "r3": (0, 9000), "r1": (0, 7000), "r4": (1000, 8000)}
    segments = hops.hops(tmp_path, {1: "server"}, clients)
    assert [(s.kind, s.median_us) for s in segments] == [("wire", 2.0), ("server work", 3.0), ("wire", 2.0)]


def test_no_traced_request_gives_no_segments(tmp_path: Path) -> None:
    assert hops.hops(tmp_path, {}, {}) == []
