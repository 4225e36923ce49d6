"""/v1/videos: asynchronous video jobs with denoising-step progress and MP4 content.

GET /v1/videos/{id}/events streams a job's progress as Server-Sent Events (progress.py): its
states, every denoising step (a preview every `preview_every` steps), then `completed` (the job)
or `error`. A job that has ended answers at once: with its history and final event within a
minute of its end (progress.HISTORY_LINGER_S), with its final event after that.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from triptych.contract import VIDEOS, ParamError
from triptych.log_format import about
from triptych.params import GenerationParams
from triptych.protocol import RequestEvent
from triptych_head.api.context import REQUEST_ID_HEADER, HeadContext, new_request_id
from triptych_head.api.deadlines import Deadline, with_estimate
from triptych_head.api.direct import DirectRoute
from triptych_head.api.errors import APIError, internal_error
from triptych_head.api.files import object_response
from triptych_head.api.forms import read_form
from triptych_head.api.idempotent import answer_once, fingerprint, idempotency_key
from triptych_head.api.key_limits import key_limit
from triptych_head.api.ownership import owner_of
from triptych_head.api.progress import HISTORY_LINGER_S, ProgressFeed, sse_response
from triptych_head.api.schemas import DeletedVideo, RequestBody, RequestModels, VideoJob, VideoList
from triptych_head.api.store_calls import from_store
from triptych_head.api.video_jobs import JobEntry, VideoJobs, final_message, foreign_events
from triptych_head.api.video_length import with_frames
from triptych_head.api.video_list import DEFAULT_LIMIT, MAX_LIMIT, Order, page
from triptych_head.media import ImageFormat, MediaPool, load_frames, png_zip_chunks, save_frames, write_mp4
from triptych_head.objects import ObjectMissing
from triptych_head.results import TERMINAL, ResultStore
from triptych_head.state import RequestState
from triptych_head.timeline import SERVER_TIMING

log = logging.getLogger(__name__)
THUMBNAIL = ImageFormat("webp", quality=80)  # a video's first frame, as OpenAI's thumbnail variant is
router = APIRouter(tags=["videos"])  # all but POST /v1/videos, which video_routes adds


def _jobs(request: Request) -> VideoJobs:
    return request.app.state.video_jobs  # type: ignore[no-any-return]


def video_routes(models: RequestModels) -> APIRouter:
    """The video endpoints, POST /v1/videos taking the request model of the head's contract. Its
    JSON body is served by `direct_routes`, in front of FastAPI's router."""
    routes = APIRouter(tags=["videos"])

    async def declared_create_video(body: RequestBody, request: Request) -> BaseModel | Response:
        return await create_video(body, request)

    declared_create_video.__annotations__["body"] = models.videos  # FastAPI reads the body's model from here
    # The same fields as a form (OpenAI's SDK posts one), read in front of FastAPI's router (direct_routes).
    form = {"schema": {"$ref": f"#/components/schemas/{models.videos.__name__}"}}
    routes.post(
        VIDEOS,
        response_model=VideoJob,
        name="create_video",
        openapi_extra={"requestBody": {"content": {"multipart/form-data": form}}},
    )(declared_create_video)
    routes.include_router(router)
    return routes


def direct_routes(models: RequestModels) -> dict[tuple[str, str], DirectRoute]:
    async def video_form(request: Request) -> RequestBody:
        return (await read_form(request, models.videos)).body

    return {("POST", VIDEOS): DirectRoute(models.videos, create_video, form=video_form)}


async def create_video(body: RequestBody, request: Request) -> BaseModel | Response:
    """A new job; with an Idempotency-Key, one job per key (a retry answers the job made first)."""
    ctx: HeadContext = request.app.state.ctx
    ctx.let_in()
    try:
        values = with_frames(body.model_dump(), body.model_fields_set, ctx.model)
    except ParamError as exc:
        raise APIError(400, str(exc), exc.param) from None
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
    if not made:  # the key's job, made by an earlier request: replayed as it was answered
        return answer
    # The job's id is its request's: the head's log lines about it and the access log name it so.
    return with_estimate(answer, made[0].estimated_completion_seconds, {REQUEST_ID_HEADER: made[0].id})


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
    limit = key_limit(request)
    entry.key_id = limit.key_id if limit is not None else None
    entry.owner = owner_of(request)
    # counted from now until the job ends: 429 here, never later
    estimate = ctx.admit(job.id, params, deadline, key=limit, owner=entry.owner)
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
    without the admission bound or its key's limits for a take-over: it was accepted once already; its
    key, if it still has limits, is charged the run's device-seconds)."""
    assert entry.params is not None
    if entry.request_id not in ctx.active:
        key = ctx.api_keys.limit_of(entry.key_id) if ctx.api_keys is not None and entry.key_id else None
        ctx.admit(entry.request_id, entry.params, bounded=False, key=key, owner=entry.owner)
    entry.task = asyncio.create_task(_run(ctx, jobs, entry, entry.params, entry.preview_every))


