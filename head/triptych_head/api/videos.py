"""/v1/videos: asynchronous video jobs with denoising-step progress and MP4 content.

GET /v1/videos/{id}/events streams a job's progress as Server-Sent Events (progress.py): its
states, every denoising step (a preview every `preview_every` steps), then `completed` (the job)
or `error`. A job that has ended answers at once: with its history and final event within a
minute of its end (progress.HISTORY_LINGER_S), with its final event after that.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel

from triptych.contract import VIDEOS
from triptych.params import GenerationParams
from triptych.priority import DEFAULT_LEVEL
from triptych.protocol import RequestEvent
from triptych_head.api.context import HeadContext, new_request_id
from triptych_head.api.deadlines import Deadline, with_estimate
from triptych_head.api.direct import DirectRoute
from triptych_head.api.errors import APIError
from triptych_head.api.files import object_response
from triptych_head.api.idempotent import answer_once, fingerprint, idempotency_key
from triptych_head.api.key_limits import key_limit
from triptych_head.api.progress import HISTORY_LINGER_S, ProgressFeed, SSEMessage, error_message, sse_response
from triptych_head.api.schemas import RequestBody, RequestModels, VideoJob
from triptych_head.media import MediaPool, load_frames, png_zip_chunks, save_frames, write_mp4
from triptych_head.objects import ObjectMissing
from triptych_head.results import JOB_LEASE_S, TERMINAL, ResultStore, StoredJob
from triptych_head.state import RequestState
from triptych_head.timeline import SERVER_TIMING

log = logging.getLogger(__name__)
router = APIRouter(tags=["videos"])  # all but POST /v1/videos, which video_routes adds

MAX_JOBS = 1000  # remembered jobs; the oldest finished ones are forgotten first
RESTARTED = "the head restarted while this job was running; submit it again"
JOB_ID = re.compile(r"video_[A-Za-z0-9_-]{1,64}")  # new_request_id("video") makes video_<32 hex>
FOREIGN_POLL_S = 1.0  # how often the events of a job another head runs re-read its status
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
    server_timing: str = ""  # where a completed run's time went (timeline.py), on the head that ran it

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
        return {"params": params, "preview_every": self.preview_every, "priority": self.priority}

    @property
    def running_here(self) -> bool:
        return self.made_here and self.job.status not in TERMINAL and not self.handed_over

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


Starter = Callable[["JobEntry"], None]


class VideoJobs:
    """The video jobs this head runs or has seen; every job's JSON in the result store, which all
    heads share, is the truth for a job this head does not run (its status as its head last wrote it).

    A job whose head died (its lease ran out) is taken over by the first head that notices (each
    looks every JOB_LEASE_RENEW_S, and whenever a client asks for it) and wins the job's next
    attempt (`videos/<id>.adopt-<n>`, created once): that head runs it again from the start, same
    parameters and seed, so the same pixels; `restarts` counts the take-overs."""

    def __init__(
        self, store: ResultStore | None = None, start: Starter | None = None, registry: CollectorRegistry | None = None
    ) -> None:
        self._jobs: OrderedDict[str, JobEntry] = OrderedDict()
        self.store = store
        self.start = start  # runs a job on this head (set by the app: it needs the backend)
        self._pending: set[asyncio.Future[None]] = set()  # background saves (save_soon)
        self.takeovers = Counter(
            "triptych_video_job_takeovers",
            "Video jobs this head took over from a head that died or shut down, and ran again from the start",
            registry=registry,
        )

    def restore(self) -> None:
        """Take back the saved jobs that ended. A running one stays its head's, or, when its head
        died, is taken over by take_over_orphans (the app runs it at start)."""
        if self.store is None:
            return
        for stored in self.store.load_stored_jobs()[-MAX_JOBS:]:
            job = stored.job
            if job.status not in TERMINAL:
                continue  # another head's (or an orphan's): read from the store whenever asked for
            elif job.status == "completed" and not self.store.has(self.store.video_name(job.id)):
                continue  # its content is gone (removed by hand): forget it
            self._jobs[job.id] = JobEntry(job)

    def _lease(self) -> float:
        return time.time() + JOB_LEASE_S

    def save(self, entry: JobEntry) -> None:
        """Save now (blocking): at shutdown."""
        if self.store is None:
            return
        try:
            self.store.save_job(entry.job, self._lease() if entry.running_here else None, entry.run_record())
        except Exception:  # a full or unreachable store: the job still runs, other heads just see it late
            log.exception("could not save video job %s", entry.job.id)

    async def save_async(self, entry: JobEntry) -> None:
        """Save the job as it is when its turn comes: the last save asked for is the last written."""
        if self.store is None:
            return
        async with entry.save_lock:
            job = entry.job.model_copy()
            lease = self._lease() if entry.running_here else None
            try:
                await asyncio.to_thread(self.store.save_job, job, lease, entry.run_record())
            except Exception:
                log.exception("could not save video job %s", job.id)

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
        if self.store is not None:
            await asyncio.to_thread(self.store.mark_running, entry.job.id)

    async def take_over_orphans(self) -> None:
        """Run again the jobs whose heads died (they are listed as running, their leases ran out)."""
        if self.store is None:
            return
        for job_id in await asyncio.to_thread(self.store.running_jobs):
            entry = self._jobs.get(job_id)
            if entry is not None and entry.running_here:
                continue
            stored = await asyncio.to_thread(self.store.load_job, job_id)
            if stored is not None and stored.orphaned(time.time()):
                await self.take_over(stored)

    async def take_over(self, stored: StoredJob) -> JobEntry | None:
        """Run an orphaned job here, if this head wins its next attempt: the entry. None when another
        head won it, or when it cannot run again (saved by a head that kept no parameters): then it
        is marked failed, as the stored job shows."""
        assert self.store is not None
        job, run = stored.job, stored.run
        if self.start is None or run is None:
            fail_orphan(job)
            await asyncio.to_thread(self.store.save_job, job)
            return None
        attempt = job.restarts + 1
        claim = f"{self.store.job_name(job.id).removesuffix('.json')}.adopt-{attempt}"
        if not await asyncio.to_thread(self.store.objects.create, claim, b"", "application/octet-stream"):
            return None  # another head takes it over: its next save shows it
        params = msgspec.json.decode(json.dumps(run["params"]), type=GenerationParams)
        job.restarts, job.step, job.progress, job.error = attempt, 0, 0, None
        job.status, job.state = "queued", RequestState.PENDING.value
        entry = JobEntry(job, made_here=True, params=params, preview_every=int(run.get("preview_every", 0)))
        entry.priority = int(run.get("priority", DEFAULT_LEVEL))  # a job saved before priorities: normal
        entry.feed = ProgressFeed(job.id, HISTORY_LINGER_S)
        self._jobs[job.id] = entry
        self._jobs.move_to_end(job.id)
        await self.save_async(entry)
        log.warning("video job %s lost its head: running it again here from the start (restart %d)", job.id, attempt)
        self.takeovers.inc()
        self.start(entry)
        return entry

    async def get(self, job_id: str) -> JobEntry:
        """The job, wherever it runs: the jobs this head runs from memory (the ones it ran too, once the
        store shows they were not removed), every other from the store."""
        entry = self._jobs.get(job_id)
        if entry is None and not JOB_ID.fullmatch(job_id):  # never one of ours: the store is not asked
            raise APIError(404, f"no video job {job_id[:200]!r}", "video_id")
        if (entry is not None and entry.running_here) or self.store is None:
            if entry is None:
                raise APIError(404, f"no video job {job_id!r}", "video_id")
            return entry
        try:
            stored = await asyncio.to_thread(self.store.load_job, job_id)
        except Exception as exc:  # the shared store did not answer: say so, not a bare 500
            log.warning("reading video job %s from the result store failed: %s", job_id, exc)
            raise APIError(
                503,
                f"the result store did not answer for video {job_id}; retry",
                code="store_unavailable",
                headers={"Retry-After": "1"},
            ) from None
        if stored is None:  # never made, or removed (by retention or DELETE on any head)
            self._jobs.pop(job_id, None)
            raise APIError(404, f"no video job {job_id!r}", "video_id")
        if entry is not None and entry.made_here:
            return entry  # this head ran it: its memory is ahead of the store until its last save lands
        if stored.orphaned(time.time()):  # its head died without saying so: this head may take it over
            adopted = await self.take_over(stored)
            if adopted is not None:
                return adopted
        if entry is None:
            entry = JobEntry(stored.job)
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

    def all(self) -> list[VideoJob]:
        return [e.job for e in self._jobs.values()]

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
            if entry.job.status in TERMINAL or entry.task is None:
                continue
            entry.handed_over = self.store is not None and entry.params is not None
            entry.task.cancel()
            await asyncio.gather(entry.task, return_exceptions=True)
            if not entry.handed_over:
                fail_orphan(entry.job, SHUT_DOWN, "head_shut_down")
                entry.job.completed_at = int(time.time())
            await self.save_async(entry)


async def foreign_events(jobs: VideoJobs, entry: JobEntry) -> AsyncIterator[bytes]:
    """The events of a job another head runs, as its saved status changes (state changes and, at each
    lease renewal, its step), until it ends."""
    job_id, last = entry.job.id, None
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
            last = seen
        await asyncio.sleep(FOREIGN_POLL_S)
        try:
            entry = await jobs.get(job_id)
        except APIError as exc:
            yield error_message(job_id, exc.message, exc.code, exc.status_code).encoded
            return


def _jobs(request: Request) -> VideoJobs:
    return request.app.state.video_jobs  # type: ignore[no-any-return]


def video_routes(models: RequestModels) -> APIRouter:
    """The video endpoints, POST /v1/videos taking the request model of the head's contract. Its
    JSON body is served by `direct_routes`, in front of FastAPI's router."""
    routes = APIRouter(tags=["videos"])

    async def declared_create_video(body: RequestBody, request: Request) -> BaseModel | Response:
        return await create_video(body, request)

    declared_create_video.__annotations__["body"] = models.videos  # FastAPI reads the body's model from here
    routes.post(VIDEOS, response_model=VideoJob, name="create_video")(declared_create_video)
    routes.include_router(router)
    return routes


