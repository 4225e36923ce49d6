"""Whether another head's lease ran out, judged on this head's own clock.

The heads of a pipeline hold shared work with leases they renew by rewriting a record in the store
they share: an Idempotency-Key's running attempt, a video job, a webhook event, a takeover's claim.
A record carries its holder's `lease_until`, but that is the holder's wall clock: the heads' clocks
may disagree (a node whose NTP broke, a VM paused and resumed, a clock stepped), and a head whose
clock ran ahead would take over work whose holder is alive, running it twice. So a head judges
another's lease the way Kubernetes' leader election does, by what it sees itself: the holder is gone
once its record has stood unchanged for a whole lease by this head's monotonic clock, counted from the
first time this head saw the record as it is, never against another head's clock or the store's.

The price: a head that first sees a record waits a lease before taking it over, even when its holder
died a while before. Two cases are taken at once: a holder that hands its work over says so in the
record (no lease), and a lease its holder's own clock ended more than CLOCK_SKEW_S ago (a head long
dead, found by a head that just started): the heads' clocks are assumed to agree within that much.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

CLOCK_SKEW_S = 300.0  # the heads' wall clocks are assumed to agree within this
FORGET_S = 600.0  # a record not looked at for this long is forgotten (it went, or nobody asks any more)


@dataclass
class _Seen:
    version: Hashable  # the record as it was seen: its bytes, or a value its every renewal changes
    since: float  # when this head first saw it so
    looked: float  # when this head last looked


class Sightings:
    """What this head saw of the records it judges, and since when; safe from any thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, forget_s: float = FORGET_S) -> None:
        self.clock = clock
        self._forget_s = forget_s
        self._seen: dict[str, _Seen] = {}
        self._lock = threading.Lock()
        self._tidied = clock()

    def unchanged_for(self, name: str, version: Hashable) -> float:
        """Seconds the record `name` has stood at `version` as this head saw it: 0 at its first sight
        and after each change."""
        with self._lock:
            now = self.clock()
            seen = self._seen.get(name)
            if seen is None or seen.version != version:
                seen = self._seen[name] = _Seen(version, now, now)
            seen.looked = now
            if now - self._tidied >= self._forget_s / 10:
                self._seen = {k: s for k, s in self._seen.items() if now - s.looked < self._forget_s}
                self._tidied = now
            return now - seen.since

    def lapsed(
        self, name: str, version: Hashable, lease_s: float, lease_until: float | None, now: float | None = None
    ) -> bool:
        """Whether the lease on the record `name` ran out: handed over (`lease_until` None or 0), ended by
        its holder's clock more than CLOCK_SKEW_S before `now` (this head's wall clock), or stood at
        `version` (a value each renewal changes) for `lease_s` as this head saw it."""
        if not lease_until:
            return True
        unchanged = self.unchanged_for(name, version)  # seen now, whatever the answer: its clock starts
        wall = time.time() if now is None else now
        return unchanged >= lease_s or lease_until < wall - CLOCK_SKEW_S
