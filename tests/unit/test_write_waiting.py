"""How a Mooncake write is waited for (transfer/waiting.py): when to poll and how long to sleep between.

Pure policy here; tests/transfer/test_mooncake.py has real engines' writes waited for this way.
"""

from __future__ import annotations

import ctypes
import threading

import pytest

from triptych_worker.transfer.waiting import (
    END_SPIN_S,
    POLL_FRACTION,
    POLL_MAX_S,
    POLL_MIN_S,
    RATE_MAX_PEERS,
    RATE_MIN_BYTES,
    SPIN_S,
    TIMER_SLACK_NS,
    WAKE_EARLY_S,
    WriteRates,
    poll_interval,
    precise_sleeps,
)

MIB = 1 << 20


def fallback(elapsed: float) -> float:
    return min(POLL_MAX_S, max(POLL_MIN_S, elapsed * POLL_FRACTION))


@pytest.mark.parametrize("elapsed", [0.0, SPIN_S / 2, SPIN_S * 0.99])
def test_a_young_write_is_polled_at_once_with_or_without_an_expected_end(elapsed):
    assert poll_interval(elapsed, None) == 0.0
    assert poll_interval(elapsed, 0.01) == 0.0


@pytest.mark.parametrize("elapsed", [60e-6, 300e-6, 5e-3, 0.1])
def test_without_an_expected_end_sleeps_are_a_bounded_fraction_of_the_age(elapsed):
    got = poll_interval(elapsed, None)
    assert got == fallback(elapsed) and POLL_MIN_S <= got <= POLL_MAX_S


def test_with_an_expected_end_it_spins_around_it_and_never_sleeps_longer_than_without():
    expected = 2e-3
    spin_from = expected - WAKE_EARLY_S
    for elapsed in (SPIN_S, 200e-6, 1e-3, spin_from - 30e-6):  # before: sleeps that reach the spin, no longer
        got = poll_interval(elapsed, expected)
        assert 0 < got <= fallback(elapsed) and elapsed + got <= spin_from + 1e-12
    for elapsed in (spin_from, expected, spin_from + END_SPIN_S * 0.99):  # around the expected end: at once
        assert poll_interval(elapsed, expected) == 0.0
    for elapsed in (spin_from + END_SPIN_S, 2 * expected, 10 * expected):  # later than expected: as without
        assert poll_interval(elapsed, expected) == fallback(elapsed)


def test_a_wrong_estimate_costs_at_most_the_spin():
    """Far too long or too short an expected end: every sleep is at most what it is without one."""
    for expected in (1e-6, 10.0):
        for elapsed in (SPIN_S, 100e-6, 1e-3, 0.05):
            assert poll_interval(elapsed, expected) <= fallback(elapsed)


def test_rates_are_kept_for_the_peers_most_recently_written_to_only():
    # Peers come and go (autoscaling, restarts: a new session each time); the worker lives on.
    rates = WriteRates()
    rates.observe("kept", MIB, 1e-3)
    for i in range(3 * RATE_MAX_PEERS):
        rates.observe(f"gone-{i}", MIB, 1e-3)
        if i % 10 == 0:
            rates.observe("kept", MIB, 1e-3)  # still written to now and then
    assert len(rates._seconds_per_byte) == RATE_MAX_PEERS
    assert rates.expected_s("kept", MIB) is not None and rates.expected_s("gone-0", MIB) is None


def test_rates_are_per_peer_for_large_writes_only_and_follow_recent_writes():
    rates = WriteRates()
    assert rates.expected_s("a", MIB) is None  # nothing measured yet
    rates.observe("a", MIB, 1e-3)
    assert rates.expected_s("a", MIB) == pytest.approx(1e-3)
    assert rates.expected_s("a", 4 * MIB) == pytest.approx(4e-3)  # seconds per byte
    assert rates.expected_s("b", MIB) is None  # another peer: its own rate
    assert rates.expected_s("a", RATE_MIN_BYTES - 1) is None  # small writes: latency, not rate
    rates.observe("a", RATE_MIN_BYTES - 1, 1.0)  # ignored
    rates.observe("a", MIB, 0.0)  # ignored
    assert rates.expected_s("a", MIB) == pytest.approx(1e-3)
    for _ in range(30):  # the link got twice as slow: the estimate follows within a few writes
        rates.observe("a", MIB, 2e-3)
    assert rates.expected_s("a", MIB) == pytest.approx(2e-3, rel=0.01)


def _timer_slack_ns() -> int:
    return int(ctypes.CDLL(None).prctl(30, 0, 0, 0, 0))  # PR_GET_TIMERSLACK: this thread's


def test_precise_sleeps_sets_the_slack_of_the_thread_and_of_threads_it_starts_later():
    seen: dict[str, object] = {}

    def run() -> None:  # in a thread of its own, so the test's thread keeps the kernel's slack
        seen["ok"] = precise_sleeps()
        seen["own"] = _timer_slack_ns()
        child = threading.Thread(target=lambda: seen.update(child=_timer_slack_ns()))
        child.start()
        child.join()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen["ok"] is True
    assert seen["own"] == TIMER_SLACK_NS and seen["child"] == TIMER_SLACK_NS
    assert _timer_slack_ns() != TIMER_SLACK_NS, "the thread that started it keeps its own slack"