def direct_routes(models: RequestModels) -> dict[tuple[str, str], DirectRoute]:
    return {("POST", VIDEOS): DirectRoute(models.videos, create_video)}


async def create_video(body: RequestBody, request: Request) -> BaseModel | Response:
    """A new job; with an Idempotency-Key, one job per key (a retry answers the job made first)."""
    ctx: HeadContext = request.app.state.ctx
    ctx.refuse_if_draining()
    values = body.model_dump()
    params = ctx.params_for(VIDEOS, values)
    deadline = ctx.deadline(request, values)
    level = ctx.priority(request, values)
    key = idempotency_key(request)
    made: list[VideoJob] = []  # the job this request made (none when the key's answer is replayed)

    async def new_job() -> VideoJob:
        made.append(await _new_job(ctx, params, values, request, deadline, level))
        return made[0]

    if key is None:
        answer: VideoJob | Response = await new_job()
    else:
        answer = await answer_once(ctx, request, key, fingerprint(VIDEOS, values), new_job)
    seconds = made[0].estimated_completion_seconds if made else None
    return with_estimate(answer, seconds)


async def _new_job(
    ctx: HeadContext,
    params: GenerationParams,
    values: dict[str, Any],
    request: Request,
    deadline: Deadline,
    level: int,
) -> VideoJob:
    job = VideoJob(
        id=new_request_id("video"),
        model=ctx.model.id,
        status="queued",
        created_at=int(time.time()),
        size=values["size"],
        num_frames=params.num_frames,
        fps=values["fps"],
        seed=params.seed,
        total_steps=params.num_inference_steps,
    )
    entry = JobEntry(job, feed=ProgressFeed(job.id, HISTORY_LINGER_S), made_here=True, params=params)
    entry.preview_every, entry.priority = values["preview_every"], level
    # counted from now until the job ends: 429 here, never later
    estimate = ctx.admit(job.id, params, deadline, key=key_limit(request))
    job.estimated_completion_seconds = None if estimate is None else round(estimate.seconds, 3)
    jobs = _jobs(request)
    try:
        await jobs.add(entry)
    except APIError:
        ctx.release(job.id)
        raise
    start_job(ctx, jobs, entry)
    return job


