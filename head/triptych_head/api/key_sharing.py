"""A key's requests in flight and its rate (max_in_flight, max_per_minute), held by every head together.

Each head writes what it holds now to the result store the heads share (objects.py: the
ReadWriteMany folder or the S3 bucket), one object per head:

    live-counts/<head id>.json    {"started": <when this head began counting>, "written": <when>,
                                   "in_flight": {"<key id>": n, ...},   its requests in flight now
                                   "admitted": {"<key id>": n, ...},    admitted since it started
                                   "tokens": {"<key id>": x, ...}}      its buckets not full, as written

at every sync (key_quotas.SYNC_S) where that changed, and every REFRESH_S anyway, and reads the
others'. A key's requests in flight are this head's plus those the other heads had at their last
write (an object this head saw stand unchanged for LIVE_S is a head gone without its last write:
its requests ended with it; judged on this head's own clock, sightings.py, never against another
head's or the store's); the requests the other heads admitted since this one last read their counts are
taken from this head's token bucket of the key (key_limits.py), and a head that starts (a restart,
a scale-out) begins each key's bucket where the fullest-drained other head's stands, not full. So
the heads together hold a key
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
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

from triptych_head.api.store_sync import SyncHealth
from triptych_head.objects import ObjectMissing, ObjectStore
from triptych_head.sightings import Sightings

log = logging.getLogger(__name__)

PREFIX = "live-counts/"
REFRESH_S = 10.0  # a head rewrites its object at least this often, changed or not
LIVE_S = 30.0  # the requests in flight of an object older than this no longer count
SWEEP_S = 3600.0  # objects older than this are removed (by whichever head sweeps first)


@dataclass
class HeadCounts:
    """What this head holds, by key id: its requests in flight, the requests it admitted with a token
    since it started, and the tokens of its buckets that are not full."""

    in_flight: dict[str, int] = field(default_factory=dict)
    admitted: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)

    def any(self) -> bool:
        return bool(self.in_flight or self.admitted)


@dataclass
class PeerCounts:
    """What the other heads hold, by key id: their requests in flight now, the requests they admitted
    since the previous exchange, and, at this head's first exchange only, their buckets that are not
    full: (tokens, seconds since written) per head."""

    in_flight: dict[str, int] = field(default_factory=dict)
    admitted: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


class LiveCounts:
    """This head's side of the exchange: `exchange` runs in a thread (store I/O), one at a time.
    `clock`: the wall clock its objects' times are written in; `sightings`: what this head saw of the
    others' objects, on a clock of its own (monotonic), which also times its rewrites and reads."""

    def __init__(
        self,
        objects: ObjectStore,
        head_id: str,
        errors: Counter,
        clock: Callable[[], float] = time.time,
        sightings: Sightings | None = None,
    ) -> None:
        self._objects = objects
        self._name = f"{PREFIX}{head_id}.json"
        self._clock = clock
        self._sightings = sightings or Sightings()
        self._ticks = self._sightings.clock
        self._health = SyncHealth(errors, "key limits", "share the counts in flight and per minute")
        self._started = clock()
        self._lock = threading.Lock()
        self._written: HeadCounts | None = None
        self._written_at = 0.0
        self._admitted_seen: dict[str, tuple[float, dict[str, int]]] = {}  # object -> (its started, admitted)
        self._peers = PeerCounts()
        self._read_at = 0.0  # when the peers' in-flight counts were read
        self._swept = 0.0
        self._first = True  # no exchange succeeded yet: the others' buckets are this head's start
        self._unreadable: set[str] = set()  # objects not in a head's counts' shape (logged once each)

    def exchange(self, counts: HeadCounts) -> PeerCounts:
        """Write this head's counts (when they changed, or every REFRESH_S), read the other heads':
        their requests in flight, and what they admitted since the last exchange."""
        with self._lock:
            now, tick = self._clock(), self._ticks()
            try:
                self._write(now, tick, counts)
                fresh, seen = self._read_peers(now)
            except Exception as exc:
                self._health.failed(exc, self._objects.description)
                if tick - self._read_at > LIVE_S:  # what the others had in flight is too old to count
                    self._peers = PeerCounts()
                return PeerCounts(dict(self._peers.in_flight))
            self._admitted_seen = seen  # only a whole read moves the baselines: none of its admissions is lost
            if not self._swept or tick - self._swept >= SWEEP_S:
                try:
                    self._sweep(now)
                    self._swept = tick
                except Exception as exc:  # a good read stands; the sweep is tried again next time
                    log.warning("key limits: could not remove the counts of heads gone: %s", exc)
            self._health.succeeded(self._objects.description)
            self._peers, self._read_at = PeerCounts(fresh.in_flight), tick
            if not self._first:
                fresh.tokens = {}
            self._first = False
            return fresh

    def _write(self, now: float, tick: float, counts: HeadCounts) -> None:
        tokens = {k: round(x, 3) for k, x in counts.tokens.items()}
        counts = HeadCounts({k: n for k, n in counts.in_flight.items() if n}, dict(counts.admitted), tokens)
        if counts == self._written and tick - self._written_at < REFRESH_S:
            return
        data = {"started": self._started, "written": now, "in_flight": counts.in_flight,
                "admitted": counts.admitted, "tokens": counts.tokens}  # fmt: skip
        self._objects.put_bytes(self._name, json.dumps(data, separators=(",", ":")).encode(), "application/json")
        self._written, self._written_at = counts, tick

    def _read_peers(self, now: float) -> tuple[PeerCounts, dict[str, tuple[float, dict[str, int]]]]:
        """The other heads' counts, and the admissions seen of each (the baselines of the next read)."""
        peers = PeerCounts()
        listed = [obj for obj in self._objects.list(PREFIX) if obj.name != self._name and obj.name.endswith(".json")]
        baselines = {obj.name: self._admitted_seen[obj.name] for obj in listed if obj.name in self._admitted_seen}
        for obj in listed:
            try:
                data = self._objects.get_bytes(obj.name)
            except ObjectMissing:  # swept since it was listed
                continue
            parsed = _counts(data)
            if parsed is None:
                if obj.name not in self._unreadable:
                    log.warning("key limits: %s is not a head's counts; ignored", obj.name)
                self._unreadable.add(obj.name)
                continue
            self._unreadable.discard(obj.name)
            started, given, counts = parsed
            written = obj.mtime if given is None else given  # an older head's: each rewrite is a new mtime
            in_flight, admitted = counts.in_flight, counts.admitted
            if not self._sightings.lapsed(obj.name, written, LIVE_S, written + LIVE_S, now):
                for key_id, n in in_flight.items():
                    peers.in_flight[key_id] = peers.in_flight.get(key_id, 0) + n
                for key_id, x in counts.tokens.items():
                    peers.tokens.setdefault(key_id, []).append((x, max(0.0, now - written)))
            seen_started, seen = baselines.get(obj.name, (None, None))
            if seen is not None and seen_started == started:  # first read of a head (or of its restart): a baseline
                for key_id, n in admitted.items():
                    if n > seen.get(key_id, 0):
                        peers.admitted[key_id] = peers.admitted.get(key_id, 0) + n - seen.get(key_id, 0)
            baselines[obj.name] = (started, admitted)
        return peers, baselines

    def _sweep(self, now: float) -> None:
        for obj in list(self._objects.list(PREFIX)):
            if now - obj.mtime > SWEEP_S:
                self._objects.delete(obj.name)
                self._admitted_seen.pop(obj.name, None)


def _counts(data: bytes) -> tuple[float, float | None, HeadCounts] | None:
    """(started, written, counts) of an object; None for one that is not that shape. `written` None: a
    head of an older release, which writes neither it nor its buckets (a rolling upgrade)."""
    try:
        body = json.loads(data)
        started, in_flight, admitted = body["started"], body["in_flight"], body["admitted"]
        written, tokens = body.get("written"), body.get("tokens", {})
        numbers = (started, *(() if written is None else (written,)), *tokens.values())
        if all(_is_number(x) for x in numbers) and all(_is_counts(c) for c in (in_flight, admitted)):
            return float(started), None if written is None else float(written), HeadCounts(in_flight, admitted, tokens)
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _is_counts(counts: object) -> bool:
    return isinstance(counts, dict) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()
    )
