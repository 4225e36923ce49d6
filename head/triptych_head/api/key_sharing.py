"""A key's requests in flight and its rate (max_in_flight, max_per_minute), held by every head together.

Each head writes what it holds now to the result store the heads share (objects.py: the
ReadWriteMany folder or the S3 bucket), one object per head:

    live-counts/<head id>.json    {"started": <when this head began counting>,
                                   "in_flight": {"<key id>": n, ...},   its requests in flight now
                                   "admitted": {"<key id>": n, ...}}    admitted since it started

at every sync (key_quotas.SYNC_S) where that changed, and every REFRESH_S anyway, and reads the
others'. A key's requests in flight are this head's plus those the other heads had at their last
write (an object not rewritten for LIVE_S is a head gone without its last write: its requests
ended with it); the requests the other heads admitted since this one last read their counts are
taken from this head's token bucket of the key (key_limits.py). So the heads together hold a key
to its limits, up to what the others admitted since this head last read their counts: behind N
heads, a burst arriving on all of them within one sync can pass a limit by that much, never by N
times the limit for long.

When the store cannot be written or read, each head goes on with what it read last (logged once,
counted in triptych_key_quota_sync_errors_total), then with its own counts alone once those have
aged LIVE_S: a store outage must not stop the API. Objects not rewritten for SWEEP_S are removed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

from triptych_head.objects import ObjectMissing, ObjectStore

log = logging.getLogger(__name__)

PREFIX = "live-counts/"
REFRESH_S = 10.0  # a head rewrites its object at least this often, changed or not
LIVE_S = 30.0  # the requests in flight of an object older than this no longer count
SWEEP_S = 3600.0  # objects older than this are removed (by whichever head sweeps first)


@dataclass
class PeerCounts:
    """What the other heads hold, by key id: their requests in flight now, and the requests they
    admitted since the previous exchange."""

    in_flight: dict[str, int] = field(default_factory=dict)
    admitted: dict[str, int] = field(default_factory=dict)


class LiveCounts:
    """This head's side of the exchange: `exchange` runs in a thread (store I/O), one at a time."""

    def __init__(
        self, objects: ObjectStore, head_id: str, errors: Counter, clock: Callable[[], float] = time.time
    ) -> None:
        self._objects = objects
        self._name = f"{PREFIX}{head_id}.json"
        self._clock = clock
        self._errors = errors
        self._started = clock()
        self._lock = threading.Lock()
        self._written: tuple[dict[str, int], dict[str, int]] | None = None
        self._written_at = 0.0
        self._admitted_seen: dict[str, tuple[float, dict[str, int]]] = {}  # object -> (its started, admitted)
        self._peers = PeerCounts()
        self._read_at = 0.0  # when the peers' in-flight counts were read
        self._swept = 0.0
        self._failing = False

    def exchange(self, in_flight: dict[str, int], admitted: dict[str, int]) -> PeerCounts:
        """Write this head's counts (when they changed, or every REFRESH_S), read the other heads':
        their requests in flight, and what they admitted since the last exchange."""
        with self._lock:
            now = self._clock()
            try:
                self._write(now, in_flight, admitted)
                fresh = self._read_peers(now)
                if now - self._swept >= SWEEP_S:
                    self._sweep(now)
                    self._swept = now
            except Exception as exc:
                self._errors.inc()
                if not self._failing:
                    log.warning(
                        "key limits: cannot share the counts in flight and per minute with %s (%s); going on "
                        "with those known",
                        self._objects.description,
                        exc,
                    )
                self._failing = True
                if now - self._read_at > LIVE_S:  # what the others had in flight is too old to count
                    self._peers = PeerCounts()
                return PeerCounts(dict(self._peers.in_flight))
            if self._failing:
                log.info("key limits: counts in flight and per minute shared with %s again", self._objects.description)
            self._failing = False
            self._peers, self._read_at = PeerCounts(fresh.in_flight), now
            return fresh

    def _write(self, now: float, in_flight: dict[str, int], admitted: dict[str, int]) -> None:
        counts = ({k: n for k, n in in_flight.items() if n}, dict(admitted))
        if counts == self._written and now - self._written_at < REFRESH_S:
            return
        data = {"started": self._started, "in_flight": counts[0], "admitted": counts[1]}
        self._objects.put_bytes(self._name, json.dumps(data, separators=(",", ":")).encode(), "application/json")
        self._written, self._written_at = counts, now

    def _read_peers(self, now: float) -> PeerCounts:
        peers = PeerCounts()
        listed = [obj for obj in self._objects.list(PREFIX) if obj.name != self._name and obj.name.endswith(".json")]
        for gone in set(self._admitted_seen) - {obj.name for obj in listed}:
            del self._admitted_seen[gone]
        for obj in listed:
            try:
                data = self._objects.get_bytes(obj.name)
            except ObjectMissing:  # swept since it was listed
                continue
            started, in_flight, admitted = _counts(obj.name, data)
            if now - obj.mtime <= LIVE_S:
                for key_id, n in in_flight.items():
                    peers.in_flight[key_id] = peers.in_flight.get(key_id, 0) + n
            seen_started, seen = self._admitted_seen.get(obj.name, (None, None))
            if seen is not None and seen_started == started:  # first read of a head (or of its restart): a baseline
                for key_id, n in admitted.items():
                    if n > seen.get(key_id, 0):
                        peers.admitted[key_id] = peers.admitted.get(key_id, 0) + n - seen.get(key_id, 0)
            self._admitted_seen[obj.name] = (started, admitted)
        return peers

    def _sweep(self, now: float) -> None:
        for obj in list(self._objects.list(PREFIX)):
            if now - obj.mtime > SWEEP_S:
                self._objects.delete(obj.name)
                self._admitted_seen.pop(obj.name, None)


def _counts(name: str, data: bytes) -> tuple[float, dict[str, int], dict[str, int]]:
    """(started, in flight, admitted) of an object; one that is not that shape is logged and counts nothing."""
    try:
        body = json.loads(data)
        started, in_flight, admitted = body["started"], body["in_flight"], body["admitted"]
        if isinstance(started, int | float) and all(_is_counts(c) for c in (in_flight, admitted)):
            return float(started), {str(k): n for k, n in in_flight.items()}, {str(k): n for k, n in admitted.items()}
    except (ValueError, KeyError, TypeError):
        pass
    log.warning("key limits: %s is not a head's counts; ignored", name)
    return 0.0, {}, {}


def _is_counts(counts: object) -> bool:
    return isinstance(counts, dict) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()
    )