def start_job(ctx: HeadContext, jobs: VideoJobs, entry: JobEntry) -> None:
    """Run the job on this head: one it was given, or one it took over (counted in flight either way,
    without the admission bound for a take-over: it was accepted once already)."""
    assert entry.params is not None
    if entry.request_id not in ctx.active:
        ctx.admit(entry.request_id, entry.params, bounded=False)
    entry.task = asyncio.create_task(_run(ctx, jobs, entry, entry.params, entry.preview_every))


async def _run(
    ctx: HeadContext, jobs: VideoJobs, entry: JobEntry, params: GenerationParams, preview_every: int
) -> None:
    job, feed = entry.job, entry.progress_feed()

    def on_event(event: RequestEvent) -> None:
        before = (job.status, job.state)
        job.state = event.state
        if event.state not in (RequestState.PENDING, RequestState.ENCODER_WAITING):
            job.status = "in_progress"
        if event.total_steps:
            job.step, job.total_steps = event.step, event.total_steps
            job.progress = int(100 * event.step / event.total_steps)
        feed.on_event(event)
        if (job.status, job.state) != before:  # other heads answer for this job from the store
            jobs.save_soon(entry)

    try:
        output = await ctx.generate(params, entry.request_id, on_event, preview_every, entry.priority)
        await ctx.media.run(_store_content, ctx.results, job.id, output.pixels[0], job.fps, ctx.media.threads)
        entry.server_timing = output.server_timing
        job.status, job.state, job.progress = "completed", RequestState.DONE.value, 100
    except asyncio.CancelledError:
        if not entry.handed_over:  # a client's DELETE; a shutdown leaves the job to another head
            job.status, job.state = "cancelled", RequestState.CANCELLED.value
    except APIError as exc:
        if ctx.draining and exc.status_code == 503 and jobs.store is not None:  # cut short by this head's drain
            entry.handed_over = True
        else:
            job.status = "cancelled" if exc.code == "cancelled" else "failed"
            job.state = (exc.code or "failed").upper()
            job.error = {"message": exc.message, "code": exc.code}
    except Exception as exc:
        log.exception("video job %s failed", job.id)
        job.status, job.error = "failed", {"message": f"{type(exc).__name__}: {exc}", "code": "internal_error"}
    finally:
        ctx.release(entry.request_id)  # also when it was cancelled before generating started
        if job.status in TERMINAL:
            job.completed_at = int(time.time())
            await jobs.save_async(entry)  # after its content: a head that reads `completed` finds the files
            feed.publish(final_message(job))
        elif entry.handed_over:  # saved running without a lease: the next head to look runs it again
            log.warning("video job %s left to another head: this head shut down before it finished", job.id)
            await jobs.save_async(entry)


