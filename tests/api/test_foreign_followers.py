"""Followers of a job another head runs, through the store (video_jobs.foreign_events): however many
follow one job, the store is read for it once per FOREIGN_POLL_S, and those reads never hold up this
head's own lease renewals (their threads are their own)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.api.test_takeover import _orphan
from triptych_head.api import video_jobs
from triptych_head.api.video_jobs import JobEntry, VideoJobs, foreign_events
from triptych_head.results import ResultStore

FOLLOWERS = 40


def test_many_followers_of_another_head_s_job_share_one_read_of_it_per_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(video_jobs, "FOREIGN_POLL_S", 0.1)
    store = ResultStore(tmp_path)
    _orphan(store, "video_foreign", lease_until=time.time() + 300)  # another head, alive, runs it
    reads = {"n": 0}
    load_job = ResultStore.load_job

    def counted(self: ResultStore, job_id: str) -> Any:
        reads["n"] += 1
        time.sleep(0.02)  # a store that takes a moment: reads under way overlap
        return load_job(self, job_id)

    monkeypatch.setattr(ResultStore, "load_job", counted)
    jobs = VideoJobs(store, adopting=lambda: False)

    async def follow(entry: JobEntry, got: list[bytes]) -> None:
        async for message in foreign_events(jobs, entry):
            got.append(message)

    async def run() -> tuple[float, list[list[bytes]]]:
        entry = await jobs.get("video_foreign")
        reads["n"] = 0
        got: list[list[bytes]] = [[] for _ in range(FOLLOWERS)]
        tasks = [asyncio.create_task(follow(entry, g)) for g in got]
        started = time.monotonic()
        await asyncio.sleep(1.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return time.monotonic() - started, got

    seconds, got = asyncio.run(run())
    polls = seconds / video_jobs.FOREIGN_POLL_S
    assert reads["n"] <= polls + 3, f"{reads['n']} reads of the store for {FOLLOWERS} followers over {polls:.0f} polls"
    assert all(g and b"event: step" in g[0] for g in got)  # each follower got the job's state
    assert not jobs._followers and not jobs._read  # nothing kept once no one follows


def test_this_head_s_saves_go_on_while_the_default_threads_are_all_busy(tmp_path: Path) -> None:
    """Reads for followers (and any other store call) on the default thread pool all blocked: a
    save of one of this head's own jobs, its lease renewal, still lands at once."""
    store = ResultStore(tmp_path)
    _orphan(store, "video_mine", lease_until=time.time() + 300)
    jobs = VideoJobs(store, adopting=lambda: False)
    release = threading.Event()

    async def run() -> float:
        entry = await jobs.get("video_mine")
        entry.made_here = True  # as a job this head runs
        stuck = [asyncio.create_task(asyncio.to_thread(release.wait, 30)) for _ in range(64)]
        await asyncio.sleep(0.2)  # every default thread is waiting
        started = time.monotonic()
        try:
            await asyncio.wait_for(jobs.save_async(entry), 10)
        finally:
            release.set()
            await asyncio.gather(*stuck)
        return time.monotonic() - started

    took = asyncio.run(run())
    assert took < 5, f"a save waited {took:.1f} s behind the default threads"
