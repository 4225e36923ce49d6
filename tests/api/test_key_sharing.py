"""An API key's requests in flight and per minute held by every head together
(head/triptych_head/api/key_sharing.py, key_limits.py): two heads' limits over one real folder, each
head's exchange with the store run as the head's sync runs it, with clocks the test moves. Through
HTTP and over S3: tests/s3/test_shared_results.py."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from tests.api.test_key_quotas import Clock
from triptych_head.api.auth import APIKeys
from triptych_head.api.errors import APIError
from triptych_head.api.key_limits import KeyLimit, KeyLimits
from triptych_head.api.key_sharing import LIVE_S, PREFIX, SWEEP_S, LiveCounts
from triptych_head.objects import DirectoryObjects, StoredObject
from triptych_head.sightings import Sightings

IN_FLIGHT = KeyLimit("k", max_in_flight=2)
PER_MINUTE = KeyLimit("k", max_per_minute=3)


class Head:
    """One head's key limits and its side of the exchange, each with its own client of the folder."""

    def __init__(self, folder: Path, head_id: str, wall: Clock, objects: DirectoryObjects | None = None) -> None:
        self.errors = Counter("errors", "store errors", registry=CollectorRegistry())
        self.live = LiveCounts(objects or DirectoryObjects(folder), head_id, self.errors, wall, Sightings(wall))
        self.clock = Clock(1000.0)  # the token buckets' (monotonic) clock
        self.limits = KeyLimits(CollectorRegistry(), clock=self.clock, live=self.live)
        self.n = 0

    def admit(self, limit: KeyLimit) -> str:
        """A request admitted with the key (raises the 429 APIError of a refusal); its id."""
        self.n += 1
        request_id = f"r{self.n}"
        self.limits.admit(request_id, limit, retry_after_s=1)
        self.limits.admitted(request_id)
        return request_id

    def sync(self, rates: dict[str, int] | None = None) -> None:
        """What the head's periodic sync does (app.py): its counts out, the others' in."""
        rates = rates or {"k": 3}
        self.limits.heard(self.live.exchange(self.limits.counts(rates)), rates)


@pytest.fixture
def wall() -> Clock:
    return Clock(time.time())  # the folder's mtimes are the real clock's


@pytest.fixture
def heads(tmp_path: Path, wall: Clock) -> Iterator[tuple[Head, Head]]:
    a, b = Head(tmp_path, "head-a", wall), Head(tmp_path, "head-b", wall)
    a.sync(), b.sync()  # as each head does before its first request: the others' counts are a baseline
    yield a, b


def exchange(a: Head, b: Head) -> None:
    """Both heads sync, and the first once more: each has heard what the other holds now."""
    a.sync(), b.sync(), a.sync()


def refusal(head: Head, limit: KeyLimit) -> APIError:
    with pytest.raises(APIError) as refused:
        head.admit(limit)
    assert refused.value.status_code == 429
    return refused.value


def test_a_key_s_requests_in_flight_are_counted_over_every_head(heads: tuple[Head, Head]) -> None:
    a, b = heads
    first = a.admit(IN_FLIGHT)
    b.admit(IN_FLIGHT)
    exchange(a, b)
    assert b.limits.usage(IN_FLIGHT)["in_flight"] == {"limit": 2, "used": 2}
    assert refusal(a, IN_FLIGHT).code == "key_concurrency_limit"
    assert refusal(b, IN_FLIGHT).code == "key_concurrency_limit"
    a.limits.release(first)
    exchange(a, b)
    b.admit(IN_FLIGHT)  # a's request ended: the key has room again, on the other head too
    assert refusal(b, IN_FLIGHT).code == "key_concurrency_limit"


def test_a_key_s_requests_per_minute_are_counted_over_every_head(heads: tuple[Head, Head]) -> None:
    a, b = heads
    a.admit(PER_MINUTE), a.admit(PER_MINUTE)
    a.sync(), b.sync()
    assert b.limits.usage(PER_MINUTE)["per_minute"] == {"limit": 3, "remaining": 1}
    b.admit(PER_MINUTE)
    refused = refusal(b, PER_MINUTE)
    assert refused.code == "key_rate_limit" and refused.headers == {"Retry-After": "20"}
    b.sync(), a.sync()
    assert refusal(a, PER_MINUTE).code == "key_rate_limit"  # b's admission reached a's bucket
    b.clock.now += 20  # one token back, at 3 a minute
    b.admit(PER_MINUTE)
    assert refusal(b, PER_MINUTE).code == "key_rate_limit"


