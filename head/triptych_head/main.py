"""Run the head (DiffusionServer + HTTP API), or the whole pipeline in one process (monolithic)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from triptych import startup
from triptych.config import ConfigError, ServeArgs
from triptych.families import ModelInfo, read_model_info, read_rules
from triptych.lora import LoraCatalog
from triptych.params import GenerationParams
from triptych_head import store_owner
from triptych_head.admission import MIN_QUEUED, AdmissionControl
from triptych_head.api.app import create_app
from triptych_head.api.auth import APIKeyError, APIKeys
from triptych_head.api.context import HeadContext
from triptych_head.backend import LocalBackend, LocalClient
from triptych_head.http_socket import bind_http
from triptych_head.metrics import HeadMetrics
from triptych_head.objects import StoreError, open_object_store
from triptych_head.results import Retention
from triptych_head.server import DiffusionServer
from triptych_head.shutdown import disaggregated_drain, in_process_drain, serve_http
from triptych_head.webhooks import WebhookConfigError, WebhookTarget

log = logging.getLogger(__name__)

READY_WITHOUT_WORKERS_S = 30.0  # a head whose workers have not all found it is ready after this all the same


def model_validator(model_path: str) -> Callable[[GenerationParams], None]:
    """The request contract's checks with the model's family limits, as the API runs them at its door
    (HeadContext.params_for), without loading weights; raises ParamError naming the field."""
    return read_rules(model_path).validate


def _retention(args: ServeArgs) -> Retention:
    return Retention(max_age_s=args.results_max_age, max_bytes=args.results_max_bytes)


def _results(args: ServeArgs) -> dict[str, Any] | None:
    """HeadContext fields for the result store the flags name, checked by writing to it. None (after
    saying why in one line, naming the flag) when it cannot be used: a head that could not keep a
    result must not start taking requests."""
    try:
        store = open_object_store(args.output_path, args.results_store, args.results_s3_endpoint)
        if pipeline := os.environ.get(store_owner.ENV):
            store_owner.claim_store(store, pipeline)
    except StoreError as exc:
        print(f"triptych: error: {exc}", file=sys.stderr)
        return None
    how = f"presigned URLs valid {args.results_presign}s" if args.results_presign else "served by the head"
    log.info("results in %s (%s)", store.description, how)
    return {
        "results_store": store,
        "results_presign_s": args.results_presign,
        "retention": _retention(args),
        "idempotency_wait_s": args.disagg_timeout,
    }


def _http_guards(args: ServeArgs) -> dict[str, Any] | None:
    """HeadContext fields from the HTTP flags: API keys, the body limit, the access log, the webhook. None (after
    saying why in one line) when the keys file or the webhook's secret cannot be used: the head must not start
    open, or unsigned, by mistake."""
    try:
        keys = APIKeys(args.api_keys_file) if args.api_keys_file else None
        webhook = None
        if args.webhook_url is not None and args.webhook_secret_file is not None:  # both or neither (config_checks)
            webhook = WebhookTarget.from_flags(args.webhook_url, args.webhook_secret_file)
    except (APIKeyError, WebhookConfigError) as exc:
        print(f"triptych: error: {exc}", file=sys.stderr)
        return None
    return {
        "api_keys": keys,
        "max_request_bytes": args.max_request_bytes,
        "request_timeout_s": args.disagg_timeout,
        "access_log": args.access_log,
        "webhook": webhook,
    }


def _readiness(server: DiffusionServer, loop: threading.Thread) -> Callable[[], bool]:
    """GET /ready of a disaggregated head: its loop runs and its workers have found it (a ready instance
    of every role), so a Service sends it requests only once it can dispatch them: a head that starts
    beside others (a rollout's surge head) waits for the workers' first heartbeats. After
    READY_WITHOUT_WORKERS_S it is ready regardless: a pipeline with a role at zero still takes (and
    queues) requests rather than refusing connections."""
    started = time.monotonic()

    def ready() -> bool:
        waited = time.monotonic() - started >= READY_WITHOUT_WORKERS_S
        return loop.is_alive() and (waited or server.registry.every_role_ready())

    return ready


def served_model(model: ModelInfo, encodes_images: bool) -> ModelInfo:
    """The model as this deployment serves it: without edits when no pool encodes reference images
    (/v1/models, the contract and the playground say so; an edit is a 400 at the door)."""
    if model.edits and not encodes_images:
        log.info("no pool encodes reference images (no --encoder-urls or --image-encoder-urls): edits are off")
        return dataclasses.replace(model, edits=False)
    return model


def run_head(args: ServeArgs, names: Sequence[str] = ()) -> int:
    guards = _http_guards(args)
    results = _results(args) if guards is not None else None
    if guards is None or results is None:
        return 2
    http = bind_http(args)  # before the DiffusionServer binds its ports: a taken --port stops it here
    model = read_model_info(args.model_path, names)  # its family's limits: the API checks requests with them
    metrics = HeadMetrics()
    server = DiffusionServer(args, metrics)
    model = served_model(model, server.core.encodes_images)
    loop = threading.Thread(target=server.run, name="diffusion-server", daemon=True)
    loop.start()
    ctx = HeadContext(
        backend=LocalClient(server.local),
        model=model,
        lora_catalog=LoraCatalog.from_flags(args.lora, args.lora_catalog),
        output_path=Path(args.output_path),
        registry=metrics.registry,
        health=lambda: {"mode": "disaggregated", "topology": server.topology, "workers": server.registry.snapshot()},
        pipeline_view=server.view,
        ready=_readiness(server, loop),
        alive=loop.is_alive,
        drain_seconds=args.disagg_drain_timeout,
        admission=server.admission,
        head_id=server.core.head_id,  # the id its workers know it by names its runs in the shared store too
        **guards,
        **results,
    )
    drain, hurry = disaggregated_drain(server, loop, ctx)
    try:
        serve_http(create_app(ctx), ctx, args, http, drain, hurry)
    finally:
        server.stop()
        loop.join(timeout=5)
    return 0


def _monolithic_queue(args: ServeArgs) -> int:
    return MIN_QUEUED if args.max_queued_requests is None else args.max_queued_requests


def run_monolithic(args: ServeArgs, names: Sequence[str] = ()) -> int:
    # The one place the head reaches into the worker package: monolithic mode runs the stages in-process.
    from triptych_worker.cpu_threads import fit_torch_threads
    from triptych_worker.pipeline import load_role_pipeline

    guards = _http_guards(args)
    results = _results(args) if guards is not None else None
    if guards is None or results is None:
        return 2
    model = read_model_info(args.model_path, names)
    catalog = LoraCatalog.from_flags(args.lora, args.lora_catalog)
    if (problem := catalog.check_sources("monolithic process")) is not None:  # before the model loads
        raise ConfigError(problem)
    http = bind_http(args)  # before the model loads too: a taken --port stops it in a second, not minutes
    fit_torch_threads()  # before the model loads: torch's CPU threads within the pod's CPU limit
    pipeline = load_role_pipeline(
        args.model_path,
        args.disagg_role,
        args.resolved_device,
        lora_catalog=catalog,
        lora_cache_bytes=args.lora_cache_bytes,
        dtype=args.compute_dtype(args.resolved_device),
    )
    startup.mark("loaded")
    metrics = HeadMetrics()

    def relay_step_cache() -> None:  # what a denoiser's heartbeats carry in disaggregated mode
        for stats in pipeline.step_cache.stats() if pipeline.step_cache is not None else ():
            for field, gauge in metrics.step_cache.items():
                gauge.labels(args.disagg_role.value, "local", stats.mode).set(getattr(stats, field))

    ctx = HeadContext(
        backend=LocalBackend(pipeline, after_request=relay_step_cache, aging_s=args.disagg_priority_aging),
        model=model,
        lora_catalog=catalog,
        output_path=Path(args.output_path),
        registry=metrics.registry,
        health=lambda: {"mode": "monolithic"},
        drain_seconds=args.disagg_drain_timeout,
        # One request at a time, and no work model to estimate deadlines with: a cap in requests by default.
        admission=AdmissionControl(_monolithic_queue(args), metrics, worker_slots=1),
        **guards,
        **results,
    )
    drain, hurry = in_process_drain(ctx)
    serve_http(create_app(ctx), ctx, args, http, drain, hurry)
    return 0
