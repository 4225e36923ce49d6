"""Per-API-key quotas over calendar periods, counted by every head of the pipeline together.

A key of --api-keys-file may carry `max_per_hour=N`, `max_per_day=N` and `max_per_month=N`
(auth.py): at most N of its generation requests admitted in the current UTC hour, day or calendar
month by all of the pipeline's heads together, restarts included. One more gets 429
`key_quota_exceeded`, naming the option, with Retry-After: the seconds until the period ends.
`max_device_seconds_per_hour=N` (day, month) do the same for the device-seconds its finished
requests used (their stages' seconds times the devices they ran on, timeline.DEVICE_SECONDS): a
second ledger of the same kind (`Meter` DEVICE_TIME, counting milliseconds under device-quotas/),
charged as each request finishes, so the request that crosses a quota runs to its end and the next
one is refused.

The counts live in the result store the heads share (objects.py: a ReadWriteMany folder or an S3
bucket), one object per head and period:

    quotas/<period>.<head id>.json      {"<key id>": admitted, ...}
                                        <period>: hour-2026-12-05T08, day-2026-12-05, month-2026-12

A head counts its own admissions in memory as it makes them, and every SYNC_S (and once before it
takes requests, and as it stops) writes its counts of the current periods and reads every other
head's: those of heads that have stopped since still count. A key's use is this head's count plus
the others' as last read, so one head never admits past a quota, and heads together can pass it
by what the others admitted since this one last read their counts (up to SYNC_S of their
admissions). A request admitted counts even when it fails later; one refused after the quota was
checked (by the key's rate, overload, a deadline it would miss) gives its count back.

When the store cannot be written or read, each head goes on with the counts it has (logged once,
counted in triptych_key_quota_sync_errors_total): a store outage must not stop the API. Objects of
ended periods are removed by whichever head sweeps first (every SWEEP_S).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from prometheus_client import CollectorRegistry, Counter

from triptych_head.api.store_sync import SyncHealth
from triptych_head.objects import ObjectStore

log = logging.getLogger(__name__)

FOLDER = "quotas"
SYNC_S = 2.0  # how often a head writes its counts and reads the others'
SWEEP_S = 3600.0  # how often a head removes the objects of ended periods
# From a store that gives no tag (StoredObject.tag), another head's counts are read again at every sync
# until their object is this old: a rewrite within the same second can keep its mtime and size, so only
# a settled object (a stopped head's, mostly) is taken from the cache. With a tag, an unchanged tag is.
SETTLED_S = 60.0


@dataclass(frozen=True)
class Period:
    """A calendar period in UTC: `name` is hour, day or month."""

    name: str

    def bounds(self, now: float) -> tuple[str, float]:
        """The id of the period `now` (seconds since the epoch) falls in, and when that period ends."""
        at = datetime.fromtimestamp(now, UTC)
        if self.name == "hour":
            start = at.replace(minute=0, second=0, microsecond=0)
            return f"hour-{start:%Y-%m-%dT%H}", (start + timedelta(hours=1)).timestamp()
        if self.name == "day":
            start = at.replace(hour=0, minute=0, second=0, microsecond=0)
            return f"day-{start:%Y-%m-%d}", (start + timedelta(days=1)).timestamp()
        start = at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
        return f"month-{start:%Y-%m}", end.timestamp()


PERIODS = {p.name: p for p in (Period("hour"), Period("day"), Period("month"))}


@dataclass(frozen=True)
class Meter:
    """What a ledger counts, in whole units: a quota of N is N x `scale` of them."""

    noun: str  # as a refusal names the quota: "its 1000 requests this day"
    folder: str  # where the heads' counts live in the shared store
    option_prefix: str  # the --api-keys-file options: <prefix><period>=N
    scale: int  # units counted per unit of a quota
    metric: str  # the refusals' counter

    def options(self) -> dict[str, Period]:
        return {f"{self.option_prefix}{p.name}": p for p in PERIODS.values()}


REQUESTS = Meter("requests", FOLDER, "max_per_", 1, "triptych_rejected_key_quota_requests")
DEVICE_TIME = Meter("device-seconds", "device-quotas", "max_device_seconds_per_", 1000,
                    "triptych_rejected_key_device_quota_requests")  # fmt: skip
OPTIONS = REQUESTS.options()  # max_per_hour -> the hour, ...
DEVICE_OPTIONS = DEVICE_TIME.options()  # max_device_seconds_per_hour -> the hour, ...


class QuotaExceeded(Exception):
    """A key has used its quota of a period; `retry_after_s`: until the period ends."""

    def __init__(self, period: Period, quota: int, retry_after_s: int, meter: Meter = REQUESTS) -> None:
        option = f"{meter.option_prefix}{period.name}"
        super().__init__(
            f"used its {quota} {meter.noun} this {period.name} (UTC; {option}={quota} in --api-keys-file, "
            f"counted by every head); retry in {retry_after_s} s, when the {period.name} ends"
        )
        self.retry_after_s = retry_after_s


class QuotaLedger:
    """This head's counts per key and period (admissions, or device-milliseconds: `meter`), and the other
    heads' as last read from the store. check/take/add/spent/give_back run on the API's event loop; sync
    (store I/O) in a thread. `errors`: the store failures' counter, when another ledger made it."""

    def __init__(
        self,
        objects: ObjectStore,
        head_id: str,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.time,
        meter: Meter = REQUESTS,
        errors: Counter | None = None,
    ) -> None:
        self.meter = meter
        self._objects = objects
        self._head_id = head_id
        self._clock = clock
        self._syncing = threading.Lock()
        self._lock = threading.Lock()  # _own and _dirty: changed on the loop, copied by sync's thread
        self._own: dict[str, dict[str, int]] = {}  # period id -> key id -> admitted by this head
        self._dirty: set[str] = set()  # period ids whose counts the store has not seen yet
        self._others: dict[str, dict[str, int]] = {}  # period id -> key id -> admitted by the other heads
        self._read: dict[str, tuple[object, dict[str, int]]] = {}  # object name -> (its version, counts)
        self._taken: dict[str, list[tuple[str, str]]] = {}  # request id -> the (period id, key id) it counts in
        self._swept = 0.0
        self.rejected = Counter(
            meter.metric,
            f"Requests refused with 429 because their API key had used its quota of {meter.noun} of an hour, day "
            "or month",
            ["period"],
            registry=registry,
        )
        self.sync_errors = errors or Counter(
            "triptych_key_quota_sync_errors",
            "Times a head could not share its API keys' counts (quotas, in flight, per minute) through the store",
            registry=registry,
        )
        self._health = SyncHealth(self.sync_errors, f"key quotas of {meter.noun}", "sync the counts")

    def used(self, period: Period, key_id: str) -> int:
        """The key's count in the current `period` (in the meter's units): this head's and the others' as
        last read."""
        period_id, _ = period.bounds(self._clock())
        return self._own.get(period_id, {}).get(key_id, 0) + self._others.get(period_id, {}).get(key_id, 0)

    def usage(self, period: Period, key_id: str, quota: int) -> dict[str, object]:
        """One quota as GET /v1/usage shows it: the period, its limit, what the key used and when it ends."""
        now = self._clock()
        _, ends = period.bounds(now)
        used = self.used(period, key_id)
        return {
            "period": period.name,
            "limit": quota,
            "used": used if self.meter.scale == 1 else round(used / self.meter.scale, 3),
            "resets_at": int(ends),
            "resets_in_seconds": max(0, math.ceil(ends - now)),
        }

    def check(self, key_id: str, quotas: Collection[tuple[str, int]]) -> None:
        """Raise QuotaExceeded at the first quota the key has used; counts nothing."""
        now = self._clock()
        for name, quota in quotas:
            period = PERIODS[name]
            if self.used(period, key_id) >= quota * self.meter.scale:
                self.rejected.labels(name).inc()
                _, ends = period.bounds(now)
                raise QuotaExceeded(period, quota, max(1, math.ceil(ends - now)), self.meter)

    def take(self, request_id: str, key_id: str, quotas: Collection[tuple[str, int]]) -> None:
        """Count `request_id` in each of its key's periods (after every check passed)."""
        now = self._clock()
        counted = []
        with self._lock:
            for name, _ in quotas:
                period_id, _ = PERIODS[name].bounds(now)
                counts = self._own.setdefault(period_id, {})
                counts[key_id] = counts.get(key_id, 0) + 1
                self._dirty.add(period_id)
                counted.append((period_id, key_id))
        self._taken[request_id] = counted

    def add(self, key_id: str, period_names: Collection[str], units: int) -> None:
        """Count `units` more for the key in the current period of each of `period_names` (device time, as a
        request finishes: it is not given back)."""
        if units <= 0:
            return
        now = self._clock()
        with self._lock:
            for name in period_names:
                period_id, _ = PERIODS[name].bounds(now)
                counts = self._own.setdefault(period_id, {})
                counts[key_id] = counts.get(key_id, 0) + units
                self._dirty.add(period_id)

    def spent(self, request_id: str) -> None:
        """The request was admitted: its counts stay."""
        self._taken.pop(request_id, None)

    def give_back(self, request_id: str) -> None:
        """The request was refused after it was counted: it no longer counts (no-op when it was admitted)."""
        with self._lock:
            for period_id, key_id in self._taken.pop(request_id, ()):
                counts = self._own.get(period_id, {})
                if counts.get(key_id, 0) > 0:
                    counts[key_id] -= 1
                    self._dirty.add(period_id)

    def pending(self) -> bool:
        """Whether this head has counts the store has not seen yet."""
        return bool(self._dirty)

    def sync(self, period_names: Collection[str]) -> None:
        """Write this head's changed counts, then read the other heads' of the current periods of
        `period_names` (those some key's quotas use); every SWEEP_S remove the ended periods' objects.
        Store errors are logged once and counted; the counts in memory stay."""
        with self._syncing:  # the periodic sync and the last one as the head stops never overlap
            self._sync(period_names)

    def _sync(self, period_names: Collection[str]) -> None:
        now = self._clock()
        current = {PERIODS[name].bounds(now)[0] for name in period_names}
        try:
            self._publish(current)
            self._others = {period_id: self._read_others(period_id) for period_id in current}
            self._read = {name: read for name, read in self._read.items() if self._period_of(name) in current}
            if now - self._swept >= SWEEP_S:
                self._sweep({period.bounds(now)[0] for period in PERIODS.values()})
                self._swept = now
        except Exception as exc:
            self._health.failed(exc, self._objects.description)
            return
        self._health.succeeded(self._objects.description)

    def _publish(self, current: set[str]) -> None:
        with self._lock:
            changed = {period_id: dict(self._own[period_id]) for period_id in self._dirty if period_id in self._own}
            self._dirty.clear()
            for period_id in [p for p in self._own if p not in current and p not in changed]:
                del self._own[period_id]  # ended, and the store has its last counts
        try:
            for period_id, counts in changed.items():
                data = json.dumps(counts, separators=(",", ":")).encode()
                self._objects.put_bytes(self._name(period_id, self._head_id), data, "application/json")
        except Exception:
            with self._lock:
                self._dirty.update(changed)  # written at the next sync
            raise

    def _read_others(self, period_id: str) -> dict[str, int]:
        total: dict[str, int] = {}
        mine = self._name(period_id, self._head_id)
        for obj in self._objects.list(f"{self.meter.folder}/{period_id}."):
            if obj.name == mine or not obj.name.endswith(".json"):
                continue
            cached = self._read.get(obj.name)
            # Its tag changes with its content (an ETag, a file's inode, mtime and size); without one, an
            # mtime and size tell a rewrite only once they are older than a store's mtime granularity
            # (whole seconds on S3), by this head's clock against the store's: a cache of the same
            # version is trusted only then.
            version = obj.tag or (obj.mtime, obj.size)
            settled = bool(obj.tag) or obj.mtime < time.time() - SETTLED_S
            if cached is not None and cached[0] == version and settled:
                counts = cached[1]
            else:
                counts = _counts(obj.name, self._objects.get_bytes(obj.name))
                self._read[obj.name] = (version, counts)
            for key_id, n in counts.items():
                total[key_id] = total.get(key_id, 0) + n
        return total

    def _sweep(self, current: set[str]) -> None:
        for obj in list(self._objects.list(f"{self.meter.folder}/")):
            if self._period_of(obj.name) not in current:
                self._objects.delete(obj.name)
                self._read.pop(obj.name, None)

    def _name(self, period_id: str, head_id: str) -> str:
        return f"{self.meter.folder}/{period_id}.{head_id}.json"

    def _period_of(self, name: str) -> str:
        """The period id of a counts object's name (quotas/<period>.<head id>.json)."""
        return name.removeprefix(f"{self.meter.folder}/").split(".", 1)[0]


def _counts(name: str, data: bytes) -> dict[str, int]:
    """An object's counts; one that is not a map of whole numbers is logged and counts nothing."""
    try:
        counts = json.loads(data)
        if isinstance(counts, dict) and all(isinstance(n, int) and n >= 0 for n in counts.values()):
            return {str(k): n for k, n in counts.items()}
    except ValueError:
        pass
    log.warning("key quotas: %s is not a map of counts; ignored", name)
    return {}