async def _run(
    ctx: HeadContext, jobs: VideoJobs, entry: JobEntry, params: GenerationParams, preview_every: int
) -> None:
    with about(entry.request_id):  # every line the run logs names the job
        await _run_job(ctx, jobs, entry, params, preview_every)


async def _run_job(
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
    except ContentNotStored as exc:  # the store's words (a host, a path) are the log's, not the client's
        cause = exc.__cause__
        log.warning("video job %s failed storing %s: %s: %s", job.id, exc.what, type(cause).__name__, cause)
        job.status, job.state = "failed", RequestState.FAILED.value
        job.error = {"message": exc.message, "code": "store_unavailable"}
    except Exception:
        log.exception("video job %s failed", job.id)
        job.status, job.state = "failed", RequestState.FAILED.value
        job.error = {"message": internal_error(job.id), "code": "internal_error"}
    finally:
        await _end_run(ctx, jobs, entry)


async def _end_run(ctx: HeadContext, jobs: VideoJobs, entry: JobEntry) -> None:
    """A run of the job ended on this head: its request is no longer counted in flight, and an ended job
    is saved and told (its events, on_end); one handed over is saved for the next head to run."""
    job = entry.job
    ctx.release(entry.request_id)  # also when it was cancelled before generating started
    if entry.taken:  # another head runs it now (this head's lease had lapsed): its end is that head's to tell
        return
    if job.status in TERMINAL:
        job.completed_at = int(time.time())
        await jobs.save_async(entry)  # after its content: a head that reads `completed` finds the files
        if entry.taken:  # found out by that save
            return
        entry.progress_feed().publish(final_message(job))
        jobs.ended(job)
    elif entry.handed_over:  # saved running without a lease: the next head to look runs it again
        log.warning("video job %s left to another head: this head shut down before it finished", job.id)
        await jobs.save_async(entry)
        entry.close_feed()  # its followers reconnect, to a head that follows it through the store


class ContentNotStored(Exception):
    """The result store failed while a job's content was saved: its staging folder could not be written
    (a full disk), or the store did not take an object (an S3 error, an endpoint that does not answer).
    The cause (`__cause__`) is logged; the job's error says what was being stored and to retry."""

    def __init__(self, job_id: str, what: str) -> None:
        self.what = what
        self.message = (
            f"the result store did not answer storing {what} of video {job_id}; "
            "retry: create the video job again (POST /v1/videos)"
        )
        super().__init__(self.message)


def _store_content(results: ResultStore, job_id: str, frames: Any, fps: int, threads: int) -> None:
    """The MP4 (libx264 on `threads` threads), the exact frames and the first frame's thumbnail, made in
    the store's staging folder and then stored whole (on the media pool: the encode is most of it).
    A failure of the store: ContentNotStored; anything else (the encoder's own error) as it is."""
    stem = results.objects.staging / f"{job_id}-{uuid.uuid4().hex}"
    mp4, npy = stem.with_suffix(".mp4"), stem.with_suffix(".npy")
    try:
        try:  # the staging folder is the store's: a disk that is full or gone is the store failing
            results.objects.staging.mkdir(parents=True, exist_ok=True)
            write_mp4(frames, mp4, fps, threads)
            save_frames(frames, npy)
        except OSError as exc:
            raise ContentNotStored(job_id, "the MP4 and frames") from exc
        put = results.objects
        _stored(job_id, "the MP4", put.put_file, results.video_name(job_id), mp4, "video/mp4")
        _stored(job_id, "the frames", put.put_file, results.frames_name(job_id), npy, "application/octet-stream")
        thumbnail = THUMBNAIL.encode(frames[0])
        _stored(job_id, "the thumbnail", put.put_bytes, results.thumbnail_name(job_id), thumbnail, THUMBNAIL.media_type)
    finally:
        mp4.unlink(missing_ok=True)
        npy.unlink(missing_ok=True)


def _stored(job_id: str, what: str, call: Callable[..., None], *args: Any) -> None:
    """`call(*args)`, a put into the result store: its failure a ContentNotStored naming `what`."""
    try:
        call(*args)
    except Exception as exc:
        raise ContentNotStored(job_id, what) from exc


@router.get("/v1/videos", response_model=VideoList)
async def list_videos(
    request: Request,
    limit: int = Query(DEFAULT_LIMIT, ge=0, le=MAX_LIMIT, description="How many jobs to answer"),
    after: str | None = Query(None, description="The `last_id` of the page before: the jobs after that one"),
    order: Order = Query("desc", description="By creation: `desc` (newest first) or `asc`"),
) -> VideoList:
    """A page of the video jobs the caller sees, every head's (video_list.py)."""
    return page(await _jobs(request).listed(owner_of(request)), after, limit, order)


@router.get("/v1/videos/{video_id}", response_model=VideoJob)
async def get_video(video_id: str, request: Request, response: Response) -> VideoJob:
    """The job; a completed one, asked of the head that ran it, with its run's Server-Timing header."""
    entry = await _jobs(request).get(video_id, owner_of(request))
    _add_server_timing(entry, response)
    return entry.job


def _add_server_timing(entry: JobEntry, response: Response) -> None:
    if entry.server_timing and entry.job.status == "completed":
        response.headers[SERVER_TIMING] = entry.server_timing


@router.get("/v1/videos/{video_id}/events", response_model=None)
async def video_events(video_id: str, request: Request) -> StreamingResponse:
    """The job's progress as Server-Sent Events, until it completes or fails."""
    jobs = _jobs(request)
    entry = await jobs.get(video_id, owner_of(request))
    if not entry.running_here and entry.job.status not in TERMINAL:  # another head runs it: follow its saved status
        return sse_response(foreign_events(jobs, entry))
    return entry.progress_feed().response()


@router.get("/v1/videos/{video_id}/content", response_model=None)
async def get_video_content(
    video_id: str, request: Request, variant: Literal["video", "frames", "thumbnail"] = "video"
) -> Response:
    """The MP4 (variant=video), the exact decoded frames as a ZIP of PNGs (variant=frames), or the first
    frame as a WebP image (variant=thumbnail, as OpenAI's API names it)."""
    entry = await _jobs(request).get(video_id, owner_of(request))
    if entry.job.status != "completed":
        raise APIError(409, f"video {video_id} is {entry.job.status}; content is ready when status is completed")
    ctx: HeadContext = request.app.state.ctx
    results = ctx.results
    answer: Response
    if variant == "frames":
        answer = await _frames_zip(results, ctx.media, video_id, entry.job.completed_at or entry.job.created_at)
    elif variant == "thumbnail":
        answer = await object_response(
            results, results.thumbnail_name(video_id), THUMBNAIL.media_type, f"{video_id}{THUMBNAIL.suffix}"
        )
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
            frames = await from_store(f"for the frames of video {video_id}", load_frames, path, True)
        else:
            raw = await from_store(f"for the frames of video {video_id}", results.objects.get_bytes, name)
            frames = await asyncio.to_thread(load_frames, io.BytesIO(raw))
            del raw
    except (ObjectMissing, FileNotFoundError):
        raise APIError(404, f"the frames of video {video_id} were removed") from None
    return StreamingResponse(
        media.iterate(png_zip_chunks(frames, made_at)),
        media_type="application/zip",
        headers={"Content-Disposition": f"attachment; filename={video_id}-frames.zip"},
    )


@router.delete("/v1/videos/{video_id}", response_model=DeletedVideo)
async def delete_video(video_id: str, request: Request) -> DeletedVideo:
    """Cancel a running job; delete a finished one and its files."""
    jobs = _jobs(request)
    entry = await jobs.get(video_id, owner_of(request))
    if entry.job.status not in TERMINAL:
        if not entry.running_here or entry.task is None:  # another head's, or handed over to one at a drain
            raise APIError(
                409,
                f"video {video_id} runs on another head, which alone can cancel it: retry (the load balancer may "
                "pick that head) or wait for it to end",
                headers={"Retry-After": "1"},  # a client that retries on it (triptych's does) gets another head
            )
        entry.task.cancel()
        try:
            await entry.task
        except asyncio.CancelledError:
            pass
        if entry.job.status not in TERMINAL:  # cancelled before its run began (a job just taken over), so
            # the run never got to end itself: ended here, or it would show queued for ever
            entry.job.status, entry.job.state = "cancelled", RequestState.CANCELLED.value
            await _end_run(request.app.state.ctx, jobs, entry)
        return DeletedVideo(**entry.job.model_dump(), deleted=False)
    if jobs.store is not None:
        async with entry.save_lock:  # the run's last save, if still under way, lands first: never after
            await from_store(f"deleting video {video_id}", jobs.store.delete, video_id)
    jobs.remove(video_id)
    return DeletedVideo(**entry.job.model_dump(), deleted=True)