def test_a_burst_on_both_heads_within_one_exchange_is_paid_back_before_more_are_admitted(
    heads: tuple[Head, Head],
) -> None:
    """Within one exchange each head admits from its own bucket (what the documentation says heads
    together may pass); what the other admitted is then owed, and refills pay it back first."""
    a, b = heads
    for _ in range(3):
        a.admit(PER_MINUTE), b.admit(PER_MINUTE)
    a.sync(), b.sync()
    assert b.limits.usage(PER_MINUTE)["per_minute"]["remaining"] == 0
    b.clock.now += 40  # two tokens' refill: both owed to a's three
    assert refusal(b, PER_MINUTE).code == "key_rate_limit"
    b.clock.now += 40  # four in all: the debt paid, one over
    b.admit(PER_MINUTE)


def test_a_head_gone_without_its_last_write_stops_counting_after_a_while(heads: tuple[Head, Head], wall: Clock) -> None:
    a, b = heads
    a.admit(IN_FLIGHT), a.admit(IN_FLIGHT)
    a.sync(), b.sync()
    assert refusal(b, IN_FLIGHT).code == "key_concurrency_limit"
    wall.now += LIVE_S + 1  # a wrote nothing since: gone, and its requests with it
    b.sync()
    b.admit(IN_FLIGHT), b.admit(IN_FLIGHT)


def test_a_restarted_head_s_counts_are_a_new_baseline_not_a_burst(
    tmp_path: Path, heads: tuple[Head, Head], wall: Clock
) -> None:
    a, b = heads
    for _ in range(3):
        a.admit(PER_MINUTE)
    a.sync(), b.sync()
    b.clock.now += 60  # b's bucket full again
    wall.now += 1
    again = Head(tmp_path, "head-a", wall)  # the same head id, counting from 0 again
    again.sync(), b.sync()
    assert b.limits.usage(PER_MINUTE)["per_minute"]["remaining"] == 3
    again.admit(PER_MINUTE)
    again.sync(), b.sync()
    assert b.limits.usage(PER_MINUTE)["per_minute"]["remaining"] == 2


def test_a_head_that_starts_takes_its_buckets_from_the_others_not_full(
    tmp_path: Path, heads: tuple[Head, Head], wall: Clock
) -> None:
    """A restart or a scale-out must not hand every key a fresh burst: a new head's bucket of a key
    starts where the emptiest of the others' stands, refilled for the time since they wrote it."""
    a, b = heads
    for _ in range(3):
        a.admit(PER_MINUTE)
    a.sync()  # a's bucket: empty, as written
    wall.now += 10  # half a token's refill since
    late = Head(tmp_path, "head-c", wall)
    late.sync()
    assert late.limits.usage(PER_MINUTE)["per_minute"]["remaining"] == 0
    assert refusal(late, PER_MINUTE).code == "key_rate_limit"
    late.clock.now += 10  # the other half: one token
    late.admit(PER_MINUTE)
    b.sync()  # b had its first exchange before a admitted: its bucket is its own (then a's 3 are taken)
    assert b.limits.usage(PER_MINUTE)["per_minute"]["remaining"] == 0


class FailingObjects(DirectoryObjects):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.failing = False

    def put_bytes(self, name: str, data: bytes, content_type: str) -> None:
        self._answer()
        super().put_bytes(name, data, content_type)

    def list(self, prefix: str) -> Iterator[StoredObject]:
        self._answer()
        return super().list(prefix)

    def _answer(self) -> None:
        if self.failing:
            raise OSError("the store is down")


