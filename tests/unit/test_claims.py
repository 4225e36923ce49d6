"""An orphan's next attempt is won by one head (claims.claim), and a winner that died before saving the
orphan as its own does not keep it for ever: its marker, once stale, is superseded by the next claim.
Stale is judged on the claimant's own clock, as it saw the marker (sightings.py): the tests move a
clock of their own, and a marker written long before (by any clock) is stale at first sight."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from pathlib import Path

from tests.api.test_key_quotas import Clock
from tests.api.test_takeover import _orphan
from triptych_head import claims
from triptych_head.api.video_jobs import VideoJobs
from triptych_head.objects import DirectoryObjects
from triptych_head.results import ResultStore
from triptych_head.sightings import CLOCK_SKEW_S, Sightings
from triptych_head.webhook_outbox import Outbox, Pending

BASE = "videos/video_1.adopt-1"


def _age(store: DirectoryObjects, name: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(store.root / name, (then, then))


def test_one_claimant_wins_a_live_claim_holds_and_a_stale_one_is_superseded_by_one_claimant(tmp_path: Path) -> None:
    store, clock = DirectoryObjects(tmp_path), Clock(100.0)
    seen = Sightings(clock)  # the claimants' (heads of one process: what one saw, all saw)
    assert claims.claim(store, BASE, b"a", seen) == (BASE, 1)
    assert claims.claim(store, BASE, b"b", seen) is None  # its winner is saving the record
    clock.now += claims.STALE_S - 1
    assert claims.claim(store, BASE, b"b", seen) is None  # ... still, as far as anyone can tell
    clock.now += 2  # ... or died before it did
    heads = [DirectoryObjects(tmp_path) for _ in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(heads)) as pool:
        won = list(pool.map(lambda s: claims.claim(s, BASE, b"x", seen), heads))
    assert sorted(won, key=lambda m: m is None) == [(f"{BASE}.r2", 2)] + [None] * 5, won
    assert claims.claim(store, BASE, b"c", seen) is None  # .r2 is live
    clock.now += claims.STALE_S + 1
    assert claims.claim(store, BASE, b"d", seen) == (f"{BASE}.r3", 3)
    assert claims.claim(store, "videos/video_1.adopt-2", b"e", seen) == ("videos/video_1.adopt-2", 1)  # another


def test_a_claim_is_stale_by_the_claimant_s_clock_not_by_the_store_s_file_times(tmp_path: Path) -> None:
    """A head whose clock ran ahead of the store's (or the writer's) by more than STALE_S read a
    claim made a moment before as stale, and two heads ran the same attempt."""
    store, clock = DirectoryObjects(tmp_path), Clock(100.0)
    assert claims.claim(store, BASE, b"a", Sightings(clock)) == (BASE, 1)
    ahead = time.time() + claims.STALE_S + 30  # the other head's wall clock
    other = Sightings(clock)
    assert claims.claim(store, BASE, b"b", other, now=ahead) is None
    clock.now += claims.STALE_S + 1
    assert claims.claim(store, BASE, b"b", other, now=ahead) == (f"{BASE}.r2", 2)  # seen standing that long
    _age(store, BASE + ".r2", claims.STALE_S + CLOCK_SKEW_S + 1)  # made long before any clock's now
    assert claims.claim(store, BASE, b"c", Sightings(clock)) == (f"{BASE}.r3", 3)  # stale at first sight


def test_a_video_job_whose_adopter_died_before_saving_is_taken_over_once_its_claim_is_stale(tmp_path: Path) -> None:
    """The head that won videos/<id>.adopt-1 died before its save: every head lost that claim, and the
    job showed in_progress until retention removed it."""
    store = ResultStore(DirectoryObjects(tmp_path))
    _orphan(store)
    assert store.objects.create("videos/video_orphan.adopt-1", b"", "text/plain")  # the dead winner's
    started: list[object] = []
    clock = Clock(100.0)
    jobs = VideoJobs(ResultStore(DirectoryObjects(tmp_path)), start=started.append, sightings=Sightings(clock))
    asyncio.run(jobs.take_over_orphans())
    assert started == []  # a winner may still be saving
    clock.now += claims.STALE_S + 1
    asyncio.run(jobs.take_over_orphans())
    assert len(started) == 1
    saved = store.load_job("video_orphan")
    assert saved is not None and saved.job.restarts == 2  # past the first claim's, should its winner live on


def test_a_head_that_cannot_save_its_take_over_does_not_run_the_job(tmp_path: Path) -> None:
    """Its save failed (the store out of its reach), and it ran the job anyway: a later claim, once its
    marker was stale, ran the same attempt too, and neither head could tell."""
    store = ResultStore(DirectoryObjects(tmp_path))
    _orphan(store)
    cut_off: list[object] = []
    clock = Clock(100.0)
    head = VideoJobs(ResultStore(DirectoryObjects(tmp_path)), start=cut_off.append, sightings=Sightings(clock))

    def unreachable(*args: object, **kwargs: object) -> None:
        raise OSError("the store does not answer")

    head.store.objects.put_bytes = unreachable  # type: ignore[assignment,union-attr]
    asyncio.run(head.take_over_orphans())
    assert cut_off == [] and "video_orphan" not in head._jobs
    started: list[object] = []
    other = VideoJobs(ResultStore(DirectoryObjects(tmp_path)), start=started.append, sightings=Sightings(clock))
    asyncio.run(other.take_over_orphans())
    assert started == []  # the first head's claim may be a save under way
    clock.now += claims.STALE_S + 1
    asyncio.run(other.take_over_orphans())
    saved = store.load_job("video_orphan")
    assert len(started) == 1 and saved is not None and saved.job.restarts == 2


def test_a_webhook_event_whose_adopter_failed_after_its_claim_is_adopted_once_stale(tmp_path: Path) -> None:
    """A store error right after winning the marker left it standing: the event was never delivered."""
    root, clock = DirectoryObjects(tmp_path), Clock(100.0)
    Outbox(root, "head-a").save(Pending({"id": "evt_1", "type": "video.completed", "data": {}}), 0.0)  # handed over
    c = Outbox(DirectoryObjects(tmp_path), "head-c", Sightings(clock))
    assert root.create("webhooks/evt_1.adopt-1", b"head-b", "text/plain")  # head-b won, then its read failed
    assert [c.claim(p) for p in c.orphans(time.time())] == [False]
    clock.now += claims.STALE_S + 1
    assert [c.claim(p) for p in c.orphans(time.time())] == [True]


def test_a_stale_claim_whose_winner_saved_meanwhile_is_not_run_again(tmp_path: Path) -> None:
    """The first winner was only slow: its save landed after this head read the job as orphaned. The
    superseding claim's winner looks again and leaves the job to it."""
    store = ResultStore(DirectoryObjects(tmp_path))
    _orphan(store)
    orphaned = store.load_job("video_orphan")
    assert orphaned is not None and orphaned.orphaned(time.time())
    assert store.objects.create("videos/video_orphan.adopt-1", b"", "text/plain")
    _age(store.objects, "videos/video_orphan.adopt-1", claims.STALE_S + CLOCK_SKEW_S + 1)
    slow_winner = orphaned.job.model_copy(update={"restarts": 1})
    store.save_job(slow_winner, time.time() + 30, orphaned.run)  # its save lands now
    started: list[object] = []
    jobs = VideoJobs(ResultStore(DirectoryObjects(tmp_path)), start=started.append)
    assert asyncio.run(jobs.take_over(orphaned)) is None
    assert started == [] and store.load_job("video_orphan").job.restarts == 1  # type: ignore[union-attr]
