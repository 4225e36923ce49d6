"""create_app: the FastAPI application over a backend."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig

from triptych import __version__
from triptych_head.api import files, images, system, videos
from triptych_head.api.access_log import AccessLog
from triptych_head.api.auth import APIKeyMiddleware
from triptych_head.api.context import HeadContext
from triptych_head.api.direct import DirectRoutes
from triptych_head.api.errors import install_error_handlers
from triptych_head.api.key_quotas import SYNC_S
from triptych_head.api.limits import BodyLimitMiddleware
from triptych_head.api.playground import install_playground, origin_of
from triptych_head.api.schemas import RequestModels
from triptych_head.api.video_jobs import VideoJobs
from triptych_head.results import JOB_LEASE_RENEW_S
from triptych_head.webhook_outbox import SCAN_S as OUTBOX_SCAN_S
from triptych_head.webhooks import Webhooks

log = logging.getLogger(__name__)

NO_FASTAPI_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
JOB_SAVE_GRACE_S = 5.0  # at shutdown, how long finished video jobs may take to write their files
QUOTA_STOP_SYNC_S = 5.0  # at shutdown, how long the last write of the key quotas' counts may take
WEBHOOK_GRACE_S = 5.0  # at shutdown, how long webhook deliveries under way may take (webhooks.py)


def create_app(ctx: HeadContext) -> FastAPI:
    on_end = ctx.webhooks.job_ended if ctx.webhooks is not None else None
    jobs = VideoJobs(
        ctx.results, lambda entry: videos.start_job(ctx, jobs, entry), ctx.registry, on_end, lambda: not ctx.draining
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(jobs.restore)
        await _sync_quotas_once(ctx)  # the other heads' counts are known before a request is admitted
        await ctx.backend.start()
        sweeper = asyncio.create_task(_apply_retention(ctx, jobs))
        leases = asyncio.create_task(_renew_leases(jobs))
        quotas = asyncio.create_task(_sync_quotas(ctx))
        adoptions = asyncio.create_task(_adopt_webhooks(ctx.webhooks)) if ctx.webhooks is not None else None
        try:
            yield
        finally:
            sweeper.cancel()
            leases.cancel()
            quotas.cancel()
            if adoptions is not None:
                adoptions.cancel()
            # What this head admitted since its last sync counts for the others; a store that does not
            # answer must not hold the head's exit past its grace period.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_sync_quotas_once(ctx, stopping=True), QUOTA_STOP_SYNC_S)
            await jobs.shutdown(JOB_SAVE_GRACE_S)
            if ctx.webhooks is not None:  # the ends of jobs this head's shutdown failed are sent too
                await ctx.webhooks.close(WEBHOOK_GRACE_S)
            await ctx.backend.close()

    # FastAPI's own OpenTelemetry (spans and metrics per HTTP request) stays off: the head's traces are
    # tracing.py's, and its check of the global providers would cost every request.
    app = FastAPI(title="Triptych", version=__version__, lifespan=lifespan, telemetry=NO_FASTAPI_TELEMETRY)
    app.state.ctx = ctx
    app.state.video_jobs = jobs
    install_error_handlers(app)
    models = RequestModels.build(ctx.contract)  # the request models of the contract this head serves
    # The last added runs first: the key is checked before a byte of the body is read, and the
    # generation endpoints' JSON bodies are served inside both, before FastAPI's own layers.
    app.add_middleware(DirectRoutes, routes={**images.direct_routes(models), **videos.direct_routes(models)})
    app.add_middleware(BodyLimitMiddleware, max_bytes=ctx.max_request_bytes)
    if ctx.api_keys is not None:
        app.add_middleware(APIKeyMiddleware, keys=ctx.api_keys)
    if ctx.access_log:  # outermost: it sees the answers of the key and body checks too
        app.add_middleware(AccessLog)
    app.include_router(images.image_routes(models))
    app.include_router(videos.video_routes(models))
    app.include_router(system.router)
    app.include_router(files.router)
    presigned_from = getattr(ctx.results.objects, "endpoint", None) if ctx.results.presign_s else None
    install_playground(app, origin_of(presigned_from))
    return app


async def _apply_retention(ctx: HeadContext, jobs: VideoJobs) -> None:
    """Remove results past --results-max-age / --results-max-bytes, at start and periodically."""
    while True:
        try:
            removed = await asyncio.to_thread(ctx.results.sweep, keep=set(jobs.running()))
            jobs.forget_removed(removed)
        except Exception:  # a full or read-only disk must not stop the head serving
            log.exception("applying result retention failed")
        await asyncio.sleep(ctx.results.retention.sweep_interval_s)


async def _sync_quotas(ctx: HeadContext) -> None:
    """Share the API keys' counts with the other heads every SYNC_S (key_quotas.py, key_sharing.py)."""
    while True:
        await asyncio.sleep(SYNC_S)
        try:
            await _sync_quotas_once(ctx)
        except Exception:  # the store's own errors are the ledger's to log; anything else must not end the task
            log.exception("syncing the API keys' quota counts failed")


async def _sync_quotas_once(ctx: HeadContext, stopping: bool = False) -> None:
    """One exchange of the API keys' counts with the other heads; `stopping`: this head's last, after
    which it holds no request in flight."""
    limits, keys = ctx.key_limits, ctx.api_keys
    if keys is None:
        return  # an open API counts no key
    for ledger, periods in ((limits.quotas, keys.quota_periods()), (limits.device_quotas, keys.device_quota_periods())):
        if ledger is not None and (periods or ledger.pending()):
            await asyncio.to_thread(ledger.sync, periods)
    rates = keys.rates()
    counts = limits.counts(rates)
    if limits.live is not None and (keys.shared_limits() or counts.any()):
        if stopping:
            counts.in_flight = {}
        limits.heard(await asyncio.to_thread(limits.live.exchange, counts), rates)


async def _adopt_webhooks(webhooks: Webhooks) -> None:
    """Deliver the webhook events of heads that died or stopped (webhook_outbox.py), from start-up on."""
    while True:
        try:
            await webhooks.adopt_orphans()
        except Exception:
            log.exception("looking for webhook events whose head stopped failed")
        await asyncio.sleep(OUTBOX_SCAN_S)


async def _renew_leases(jobs: VideoJobs) -> None:
    """Keep the jobs this head runs its own in the shared store (results.JOB_LEASE_S), and take over
    those whose heads died (from start-up on)."""
    while True:  # its own leases first: after a store outage, a head renews before it adopts others' jobs
        try:
            await jobs.renew_leases()
        except Exception:
            log.exception("renewing video job leases failed")
        try:
            await jobs.take_over_orphans()
        except Exception:
            log.exception("looking for video jobs whose head died failed")
        await asyncio.sleep(JOB_LEASE_RENEW_S)