def _store_content(results: ResultStore, job_id: str, frames: Any, fps: int, threads: int) -> None:
    """The MP4 (libx264 on `threads` threads) and the exact frames, made in the store's staging folder
    and then stored whole (on the media pool: the encode is most of it)."""
    results.objects.staging.mkdir(parents=True, exist_ok=True)
    stem = results.objects.staging / f"{job_id}-{uuid.uuid4().hex}"
    mp4, npy = stem.with_suffix(".mp4"), stem.with_suffix(".npy")
    try:
        write_mp4(frames, mp4, fps, threads)
        save_frames(frames, npy)
        results.objects.put_file(results.video_name(job_id), mp4, "video/mp4")
        results.objects.put_file(results.frames_name(job_id), npy, "application/octet-stream")
    finally:
        mp4.unlink(missing_ok=True)
        npy.unlink(missing_ok=True)


@router.get("/v1/videos", response_model=list[VideoJob])
async def list_videos(request: Request) -> list[VideoJob]:
    return _jobs(request).all()


@router.get("/v1/videos/{video_id}", response_model=VideoJob)
async def get_video(video_id: str, request: Request, response: Response) -> VideoJob:
    """The job; a completed one, asked of the head that ran it, with its run's Server-Timing header."""
    entry = await _jobs(request).get(video_id)
    _add_server_timing(entry, response)
    return entry.job


