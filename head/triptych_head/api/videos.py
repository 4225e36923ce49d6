"""/v1/videos: asynchronous video jobs with denoising-step progress and MP4 content.

GET /v1/videos/{id}/events streams a job's progress as Server-Sent Events (progress.py): its
states, every denoising step (a preview every `preview_every` steps), then `completed` (the job)
or `error`. A job that has ended answers at once: with its history and final event within a
minute of its end (progress.HISTORY_LINGER_S), with its final event after that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, StreamingResponse

from triptych.contract import VIDEOS
from triptych.params import GenerationParams
from triptych.protocol import RequestEvent
from triptych_head.api.context import HeadContext, new_request_id
from triptych_head.api.errors import APIError
from triptych_head.api.progress import HISTORY_LINGER_S, ProgressFeed, SSEMessage, error_message
from triptych_head.api.schemas import RequestBody, RequestModels, VideoJob
from triptych_head.media import frames_path, load_frames, png_zip, save_frames, write_mp4
from triptych_head.results import ResultStore
from triptych_head.state import RequestState

log = logging.getLogger(__name__)
router = APIRouter(tags=["videos"])  # all but POST /v1/videos, which video_routes adds

MAX_JOBS = 1000  # remembered jobs; the oldest finished ones are forgotten first
TERMINAL = ("completed", "failed", "cancelled")
RESTARTED = "the head restarted while this job was running; submit it again"
SHUT_DOWN = "the head shut down while this job was running; submit it again"


@dataclass
class JobEntry:
    job: VideoJob
    task: asyncio.Task[None] | None = None
    path: Path | None = None
    feed: ProgressFeed | None = None  # made for a running job, or when someone asks for a finished one's events

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


class VideoJobs:
    """The video jobs this head knows, each saved in the result store whenever its status changes."""

    def __init__(self, store: ResultStore | None = None) -> None:
        self._jobs: OrderedDict[str, JobEntry] = OrderedDict()
        self.store = store

    def restore(self) -> None:
        """Take back the saved jobs of a previous head; one that was running then has failed."""
        if self.store is None:
            return
        for job in self.store.load_jobs()[-MAX_JOBS:]:
            path = self.store.video_path(job.id)
            if job.status not in TERMINAL:
                job.status, job.state = "failed", RequestState.FAILED.value
                job.error = {"message": RESTARTED, "code": "head_restarted"}
                job.completed_at = job.completed_at or int(time.time())
                self.store.save_job(job)
            elif job.status == "completed" and not path.is_file():
                continue  # its content is gone (removed by hand): forget it
            self._jobs[job.id] = JobEntry(job, path=path if job.status == "completed" else None)

    def save(self, entry: JobEntry) -> None:
        if self.store is None:
            return
        try:
            self.store.save_job(entry.job)
        except OSError:  # a full or read-only volume: the job still runs, it just will not survive a restart
            log.exception("could not save video job %s", entry.job.id)

    def add(self, entry: JobEntry) -> None:
        if len(self._jobs) >= MAX_JOBS:
            finished = [k for k, e in self._jobs.items() if e.job.status in TERMINAL]
            if not finished:
                raise APIError(429, f"{MAX_JOBS} video jobs are in flight; retry later", code="too_many_jobs")
            self._jobs.pop(finished[0])
        self._jobs[entry.job.id] = entry
        self.save(entry)

    def get(self, job_id: str) -> JobEntry:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise APIError(404, f"no video job {job_id!r}", "video_id") from None

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
        """Let jobs finish saving for up to `grace_s`; any still running fails, saved as such."""
        tasks = [e.task for e in self._jobs.values() if e.task is not None and not e.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for entry in self._jobs.values():
            if entry.job.status in TERMINAL:
                continue
            if entry.task is not None:
                entry.task.cancel()
                await asyncio.gather(entry.task, return_exceptions=True)
            entry.job.status, entry.job.state = "failed", RequestState.FAILED.value
            entry.job.error = {"message": SHUT_DOWN, "code": "head_shut_down"}
            entry.job.completed_at = int(time.time())
            self.save(entry)


def _jobs(request: Request) -> VideoJobs:
    return request.app.state.video_jobs  # type: ignore[no-any-return]


def video_routes(models: RequestModels) -> APIRouter:
    """The video endpoints, POST /v1/videos taking the request model of the head's contract."""
    routes = APIRouter(tags=["videos"])

    async def create_video(body: RequestBody, request: Request) -> VideoJob:
        return await _create_video(body, request)

    create_video.__annotations__["body"] = models.videos  # FastAPI reads the body's model from the signature
    routes.post(VIDEOS, response_model=VideoJob)(create_video)
    routes.include_router(router)
    return routes


