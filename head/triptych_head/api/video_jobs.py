"""The head's video jobs: each job's entry (its record, its progress feed, whether this head runs it),
remembered up to MAX_JOBS, saved in the result store every head shares, with a lease renewed while
this head runs it; a job whose head stopped renewing its lease is taken over and run again from the
start by the head that finds it (docs/results.md). The routes are videos.py's."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import msgspec
from prometheus_client import CollectorRegistry, Counter

from triptych.params import GenerationParams
from triptych.priority import DEFAULT_LEVEL, LEVELS
from triptych_head import claims
from triptych_head.api.errors import APIError
from triptych_head.api.ownership import may_see
from triptych_head.api.progress import (
    HISTORY_LINGER_S,
    KEEPALIVE,
    KEEPALIVE_S,
    ProgressFeed,
    SSEMessage,
    error_message,
)
from triptych_head.api.schemas import VideoJob
from triptych_head.api.store_calls import from_store
from triptych_head.api.video_list import StoredJobIndex
from triptych_head.results import JOB_LEASE_S, TERMINAL, ResultStore, StoredJob
from triptych_head.sightings import Sightings
from triptych_head.state import RequestState

log = logging.getLogger(__name__)

LEASE_MARGIN_S = JOB_LEASE_S / 3  # JobEntry.lease_from: held surely until this long before its end

MAX_JOBS = 1000  # remembered jobs; the oldest finished ones are forgotten first
RESTARTED = "the head restarted while this job was running; submit it again"
JOB_ID = re.compile(r"video_[A-Za-z0-9_-]{1,64}")  # new_request_id("video") makes video_<32 hex>
FOREIGN_POLL_S = 1.0  # how often the events of a job another head runs re-read its status
# Threads of their own for the store calls that keep this head's jobs its own (lease renewals and
# saves): reads for followers of other heads' jobs, on the default pool, never queue ahead of them.
LEASE_IO_THREADS = 4
T = TypeVar("T")
SHUT_DOWN = "the head shut down while this job was running; submit it again"


@dataclass
class JobEntry:
    job: VideoJob
    task: asyncio.Task[None] | None = None  # set on the head that runs the job, once it starts
    made_here: bool = False  # this head runs (or ran) the job: its memory is the truth, the store follows
    feed: ProgressFeed | None = None  # made for a running job, or when someone asks for a finished one's events
    save_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # saves land in the order they were asked for
    params: GenerationParams | None = None  # on the head that runs it: what it runs (saved for a take-over)
    preview_every: int = 0
    priority: int = DEFAULT_LEVEL  # its priority level (triptych.priority), its API key's ceiling checked
    handed_over: bool = False  # this head shut down while the job ran: it is left to another head
    # Another head took the job over while this one ran it (its lease lapsed: the store was out of reach
    # longer than a lease): this head stops its run, and saves and tells nothing more of it.
    taken: bool = False
    # When this head began its last save with a lease that landed, (time.monotonic(), time.time()): no
    # other head sees the record unchanged for JOB_LEASE_S (sightings.py), so none takes the job over,
    # before JOB_LEASE_S from then. Both clocks: a monotonic one stands still while a VM is suspended.
    # None: never saved so.
    lease_from: tuple[float, float] | None = None
    server_timing: str = ""  # where a completed run's time went (timeline.py), on the head that ran it
    key_id: str | None = None  # the API key it counts against (a digest, auth.py), when that key has limits
    owner: str | None = None  # whose requests see it (ownership.py); None: everyone's

    @property
    def request_id(self) -> str:
        """The id its run goes by on the workers: a run again after a take-over gets its own (the dead
        head's run of the job may still be held there until the workers notice that head is gone)."""
        return self.job.id if not self.job.restarts else f"{self.job.id}_r{self.job.restarts}"

    def run_record(self) -> dict[str, Any] | None:
        """What another head needs to run this job again (results.StoredJob.run)."""
        if self.params is None:
            return None
        params = json.loads(msgspec.json.encode(self.params))
        record = {"params": params, "preview_every": self.preview_every, "priority": self.priority}
        return record if self.key_id is None else {**record, "key_id": self.key_id}

    @property
    def running_here(self) -> bool:
        return self.made_here and self.job.status not in TERMINAL and not self.handed_over

    def close_feed(self) -> None:
        """The job moved to another head: its followers here reconnect (and follow it through the
        store); a later one gets a new feed (the job's end, once the store shows it)."""
        if self.feed is not None:
            self.feed.close()
            self.feed = None

    def progress_feed(self) -> ProgressFeed:
        if self.feed is None:
            self.feed = ProgressFeed(self.job.id, HISTORY_LINGER_S)
            if self.job.status in TERMINAL:
                self.feed.publish(final_message(self.job))
        return self.feed


def final_message(job: VideoJob) -> SSEMessage:
    """How a job ended, as its last progress event."""
    if job.status == "completed":
        return SSEMessage("completed", {**job.model_dump(), "content_url": f"/v1/videos/{job.id}/content"})
    error = job.error or {}
    status = 499 if job.status == "cancelled" else 500
    return error_message(job.id, error.get("message") or job.status, error.get("code") or job.status, status)


def fail_orphan(job: VideoJob, message: str = RESTARTED, code: str = "head_restarted") -> None:
    job.status, job.state = "failed", RequestState.FAILED.value
    job.error = {"message": message, "code": code}
    job.completed_at = job.completed_at or int(time.time())


Level = Annotated[int, msgspec.Meta(ge=0, le=len(LEVELS) - 1)]
Every = Annotated[int, msgspec.Meta(ge=0)]


class SavedRun(msgspec.Struct, forbid_unknown_fields=True):
    """What a head saves of a job so that another runs it again (JobEntry.run_record)."""

    params: GenerationParams
    preview_every: Every = 0
    priority: Level = DEFAULT_LEVEL  # a job saved before priorities: normal
    key_id: str | None = None


def _saved_run(run: dict[str, Any] | None) -> tuple[SavedRun | None, str]:
    """How an orphaned job runs again: (None, "") when its head kept nothing of it; (None, why) when this
    head cannot read what it kept (saved by another version of Triptych, or damaged): it cannot run it,
    and must not claim it and leave it running for ever."""
    if run is None:
        return None, ""
    try:
        return msgspec.json.decode(json.dumps(run), type=SavedRun), ""
    except (TypeError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        why = f"its head died and what it saved to run it again cannot be read here ({exc!s:.200}); submit it again"
        return None, why


Starter = Callable[["JobEntry"], None]
Ended = Callable[[dict[str, Any]], None]  # told of each job this head ends, as the API shows it (webhooks.py)


class VideoJobs:
    """The video jobs this head runs or has seen; every job's JSON in the result store, which all
    heads share, is the truth for a job this head does not run (its status as its head last wrote it).

    A job whose head died (its lease ran out: its record stood unchanged for JOB_LEASE_S as this head
    saw it, sightings.py) is taken over by the first head that notices (each
    looks every JOB_LEASE_RENEW_S, and whenever a client asks for it) and wins the job's next
    attempt (`videos/<id>.adopt-<n>`, created once): that head runs it again from the start, same
    parameters and seed, so the same pixels; `restarts` counts the take-overs."""

    def __init__(
        self,
        store: ResultStore | None = None,
        start: Starter | None = None,
        registry: CollectorRegistry | None = None,
        on_end: Ended | None = None,
        adopting: Callable[[], bool] = lambda: True,
        sightings: Sightings | None = None,
    ) -> None:
        self._jobs: OrderedDict[str, JobEntry] = OrderedDict()
        self.sightings = sightings or Sightings()  # how long other heads' job records stood unchanged
        # Whether this head takes over orphaned jobs now: not while it drains, when each would only be
        # run again from the start by the next head (and hold up the drain).
        self.adopting = adopting
        self.store = store
        self.index = StoredJobIndex(store) if store is not None else None  # every head's jobs, for listings
        self.start = start  # runs a job on this head (set by the app: it needs the backend)
        self.on_end = on_end
        self._pending: set[asyncio.Future[None]] = set()  # background saves (save_soon)
        self._lease_io = ThreadPoolExecutor(LEASE_IO_THREADS, thread_name_prefix="video-leases")
        # Followers of other heads' jobs share one read of each job's record per FOREIGN_POLL_S (latest).
        self._followers: dict[str, int] = {}
        self._reading: dict[str, asyncio.Future[JobEntry]] = {}
        self._read: dict[str, tuple[float, JobEntry]] = {}  # job -> (when read, what)
        self.takeovers = Counter(
            "triptych_video_job_takeovers",
            "Video jobs this head took over from a head that died or shut down, and ran again from the start",
            registry=registry,
        )

    def restore(self) -> None:
        """Take back the saved jobs that ended. A running one stays its head's, or, when its head
        died, is taken over by take_over_orphans (the app runs it at start)."""
        if self.store is None or self.index is None:
            return
        for stored in sorted(self.index.jobs(), key=lambda s: s.job.created_at)[-MAX_JOBS:]:
            job = stored.job
            if job.status not in TERMINAL:
                continue  # another head's (or an orphan's): read from the store whenever asked for
            elif job.status == "completed" and not self.store.has(self.store.video_name(job.id)):
                continue  # its content is gone (removed by hand): forget it
            self._jobs[job.id] = JobEntry(job, owner=stored.owner)

    def _lease(self) -> float:
        return time.time() + JOB_LEASE_S

    def _orphaned(self, stored: StoredJob) -> bool:
        """Still running, but no head holds it: handed over, or its record stood unchanged for a lease
        as this head saw it (its head died). Each save with a lease writes a new `lease_until`."""
        assert self.store is not None
        if stored.job.status in TERMINAL:
            return False
        name = self.store.job_name(stored.job.id)
        return self.sightings.lapsed(name, stored.lease_until, JOB_LEASE_S, stored.lease_until)

    def save(self, entry: JobEntry) -> None:
        """Save now (blocking): at shutdown."""
        if self.store is None:
            return
        try:
            lease = self._lease() if entry.running_here else None
            self.store.save_job(entry.job, lease, entry.run_record(), entry.owner)
        except Exception:  # a full or unreachable store: the job still runs, other heads just see it late
            log.exception("could not save video job %s", entry.job.id)

    async def save_async(self, entry: JobEntry) -> None:
        """Save the job as it is when its turn comes: the last save asked for is the last written."""
        if self.store is None:
            return
        async with entry.save_lock:
            if entry.taken or (entry.made_here and not entry.handed_over and not await self._still_ours(entry)):
                return
            self.store.stamp_expiry(entry.job)  # this head's answers show it as the store's do
            job = entry.job.model_copy()
            lease = self._lease() if entry.running_here else None
            began = time.monotonic(), time.time()
            try:
                await self._own_io(self.store.save_job, job, lease, entry.run_record(), entry.owner)
                if lease is not None:
                    entry.lease_from = began if entry.lease_from is None else max(entry.lease_from, began)
            except Exception:
                log.exception("could not save video job %s", job.id)

    async def _still_ours(self, entry: JobEntry) -> bool:
        """Whether this head may save the job it runs. Another head can have taken it over only once
        this head's lease may have lapsed (LEASE_MARGIN_S before its end, for slow writes, by either of
        this head's clocks), so only then is the store read first; a read that fails skips this save (the
        next one reads again), since writing blind could overwrite the other head's record. A job taken
        over is that head's from now on: this head's run is stopped, and it saves and tells nothing
        more (`entry.taken`)."""
        assert self.store is not None
        if entry.lease_from is None:
            return True  # never leased: a new job, which no other head can know yet
        held = JOB_LEASE_S - LEASE_MARGIN_S
        since_monotonic, since_wall = entry.lease_from
        if time.monotonic() < since_monotonic + held and time.time() < since_wall + held:
            return True
        try:
            stored = await self._own_io(self.store.load_job, entry.job.id)
        except Exception as exc:
            log.warning(
                "video job %s: not saved, its record unreadable (%s); the next save tries again", entry.job.id, exc
            )
            return False
        if stored is None or stored.job.restarts <= entry.job.restarts:
            return True
        log.warning(
            "video job %s: another head took it over (restart %d) while this head's lease had lapsed; "
            "this head stops its run",
            entry.job.id,
            stored.job.restarts,
        )
        entry.taken = entry.handed_over = True
        entry.close_feed()
        if entry.task is not None and entry.task is not asyncio.current_task():
            entry.task.cancel()
        return False

    async def _own_io(self, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` on the threads of this head's own jobs' records (LEASE_IO_THREADS)."""
        return await asyncio.get_running_loop().run_in_executor(self._lease_io, functools.partial(call, *args))

    @contextlib.contextmanager
    def following(self, job_id: str) -> Iterator[None]:
        """One more follower of `job_id`'s events through the store (`latest`); its last shared read
        is forgotten when no one follows any more."""
        self._followers[job_id] = self._followers.get(job_id, 0) + 1
        try:
            yield
        finally:
            self._followers[job_id] -= 1
            if not self._followers[job_id]:
                del self._followers[job_id]
                self._read.pop(job_id, None)

    async def latest(self, job_id: str) -> JobEntry:
        """The job as `get` finds it, read from the store at most once per FOREIGN_POLL_S however many
        follow it: a read under way is shared, and its answer reused until it is that old (so a
        thousand followers of one job cost the store, and this head's threads, one read a second)."""
        read = self._read.get(job_id)
        if read is not None and time.monotonic() - read[0] < FOREIGN_POLL_S:
            return read[1]
        pending = self._reading.get(job_id)
        if pending is None:
            pending = asyncio.ensure_future(self._get(job_id))
            self._reading[job_id] = pending
            pending.add_done_callback(lambda _: self._reading.pop(job_id, None))
        entry = await asyncio.shield(pending)  # a follower that leaves does not cancel the others' read
        if job_id in self._followers:
            self._read[job_id] = (time.monotonic(), entry)
        return entry

    def save_soon(self, entry: JobEntry) -> None:
        """Save in the background (its state changed): other heads see it within a write."""
        task = asyncio.ensure_future(self.save_async(entry))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def renew_leases(self) -> None:
        """Re-save the jobs this head runs, so no other head takes them for orphans."""
        for entry in list(self._jobs.values()):
            if entry.running_here:
                await self.save_async(entry)

    async def add(self, entry: JobEntry) -> None:
        if len(self._jobs) >= MAX_JOBS:
            finished = [k for k, e in self._jobs.items() if e.job.status in TERMINAL]
            if not finished:
                raise APIError(429, f"{MAX_JOBS} video jobs are in flight; retry later", code="too_many_jobs")
            self._jobs.pop(finished[0])
        self._jobs[entry.job.id] = entry
        await self.save_async(entry)
        if self.store is None:
            return
        try:
            await from_store("for a new video job", self.store.mark_running, entry.job.id)
        except APIError:  # not listed as running, no head would ever run it: it is not made at all
            self._jobs.pop(entry.job.id, None)
            await asyncio.to_thread(_forget, self.store, entry.job.id)
            raise

    async def take_over_orphans(self) -> None:
        """Run again the jobs whose heads died (they are listed as running, their leases ran out)."""
        if self.store is None or not self.adopting():
            return
        for job_id in await asyncio.to_thread(self.store.running_jobs):
            entry = self._jobs.get(job_id)
            if entry is not None and entry.running_here:
                continue
            stored = await asyncio.to_thread(self.store.load_job, job_id)
            if stored is not None and self._orphaned(stored):
                await self.take_over(stored)

    async def take_over(self, stored: StoredJob) -> JobEntry | None:
        """Run an orphaned job here, if this head wins its next attempt: the entry. None when another
        head won it, or when it cannot run again (saved by a head that kept no parameters): then it
        is marked failed, as the stored job shows."""
        assert self.store is not None
        job = stored.job
        run, unreadable = _saved_run(stored.run)
        if self.start is None or run is None:
            fail_orphan(job, *((unreadable, "unreadable_job") if unreadable else ()))
            await from_store(f"saving video {job.id}", self.store.save_job, job, None, None, stored.owner)
            self.ended(job)
            return None
        if not self.adopting():  # the drain began since the scan looked (it would hand the job over again)
            return None
        attempt = job.restarts + 1
        marker = f"{self.store.job_name(job.id).removesuffix('.json')}.adopt-{attempt}"
        won = await from_store(
            f"taking over video {job.id}", claims.claim, self.store.objects, marker, b"", self.sightings
        )
        if won is None:
            return None  # another head takes it over: its next save shows it
        if won.ordinal > 1 and not await self._still_orphaned(job.id, attempt):
            return None  # the stale claim's winner saved it meanwhile: it runs there
        attempt += won.ordinal - 1  # past a stale claim's winner, which may live on: its next save fences it
        job = job.model_copy()  # the stored job stays as the store has it until this head's save lands
        job.restarts, job.step, job.progress, job.error = attempt, 0, 0, None
        job.status, job.state = "queued", RequestState.PENDING.value
        entry = JobEntry(job, made_here=True, params=run.params, preview_every=run.preview_every)
        entry.priority = run.priority
        entry.key_id = run.key_id  # its key's device-seconds are charged for the run again
        entry.owner = stored.owner
        began = time.monotonic(), time.time()
        try:  # it runs here only once the store shows it this head's (else a later claim runs it, once stale)
            record = (self._lease(), entry.run_record(), entry.owner)
            await from_store(f"taking over video {job.id}", self.store.save_job, job, *record)
        except APIError:
            return None
        entry.lease_from = began
        entry.feed = ProgressFeed(job.id, HISTORY_LINGER_S)
        self._jobs[job.id] = entry
        self._jobs.move_to_end(job.id)
        log.warning("video job %s lost its head: running it again here from the start (restart %d)", job.id, attempt)
        self.takeovers.inc()
        self.start(entry)
        return entry

    async def _still_orphaned(self, job_id: str, attempt: int) -> bool:
        """After superseding a stale claim of `attempt`: the job still waits for it (the earlier
        winner, only slow, may have saved it as its own since this head read it)."""
        assert self.store is not None
        stored = await from_store(f"taking over video {job_id}", self.store.load_job, job_id)
        return stored is not None and stored.job.restarts < attempt and self._orphaned(stored)

    async def get(self, job_id: str, owner: str | None = None) -> JobEntry:
        """The job, wherever it runs: the jobs this head runs from memory (the ones it ran too, once the
        store shows they were not removed), every other from the store. `owner`: the caller's
        (ownership.py); another owner's job is a 404, as one that does not exist."""
        entry = await self._get(job_id)
        if not may_see(entry.owner, owner):
            raise APIError(404, f"no video job {job_id!r}", "video_id")
        return entry

    async def _get(self, job_id: str) -> JobEntry:
        entry = self._jobs.get(job_id)
        if entry is None and not JOB_ID.fullmatch(job_id):  # never one of ours: the store is not asked
            raise APIError(404, f"no video job {job_id[:200]!r}", "video_id")
        if (entry is not None and entry.running_here) or self.store is None:
            if entry is None:
                raise APIError(404, f"no video job {job_id!r}", "video_id")
            return entry
        stored = await from_store(f"for video {job_id}", self.store.load_job, job_id)
        if stored is None:  # never made, or removed (by retention or DELETE on any head)
            self._jobs.pop(job_id, None)
            raise APIError(404, f"no video job {job_id!r}", "video_id")
        if entry is not None and entry.made_here and not entry.handed_over:
            return entry  # this head ran it: its memory is ahead of the store until its last save lands
        if self._orphaned(stored) and self.adopting():  # its head died: this head may take it over
            adopted = await self.take_over(stored)
            if adopted is not None:
                return adopted
        if entry is None:
            entry = JobEntry(stored.job, owner=stored.owner)
            if stored.job.status in TERMINAL:
                self._remember(entry)
        elif stored.job.status != entry.job.status and stored.job.status in TERMINAL and entry.feed is not None:
            entry.feed.publish(final_message(stored.job))
        entry.job = stored.job
        return entry

    def _remember(self, entry: JobEntry) -> None:
        if len(self._jobs) >= MAX_JOBS:
            finished = [k for k, e in self._jobs.items() if e.job.status in TERMINAL]
            if not finished:
                return
            self._jobs.pop(finished[0])
        self._jobs[entry.job.id] = entry

    async def listed(self, owner: str | None = None) -> list[VideoJob]:
        """Every job `owner` sees (ownership.py; None: every job), whichever head runs or ran it: the
        store's, this head's own as it knows them (ahead of the store until its last save lands);
        without a store, the jobs this head remembers."""
        if self.index is None:
            return [e.job for e in self._jobs.values() if may_see(e.owner, owner)]
        stored = await from_store("a listing of video jobs", self.index.jobs)
        jobs = {s.job.id: (s.job, s.owner) for s in stored}
        for entry in self._jobs.values():  # removed from the store (DELETE, retention): gone, once it ended
            if entry.made_here and not entry.handed_over and (entry.job.id in jobs or entry.job.status not in TERMINAL):
                jobs[entry.job.id] = (entry.job, entry.owner)
        return [job for job, job_owner in jobs.values() if may_see(job_owner, owner)]

    def running(self) -> list[str]:
        return [k for k, e in self._jobs.items() if e.job.status not in TERMINAL]

    def remove(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def forget_removed(self, keys: list[str]) -> None:
        """Retention removed these results' files: a finished job among them is gone."""
        for key in keys:
            entry = self._jobs.get(key)
            if entry is not None and entry.job.status in TERMINAL:
                self._jobs.pop(key)

    async def shutdown(self, grace_s: float) -> None:
        """Let jobs finish saving for up to `grace_s`. Any still running is handed over: saved as
        running, without a lease, so another head (or this one's successor, at its start) takes it
        over and runs it again. Without a store to leave it in, it fails."""
        tasks = [e.task for e in self._jobs.values() if e.task is not None and not e.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for entry in self._jobs.values():
            if entry.job.status in TERMINAL or entry.task is None or entry.handed_over:
                continue  # handed over already (at the drain's end): another head may have it, and saved it since
            entry.handed_over = self.store is not None and entry.params is not None
            entry.task.cancel()
            await asyncio.gather(entry.task, return_exceptions=True)
            if not entry.handed_over:
                fail_orphan(entry.job, SHUT_DOWN, "head_shut_down")  # its run's end told on_end already
                entry.job.completed_at = int(time.time())
            await self.save_async(entry)
        if self._pending:  # saves asked for earlier land before their threads go
            await asyncio.wait(list(self._pending), timeout=grace_s)
        self._lease_io.shutdown(wait=False)

    def ended(self, job: VideoJob) -> None:
        """This head ended the job (it completed, failed or was cancelled here): tell on_end."""
        if self.on_end is not None:
            self.on_end(job.model_dump())


async def foreign_events(jobs: VideoJobs, entry: JobEntry) -> AsyncIterator[bytes]:
    """The events of a job another head runs, as its saved status changes (state changes and, at each
    lease renewal, its step), until it ends; a keep-alive comment after KEEPALIVE_S without one, as a
    job of this head's. A store that does not answer for a while is waited out (the job has not ended);
    a job removed meanwhile ends the stream with its error."""
    job_id = entry.job.id
    with jobs.following(job_id):
        async for message in _followed(jobs, entry):
            yield message


async def _followed(jobs: VideoJobs, entry: JobEntry) -> AsyncIterator[bytes]:
    job_id, last, said = entry.job.id, None, time.monotonic()
    while True:
        job = entry.job
        seen = (job.state, job.step)
        if job.status in TERMINAL:
            yield final_message(job).encoded
            return
        if seen != last:
            data: dict[str, Any] = {"id": job_id, "state": job.state, "role": None}
            if job.total_steps:
                data.update(step=job.step, total_steps=job.total_steps)
            yield SSEMessage("step" if job.total_steps else "state", data).encoded
            last, said = seen, time.monotonic()
        elif time.monotonic() - said >= KEEPALIVE_S:
            yield KEEPALIVE
            said = time.monotonic()
        await asyncio.sleep(FOREIGN_POLL_S)
        try:
            entry = await jobs.latest(job_id)
        except APIError as exc:
            if exc.status_code >= 500:  # the store did not answer this time: the job goes on
                continue
            yield error_message(job_id, exc.message, exc.code, exc.status_code, exc.param).encoded
            return


def _forget(store: ResultStore, job_id: str) -> None:
    """Remove what was saved of a job that was not made, if the store lets it (best effort: a JSON left
    behind shows a queued job no head runs, until retention removes it)."""
    try:
        store.delete(job_id)
    except Exception as exc:
        log.warning("video job %s: its saved status could not be removed: %s", job_id, exc)
