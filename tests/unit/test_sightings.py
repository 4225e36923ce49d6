"""Heads judge each other's leases on their own clocks (head/triptych_head/sightings.py): a head whose
wall clock runs ahead of the holder's takes over nothing that is renewed, a holder gone is found once
its record stood unchanged for a lease as the observer saw it, and no two clocks are compared (up to
CLOCK_SKEW_S, beyond which a lease that ended by its holder's clock is gone at first sight)."""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
import types
from pathlib import Path

import pytest

import triptych_head.idempotency as idempotency
import triptych_head.sightings as sightings
from tests.api.test_key_quotas import Clock
from triptych_head.idempotency import Idempotency, InProgress
from triptych_head.objects import DirectoryObjects
from triptych_head.sightings import CLOCK_SKEW_S, Sightings
from triptych_head.webhook_outbox import Outbox, Pending

EVENT = {"id": "evt_1", "type": "video.completed", "data": {"id": "video_1"}}


def test_a_record_lapses_once_it_stood_unchanged_for_its_lease_as_this_head_saw_it() -> None:
    clock = Clock(100.0)
    seen = Sightings(clock)
    now = time.time()
    assert not seen.lapsed("r", 1.0, 30, now + 30, now)  # first sight: its clock starts
    clock.now += 29
    assert not seen.lapsed("r", 1.0, 30, now + 30, now + CLOCK_SKEW_S)  # ahead, within the clocks' difference
    clock.now += 1
    assert seen.lapsed("r", 1.0, 30, now + 30, now)
    assert not seen.lapsed("r", 2.0, 30, now + 30, now)  # renewed: seen anew
    assert seen.lapsed("r", 2.0, 30, None, now) and seen.lapsed("r", 2.0, 30, 0.0, now)  # handed over
    assert seen.lapsed("q", 1.0, 30, now - CLOCK_SKEW_S - 31, now)  # ended long before any clock's now
    assert seen.unchanged_for("r", 2.0) == 0.0


def test_records_no_one_looks_at_any_more_are_forgotten() -> None:
    clock = Clock(0.0)
    seen = Sightings(clock, forget_s=100)
    for n in range(50):
        seen.unchanged_for(f"r{n}", 1)
    clock.now += 101
    seen.unchanged_for("last", 1)
    assert list(seen._seen) == ["last"]


def test_a_webhook_event_renewed_by_its_head_is_no_orphan_to_a_head_whose_clock_runs_ahead(tmp_path: Path) -> None:
    """Head B's clock was 31 s ahead: it adopted an event head A was still delivering, and the
    receiver got it twice while no head had died."""
    a = Outbox(DirectoryObjects(tmp_path), "head-a")
    clock = Clock(100.0)
    b = Outbox(DirectoryObjects(tmp_path), "head-b", Sightings(clock))
    pending = Pending(dict(EVENT))
    a.save(pending)  # its lease: LEASE_S from A's now
    ahead = time.time() + 31
    assert b.orphans(ahead) == []
    clock.now += 20
    a.save(pending)  # renewed
    clock.now += 20
    assert b.orphans(ahead) == []  # 40 s since B first saw it, changed since: seen anew
    clock.now += 29
    assert b.orphans(ahead) == []
    clock.now += 1
    [orphan] = b.orphans(ahead)  # unchanged for a lease since B saw it renewed: A is gone
    assert orphan.event_id == "evt_1" and b.claim(orphan)


def test_an_event_is_adopted_only_once_its_lease_passed_too_as_an_older_head_writes_one_for_a_wait(
    tmp_path: Path,
) -> None:
    """A head of an older release writes the lease once for its whole wait before the next attempt
    (here 70 s, plus LEASE_S): unchanged for a lease, the event is still that head's until then."""
    store, now = DirectoryObjects(tmp_path), time.time()
    record = {"event": EVENT, "attempts": 1, "adoptions": 0, "lease_until": now + 100, "head": "old", "made": now}
    store.put_bytes("webhooks/evt_1.json", json.dumps(record).encode(), "application/json")
    clock = Clock(100.0)
    b = Outbox(store, "head-b", Sightings(clock))
    assert b.orphans(now) == []
    clock.now += 31
    assert b.orphans(now + 31) == []  # in its wait
    assert [p.event_id for p in b.orphans(now + 101)] == ["evt_1"]


SKEW = contextvars.ContextVar("skew", default=0.0)  # how far the wall clock of the head running a task is ahead


@pytest.fixture
def skewed_wall_clocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each asyncio task (one head's request) reads the wall clock with its head's SKEW."""
    wall = types.SimpleNamespace(time=lambda: time.time() + SKEW.get(), monotonic=time.monotonic)
    monkeypatch.setattr(idempotency, "time", wall)
    monkeypatch.setattr(sightings, "time", wall)


@pytest.mark.usefixtures("skewed_wall_clocks")
def test_an_idempotency_key_running_on_a_live_head_is_not_run_again_by_a_head_whose_clock_runs_ahead(
    tmp_path: Path,
) -> None:
    """A retry reached head B, whose clock ran ahead of head A's by most of a lease: B read A's
    renewed lease as run out and ran the request a second time."""
    a = Idempotency(DirectoryObjects(tmp_path), "head-a", lease_s=3.0, poll_s=0.05)
    b = Idempotency(DirectoryObjects(tmp_path), "head-b", lease_s=3.0, poll_s=0.05)
    runs: list[str] = []
    release = asyncio.Event()

    async def run_on(head: str) -> bytes:
        runs.append(head)
        await release.wait()
        return f'{{"answer from {head}"}}'.encode()

    async def retry_on_b(wait_s: float) -> tuple[object, bool]:
        SKEW.set(2.9)  # B's clock: A's lease, renewed every second, reads as run out most of the time
        return await b.once("tenant", "K", "fp", lambda: run_on("b"), wait_s=wait_s)

    async def scenario() -> tuple[tuple[object, bool], tuple[object, bool]]:
        first = asyncio.create_task(a.once("tenant", "K", "fp", lambda: run_on("a"), wait_s=30))
        await asyncio.sleep(1.6)  # A runs it and renewed its lease
        with pytest.raises(InProgress):
            await asyncio.wait_for(retry_on_b(2.0), 10)  # (a second run would wait for `release` for ever)
        assert runs == ["a"]
        release.set()
        return await first, await asyncio.wait_for(retry_on_b(10.0), 20)

    (answer_a, replayed_a), (answer_b, replayed_b) = asyncio.run(scenario())
    assert runs == ["a"] and answer_a == answer_b == b'{"answer from a"}' and (replayed_a, replayed_b) == (False, True)


def test_an_event_record_with_keys_of_another_release_is_read_and_delivered(tmp_path: Path) -> None:
    """A record with a key this release does not know (another release's, in a rolling upgrade or
    after a rollback) was 'not a record this head reads': handed over, it was never delivered."""
    store = DirectoryObjects(tmp_path)
    record = {"event": EVENT, "attempts": 2, "adoptions": 0, "lease_until": 0.0, "head": "gone", "made": time.time(),
              "lease_s": 0.0, "priority_v9": "high"}  # fmt: skip
    store.put_bytes("webhooks/evt_1.json", json.dumps(record).encode(), "application/json")
    b = Outbox(store, "head-b")
    [orphan] = b.orphans(time.time())  # handed over: adoptable at once
    assert (orphan.event_id, orphan.attempts) == ("evt_1", 2) and b.claim(orphan)