async def _create_video(body: RequestBody, request: Request) -> VideoJob:
    ctx: HeadContext = request.app.state.ctx
    ctx.refuse_if_draining()
    params = ctx.params_for(VIDEOS, body)
    values = body.model_dump()
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
    entry = JobEntry(job, feed=ProgressFeed(job.id, HISTORY_LINGER_S))
    ctx.admit(job.id)  # counted from now until the job ends: 429 here, never a job failed later
    try:
        _jobs(request).add(entry)
    except APIError:
        ctx.release(job.id)
        raise
    entry.task = asyncio.create_task(_run(ctx, _jobs(request), entry, params, values["preview_every"]))
    return job


async def _run(
    ctx: HeadContext, jobs: VideoJobs, entry: JobEntry, params: GenerationParams, preview_every: int
) -> None:
    job, feed = entry.job, entry.progress_feed()

    def on_event(event: RequestEvent) -> None:
        job.state = event.state
        if event.state not in (RequestState.PENDING, RequestState.ENCODER_WAITING):
            job.status = "in_progress"
        if event.total_steps:
            job.step, job.total_steps = event.step, event.total_steps
            job.progress = int(100 * event.step / event.total_steps)
        feed.on_event(event)

    try:
        output = await ctx.generate(params, job.id, on_event, preview_every)
        path = ctx.results.video_path(job.id)
        await asyncio.to_thread(write_mp4, output.pixels[0], path, job.fps)
        await asyncio.to_thread(save_frames, output.pixels[0], frames_path(path))
        entry.path = path
        job.status, job.state, job.progress = "completed", RequestState.DONE.value, 100
    except asyncio.CancelledError:
        job.status, job.state = "cancelled", RequestState.CANCELLED.value
    except APIError as exc:
        job.status = "cancelled" if exc.code == "cancelled" else "failed"
        job.state = (exc.code or "failed").upper()
        job.error = {"message": exc.message, "code": exc.code}
    except Exception as exc:
        log.exception("video job %s failed", job.id)
        job.status, job.error = "failed", {"message": f"{type(exc).__name__}: {exc}", "code": "internal_error"}
    finally:
        ctx.release(job.id)  # also when it was cancelled before generating started
        if job.status in TERMINAL:
            job.completed_at = int(time.time())
            jobs.save(entry)
            feed.publish(final_message(job))


@router.get("/v1/videos", response_model=list[VideoJob])
async def list_videos(request: Request) -> list[VideoJob]:
    return _jobs(request).all()


@router.get("/v1/videos/{video_id}", response_model=VideoJob)
async def get_video(video_id: str, request: Request) -> VideoJob:
    return _jobs(request).get(video_id).job


@router.get("/v1/videos/{video_id}/events", response_model=None)
async def video_events(video_id: str, request: Request) -> StreamingResponse:
    """The job's progress as Server-Sent Events, until it completes or fails."""
    return _jobs(request).get(video_id).progress_feed().response()


@router.get("/v1/videos/{video_id}/content", response_model=None)
async def get_video_content(
    video_id: str, request: Request, variant: Literal["video", "frames"] = "video"
) -> FileResponse | Response:
    """The MP4 (variant=video), or the exact decoded frames as a ZIP of PNGs (variant=frames)."""
    entry = _jobs(request).get(video_id)
    if entry.job.status != "completed" or entry.path is None:
        raise APIError(409, f"video {video_id} is {entry.job.status}; content is ready when status is completed")
    if variant == "frames":
        data = await asyncio.to_thread(png_zip, load_frames(frames_path(entry.path)))
        return Response(
            data,
            media_type="application/zip",
            headers={"Content-Disposition": f"attachment; filename={video_id}-frames.zip"},
        )
    return FileResponse(entry.path, media_type="video/mp4", filename=f"{video_id}.mp4")


@router.delete("/v1/videos/{video_id}", response_model=VideoJob)
async def delete_video(video_id: str, request: Request) -> VideoJob:
    """Cancel a running job; delete a finished one and its file."""
    jobs = _jobs(request)
    entry = jobs.get(video_id)
    if entry.job.status not in TERMINAL and entry.task is not None:
        entry.task.cancel()
        try:
            await entry.task
        except asyncio.CancelledError:
            pass
        return entry.job
    if entry.path is not None:
        entry.path.unlink(missing_ok=True)
        frames_path(entry.path).unlink(missing_ok=True)
    if jobs.store is not None:
        jobs.store.delete(video_id)
    jobs.remove(video_id)
    return entry.job