def _add_server_timing(entry: JobEntry, response: Response) -> None:
    if entry.server_timing and entry.job.status == "completed":
        response.headers[SERVER_TIMING] = entry.server_timing


@router.get("/v1/videos/{video_id}/events", response_model=None)
async def video_events(video_id: str, request: Request) -> StreamingResponse:
    """The job's progress as Server-Sent Events, until it completes or fails."""
    jobs = _jobs(request)
    entry = await jobs.get(video_id)
    if not entry.made_here and entry.job.status not in TERMINAL:  # another head runs it: follow its saved status
        return sse_response(foreign_events(jobs, entry))
    return entry.progress_feed().response()


@router.get("/v1/videos/{video_id}/content", response_model=None)
async def get_video_content(video_id: str, request: Request, variant: Literal["video", "frames"] = "video") -> Response:
    """The MP4 (variant=video), or the exact decoded frames as a ZIP of PNGs (variant=frames)."""
    entry = await _jobs(request).get(video_id)
    if entry.job.status != "completed":
        raise APIError(409, f"video {video_id} is {entry.job.status}; content is ready when status is completed")
    ctx: HeadContext = request.app.state.ctx
    results = ctx.results
    answer: Response
    if variant == "frames":
        answer = await _frames_zip(results, ctx.media, video_id, entry.job.completed_at or entry.job.created_at)
    else:
        answer = await object_response(results, results.video_name(video_id), "video/mp4", f"{video_id}.mp4")
    _add_server_timing(entry, answer)
    return answer


async def _frames_zip(results: ResultStore, media: MediaPool, video_id: str, made_at: int) -> StreamingResponse:
    """The exact frames as a ZIP of PNGs dated `made_at`, streamed as each frame is encoded: the head
    holds one PNG at a time and the frames (mapped from a local file; read whole from a remote store)."""
    name = results.frames_name(video_id)
    path = results.objects.local_path(name)
    try:
        if path is not None:
            frames = await asyncio.to_thread(load_frames, path, True)
        else:
            raw = await asyncio.to_thread(results.objects.get_bytes, name)
            frames = await asyncio.to_thread(load_frames, io.BytesIO(raw))
            del raw
    except (ObjectMissing, FileNotFoundError):
        raise APIError(404, f"the frames of video {video_id} were removed") from None
    return StreamingResponse(
        media.iterate(png_zip_chunks(frames, made_at)),
        media_type="application/zip",
        headers={"Content-Disposition": f"attachment; filename={video_id}-frames.zip"},
    )


@router.delete("/v1/videos/{video_id}", response_model=VideoJob)
async def delete_video(video_id: str, request: Request) -> VideoJob:
    """Cancel a running job; delete a finished one and its files."""
    jobs = _jobs(request)
    entry = await jobs.get(video_id)
    if entry.job.status not in TERMINAL:
        if not entry.made_here or entry.task is None:
            raise APIError(
                409,
                f"video {video_id} runs on another head, which alone can cancel it: retry (the load balancer may "
                "pick that head) or wait for it to end",
            )
        entry.task.cancel()
        try:
            await entry.task
        except asyncio.CancelledError:
            pass
        return entry.job
    if jobs.store is not None:
        await asyncio.to_thread(jobs.store.delete, video_id)
    jobs.remove(video_id)
    return entry.job