def test_a_store_outage_keeps_what_was_heard_for_a_while_then_this_head_s_own_counts(
    tmp_path: Path, wall: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    objects = FailingObjects(tmp_path)
    a, b = Head(tmp_path, "head-a", wall), Head(tmp_path, "head-b", wall, objects)
    a.sync(), b.sync()
    a.admit(IN_FLIGHT), a.admit(IN_FLIGHT)
    a.sync(), b.sync()
    objects.failing = True
    with caplog.at_level(logging.WARNING):
        b.sync(), b.sync()
    assert b.errors._value.get() == 2
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1, "logged once"
    assert "cannot share the counts" in caplog.records[0].message
    assert refusal(b, IN_FLIGHT).code == "key_concurrency_limit"  # a's requests, as last heard
    wall.now += LIVE_S + 1
    b.sync()
    b.admit(IN_FLIGHT)  # what a had is too old to hold b back
    objects.failing = False
    b.sync()
    assert b.limits.in_flight("k") == 1  # a's object is old: a is gone


def test_an_object_that_is_not_a_head_s_counts_is_ignored_and_old_ones_are_swept(
    tmp_path: Path, heads: tuple[Head, Head], wall: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = heads
    objects = DirectoryObjects(tmp_path)
    objects.put_bytes(f"{PREFIX}head-x.json", b'{"started": 1, "in_flight": {"k": -4}, "admitted": {}}', "x")
    objects.put_bytes(f"{PREFIX}head-y.json", b"not json", "x")
    a.admit(IN_FLIGHT)
    with caplog.at_level(logging.WARNING):
        a.sync(), b.sync(), b.sync()
    assert b.limits.in_flight("k") == 1
    warned = [r.message for r in caplog.records if "head-y" in r.message]
    assert len(warned) == 2 and "is not a head's counts" in warned[0], warned  # once per head, not per sync
    old = time.time() - SWEEP_S - 10
    os.utime(objects.local_path(f"{PREFIX}head-x.json"), (old, old))  # type: ignore[arg-type]
    wall.now += SWEEP_S
    a.sync()
    names = {obj.name for obj in objects.list(PREFIX)}
    assert f"{PREFIX}head-x.json" not in names and f"{PREFIX}head-a.json" in names, names
    body = json.loads(objects.get_bytes(f"{PREFIX}head-a.json"))
    assert body["in_flight"] == {"k": 1} and body["admitted"] == {}


def test_the_keys_say_whether_the_heads_share_counts_and_each_key_s_rate(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a max_per_minute=5\nsk-b max_in_flight=2\nsk-c max_per_day=9\n")
    keys = APIKeys(path)
    assert keys.shared_limits() and list(keys.rates().values()) == [5]
    path.write_text("sk-c max_per_day=9\n")
    assert not APIKeys(path).shared_limits()  # nothing to share: no store traffic for it


def test_admissions_read_in_an_exchange_that_failed_part_way_are_counted_by_the_next(
    tmp_path: Path, wall: Clock
) -> None:
    """Head A reads B's counts (B took the key's whole minute), then fails to read C's: the next
    exchange still takes B's admissions from A's bucket (the failed read used to move A's baseline of
    B, so they were never counted and the key got twice its rate)."""

    class Flaky(DirectoryObjects):
        armed = False

        def list(self, prefix: str) -> Iterator[StoredObject]:  # B's counts read before C's
            return iter(sorted(super().list(prefix), key=lambda o: o.name))

        def get_bytes(self, name: str) -> bytes:
            if self.armed and name.endswith("head-c.json"):
                self.armed = False
                raise ConnectionError("S3 503 SlowDown")
            return super().get_bytes(name)

    flaky = Flaky(tmp_path)
    a = Head(tmp_path, "head-a", wall, objects=flaky)
    b, c = Head(tmp_path, "head-b", wall), Head(tmp_path, "head-c", wall)
    for head in (a, b, c, a):
        head.sync()  # every head has a baseline of the others
    for _ in range(3):
        b.admit(PER_MINUTE)
    b.sync()
    flaky.armed = True
    a.sync()  # B's counts read, C's read fails
    a.sync()
    refusal(a, PER_MINUTE)


def test_a_head_whose_clock_runs_ahead_still_counts_the_others_requests_in_flight(tmp_path: Path, wall: Clock) -> None:
    """Head B's clock ran 31 s ahead of the store's: every other head's object looked older than
    LIVE_S, and B let a key run its max_in_flight on its own, beside the others'."""
    a = Head(tmp_path, "head-a", wall)
    b = Head(tmp_path, "head-b", Clock(wall.now + LIVE_S + 1))
    a.sync(), b.sync()
    a.admit(IN_FLIGHT), a.admit(IN_FLIGHT)
    a.sync(), b.sync()
    assert refusal(b, IN_FLIGHT).code == "key_concurrency_limit"


def test_an_older_release_s_head_counts_too(tmp_path: Path, wall: Clock) -> None:
    """A head of the release before `written` and `tokens` were written: a newer head ignored its
    object ('not a head's counts'), and a key ran its limit on each release's heads during an upgrade."""
    objects = DirectoryObjects(tmp_path)
    old = {"started": wall.now - 3600, "in_flight": {"k": 2}, "admitted": {"k": 2}}  # up for an hour
    b = Head(tmp_path, "head-b", wall)
    for _ in range(6):  # a minute of the old head rewriting its object every 10 s, as it does
        objects.put_bytes(f"{PREFIX}head-old.json", json.dumps(old).encode(), "application/json")
        b.sync()
        assert refusal(b, IN_FLIGHT).code == "key_concurrency_limit"
        wall.now += 10
    wall.now += LIVE_S  # then it stops: gone, its requests with it
    b.sync()
    b.admit(IN_FLIGHT)
