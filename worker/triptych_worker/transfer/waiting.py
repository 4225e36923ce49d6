"""How a Mooncake write is waited for: when to poll its status, and how long to leave the core between.

transfer_sync_write spins a core for the whole write, which on a host with few cores starves the
transport threads doing the work (and every other process). Instead (docs/transfer.md, "How a
write waits"):

- poll without pausing for SPIN_S only: a 64 KiB loopback write or an RDMA write can end within it;
- then sleep between polls for a fraction of the time already spent (at most ~5% added to a long
  write), at least POLL_MIN_S and at most POLL_MAX_S. Never sched_yield: it hardly leaves the core.
  A worker's threads sleep with a timer slack of TIMER_SLACK_NS (`precise_sleeps`): Linux's default
  lets every sleep end up to 50 us late, which made a 20 us sleep last ~70 and a small write's end
  be seen ~50 us after it came;
- a write large enough to have a steady rate (at least RATE_MIN_BYTES) to a peer that recent writes
  measured (WriteRates: its bytes at that peer's recent seconds per byte) is also polled without
  pausing for at most END_SPIN_S from shortly before its expected end, the sleeps before shortened
  to reach that point: its end is seen within microseconds, not up to a sleep (and the timer's
  slack) later. A wrong estimate costs at most that spin: the polls before and after are as above.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

SPIN_S = 50e-6
POLL_MIN_S = 20e-6
POLL_FRACTION = 0.05
POLL_MAX_S = 1e-3
RATE_MIN_BYTES = 256 << 10  # smaller writes are mostly latency: no rate to expect their end by
WAKE_EARLY_S = 80e-6  # a sleep ends up to ~50 us late (timer slack): spin from this long before the expected end
END_SPIN_S = 150e-6  # at most this long polled without pause around the expected end
RATE_WEIGHT = 0.25  # of each new write in the estimate (an exponentially weighted mean)
# Peers a worker keeps an estimate for, the most recently written to: a peer that restarts or is
# scaled away comes back under a new session, and the old one's estimate is never asked for again.
RATE_MAX_PEERS = 256
TIMER_SLACK_NS = 1000  # how late a sleep of a worker's threads may end (Linux's default: 50 us)
_PR_SET_TIMERSLACK = 29  # prctl(2)


def precise_sleeps() -> bool:
    """Let this thread's sleeps end at most TIMER_SLACK_NS late, and those of every thread it starts
    from now on (they inherit it, as a child process does): call before a worker starts its threads.
    False where it cannot (not Linux, or prctl refused); the sleeps then keep the kernel's slack."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(TIMER_SLACK_NS), 0, 0, 0) == 0
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.warning("could not set the timer slack: a write's end may be seen up to 50 us late")
    return ok


class WriteRates:
    """Recent seconds per byte of writes to each peer (those of at least RATE_MIN_BYTES)."""

    def __init__(self) -> None:
        self._seconds_per_byte: dict[str, float] = {}

    def expected_s(self, peer: str, nbytes: int) -> float | None:
        """How long a write of `nbytes` to `peer` should take; None without an estimate for it."""
        if nbytes < RATE_MIN_BYTES:
            return None
        rate = self._seconds_per_byte.get(peer)
        return None if rate is None else rate * nbytes

    def observe(self, peer: str, nbytes: int, seconds: float) -> None:
        """A write to `peer` ended after `seconds` (as its poller saw it)."""
        if nbytes < RATE_MIN_BYTES or seconds <= 0:
            return
        sample = seconds / nbytes
        old = self._seconds_per_byte.pop(peer, None)  # put back last: the most recently written to
        self._seconds_per_byte[peer] = sample if old is None else old + RATE_WEIGHT * (sample - old)
        while len(self._seconds_per_byte) > RATE_MAX_PEERS:
            del self._seconds_per_byte[next(iter(self._seconds_per_byte))]


def poll_interval(elapsed: float, expected: float | None) -> float:
    """How long to leave the core before the next poll of a write `elapsed` seconds old that should
    take `expected` seconds (None: unknown); 0 polls again at once."""
    if elapsed < SPIN_S:
        return 0.0
    interval = min(POLL_MAX_S, max(POLL_MIN_S, elapsed * POLL_FRACTION))
    if expected is None:
        return interval
    spin_from = expected - WAKE_EARLY_S
    if elapsed < spin_from:
        return min(interval, spin_from - elapsed)
    if elapsed < spin_from + END_SPIN_S:
        return 0.0
    return interval
