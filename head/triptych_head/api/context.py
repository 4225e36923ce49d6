"""What every route needs: the backend, the model, where files go, and the request contract."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from fastapi import Request
from prometheus_client import CollectorRegistry, Counter

from triptych.config import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TIMEOUT_S
from triptych.contract import CONTRACT, VIDEOS, Contract, ParamError
from triptych.families import ModelInfo
from triptych.log_format import about
from triptych.lora import BadAdapter, LoraCatalog
from triptych.params import GenerationParams, params_from
from triptych.priority import DEFAULT_LEVEL
from triptych.priority import FIELD as PRIORITY_FIELD
from triptych.protocol.messages import HEAD_SHUT_DOWN
from triptych_head.admission import AdmissionControl, DeadlineUnachievable, Overloaded
from triptych_head.api.auth import APIKeys
from triptych_head.api.deadlines import FIELD as DEADLINE_FIELD
from triptych_head.api.deadlines import Deadline, requested_deadline
from triptych_head.api.errors import APIError
from triptych_head.api.key_limits import KeyLimit, KeyLimits
from triptych_head.api.key_quotas import DEVICE_TIME, QuotaLedger
from triptych_head.api.key_sharing import LiveCounts
from triptych_head.api.priorities import requested_priority
from triptych_head.api.reference import Reference
from triptych_head.api.schemas import parse_size
from triptych_head.backend import Backend, GenerationFailed
from triptych_head.deadline import Estimate
from triptych_head.idempotency import Idempotency
from triptych_head.media import MediaPool
from triptych_head.objects import DirectoryObjects, ObjectStore
from triptych_head.results import ResultStore, Retention
from triptych_head.state import RequestState
from triptych_head.timeline import DEVICE_SECONDS
from triptych_head.webhook_outbox import Outbox
from triptych_head.webhooks import Webhooks, WebhookTarget

Validator = Callable[[GenerationParams], None]
GENERATION_FIELDS = frozenset(GenerationParams.__struct_fields__)

RETRY_AFTER_S = 5  # what a client refused by a draining head waits before retrying (a new head takes over)


@dataclass
class HeadContext:
    backend: Backend
    model: ModelInfo
    output_path: Path
    registry: CollectorRegistry
    # The parameters requests may carry, their limits narrowed by `model`'s family: checked once, here.
    contract: Contract = CONTRACT
    # The LoRA adapters requests may name (--lora, --lora-catalog): checked here, loaded by the denoisers.
    lora_catalog: LoraCatalog = field(default_factory=LoraCatalog)
    # Checks beyond the contract's (none in `triptych serve`); raise ParamError naming the parameter.
    validate: Validator | None = None
    health: Callable[[], dict[str, Any]] = field(default=lambda: {})
    # The pools and the requests in flight, for the playground's pipeline view (GET /v1/pipeline).
    pipeline_view: Callable[[], dict[str, Any]] = field(default=lambda: {"roles": {}, "requests": []})
    ready: Callable[[], bool] = field(default=lambda: True)  # the backend can take requests (its loop runs)
    alive: Callable[[], bool] = field(default=lambda: True)  # the backend's loop still runs (liveness: /health)
    retention: Retention = field(default_factory=Retention)
    # Where results go (objects.py): None is a directory at output_path. Every head of a pipeline shares it.
    results_store: ObjectStore | None = None
    results_presign_s: int = 0  # > 0: content is handed out as presigned URLs of the store (S3), valid this long
    drain_seconds: float = DEFAULT_DRAIN_TIMEOUT_S
    started: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # SIGTERM: readiness fails and new requests are refused (shutdown.py)
    drain_expired: bool = False  # the drain time is over: what is still running is being cancelled
    active: set[str] = field(default_factory=set)  # request ids accepted and not answered yet
    # The HTTP requests for new work let in (before their admission: waiting on another run of their
    # Idempotency-Key, fetching a reference) and not answered yet: the drain waits for them too.
    at_door: set[asyncio.Task[Any]] = field(default_factory=set)
    owners: dict[str, str] = field(default_factory=dict)  # of those, each one's owner, with API keys (ownership.py)
    admission: AdmissionControl | None = None  # None: no bound on requests in flight
    api_keys: APIKeys | None = None  # None: the API is open (no --api-keys-file)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    access_log: bool = False  # --access-log: a line per HTTP request (access_log.py)
    webhook: WebhookTarget | None = None  # --webhook-url: where the ends of video jobs are POSTed (webhooks.py)
    # Names this head in what it writes to the shared store (whose run a key or a video job is).
    head_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # How long a request waits for another run of its Idempotency-Key before a 409: the request timeout.
    idempotency_wait_s: float = DEFAULT_TIMEOUT_S
    # A request's deadline when it gives none, and the latest it may give (--disagg-timeout).
    request_timeout_s: float = DEFAULT_TIMEOUT_S
    # The PNG, MP4 and ZIP encodes of answers: one thread per CPU this head may use (media.py).
    media: MediaPool = field(init=False)
    _endpoints: dict[str, Any] = field(default_factory=dict, init=False, repr=False)  # _taken_by's

    def __post_init__(self) -> None:
        self.media = MediaPool(registry=self.registry)
        objects = self.results_store or DirectoryObjects(self.output_path)
        self.results = ResultStore(objects, self.retention, self.results_presign_s)
        self.idempotency = Idempotency(objects, self.head_id)
        # Events wait in the store the heads share until delivered: another head sends a dead one's.
        outbox = Outbox(objects, self.head_id)
        self.webhooks = Webhooks(self.webhook, self.registry, outbox) if self.webhook is not None else None
        # A key's limits are the pipeline's: every head's counts meet in the store the heads share.
        quotas = QuotaLedger(objects, self.head_id, self.registry)
        device = QuotaLedger(objects, self.head_id, self.registry, meter=DEVICE_TIME, errors=quotas.sync_errors)
        live = LiveCounts(objects, self.head_id, quotas.sync_errors)
        self.key_limits = KeyLimits(self.registry, quotas=quotas, live=live, device_quotas=device)
        self.idempotent_replays = Counter(
            "triptych_idempotent_replays",
            "Requests answered with an earlier run's result of their Idempotency-Key",
            registry=self.registry,
        )

    def let_in(self) -> None:
        """A request for new work at the door: while this head drains it goes to another (503 with
        Retry-After); let in, it counts among those the drain waits for (`at_door`) until its HTTP
        exchange ends."""
        if self.draining:
            raise APIError(
                503,
                "this head is shutting down and takes no new requests; retry shortly",
                code="shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        task = asyncio.current_task()
        if task is not None and task not in self.at_door:
            self.at_door.add(task)
            task.add_done_callback(self.at_door.discard)

    def params_for(self, endpoint: str, values: dict[str, Any], reference: Reference | None = None) -> GenerationParams:
        """The request's GenerationParams from its body's values (the endpoint's model, dumped), with
        the model's defaults filled in, checked against the contract with the model family's limits:
        the one validation a request gets. APIError (400, naming the parameter) for a value the model
        cannot take."""
        if values["model"] is not None and values["model"] not in self.model.names:
            raise APIError(
                404,
                f"model {values['model'][:200]!r} is not served here; this deployment serves {self.model.id!r} "
                f"(also named {', '.join(repr(n) for n in self.model.names[1:]) or 'nothing else'})",
                "model",
            )
        if values["size"] is not None:
            width, height = parse_size(values["size"])
        elif reference is not None:
            width, height = reference.default_size(self.contract["size"].limits_for(self.model))
        else:
            raise APIError(400, "size: required", "size")
        if endpoint == VIDEOS and self.model.kind != "video":
            raise APIError(400, f"model {self.model.id!r} generates images; use POST /v1/images/generations", "model")
        passed, head_own = self._taken_by(endpoint)
        fields: dict[str, Any] = {
            "width": width,
            "height": height,
            "num_inference_steps": self.model.default_steps,
            "guidance_scale": self.model.default_guidance,
        }
        for name, to in passed:
            if values[name] is not None:
                fields[to] = values[name]
        if "seed" not in fields:  # drawn only when the request gives none (a system call per draw)
            fields["seed"] = secrets.randbelow(2**31)
        if reference is not None:
            fields.update(image=reference.data, image_url=reference.url)
        params = params_from(fields)
        own = {name: values[name] for name in head_own}
        try:
            self.contract.check({**own, **msgspec.structs.asdict(params)}, self.model)
            if params.loras:
                self.lora_catalog.check(params.loras)
            if self.validate is not None:
                self.validate(params)
        except (ParamError, BadAdapter) as exc:
            raise APIError(400, str(exc), exc.param) from None
        except ValueError as exc:  # a check beyond the contract that names no parameter
            raise APIError(400, str(exc)) from None
        return params

    def _taken_by(self, endpoint: str) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
        """What `endpoint` takes, worked out once: the parameters that set one GenerationParams field
        and reach the stages as they are (name, field), and those the head alone uses (fps, ...)."""
        taken = self._endpoints.get(endpoint)
        if taken is None:
            params = self.contract.taken_by(endpoint)
            passed = tuple((p.name, p.sets[0]) for p in params if len(p.sets) == 1 and p.sets[0] in GENERATION_FIELDS)
            taken = self._endpoints[endpoint] = (passed, tuple(p.name for p in params if p.fields == ()))
        return taken

    def admit(
        self,
        request_id: str,
        params: GenerationParams,
        deadline: Deadline | None = None,
        bounded: bool = True,
        key: KeyLimit | None = None,
        owner: str | None = None,
    ) -> Estimate | None:
        """Count a new request in flight, or refuse it with a 429 and Retry-After: when its API key has
        its `key` limit in flight or has used its requests per minute or its quota (key_limits.py), when it would
        miss its deadline (None: the request timeout), or when the pipeline is at
        --max-queued-requests (admission.py). Its estimated completion, None where there is none
        (monolithic mode). Call it right before generate(), or when a video job is created.
        `bounded=False`: count it whatever the load and its key's limits (a job accepted once already, by
        a head that died). `owner`: whose request it is (ownership.py), with API keys."""
        retry_after_s = self.admission.limit.retry_after_s if self.admission is not None else RETRY_AFTER_S
        if bounded:
            self.key_limits.admit(request_id, key, retry_after_s)
        else:
            self.key_limits.adopt(request_id, key)
        try:
            estimate = self._admit(request_id, params, deadline, bounded)
        except BaseException:
            self.key_limits.release(request_id)  # gives back the token it took
            raise
        self.key_limits.admitted(request_id)
        self.active.add(request_id)
        if owner is not None:
            self.owners[request_id] = owner
        self._count_in_flight()
        return estimate

    def _admit(
        self, request_id: str, params: GenerationParams, deadline: Deadline | None, bounded: bool
    ) -> Estimate | None:
        """The pipeline's admission (admission.py) of the request, its refusals as a 429 APIError."""
        estimate = None
        if self.admission is not None:
            deadline = deadline or Deadline(self.request_timeout_s, None)
            try:
                estimate = self.admission.admit(request_id, params, deadline.seconds, len(self.active), bounded)
            except Overloaded as exc:
                raise APIError(
                    429, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after_s)}
                ) from None
            except DeadlineUnachievable as exc:
                raise APIError(
                    429,
                    str(exc),
                    deadline.param,
                    code="deadline_unachievable",
                    headers={"Retry-After": str(exc.retry_after_s)},
                    details={
                        "estimate_seconds": round(exc.estimate.seconds, 3),
                        "deadline_seconds": deadline.seconds,
                        "wait_seconds": round(exc.estimate.wait_s, 3),
                        "work_seconds": round(exc.estimate.work_s, 3),
                    },
                ) from None
        return estimate

    def deadline(self, request: Request, values: dict[str, Any]) -> Deadline:
        """The request's deadline (deadlines.py): its body field or header, or the request timeout."""
        return requested_deadline(request, values.get(DEADLINE_FIELD), self.request_timeout_s)

    def priority(self, request: Request, values: dict[str, Any]) -> int:
        """The request's priority level (priorities.py): its body field within its API key's ceiling."""
        return requested_priority(request, values.get(PRIORITY_FIELD))

    def release(self, request_id: str) -> None:
        """The request was answered (or its job ended): it no longer counts against the bound."""
        self.active.discard(request_id)
        self.owners.pop(request_id, None)
        self.key_limits.release(request_id)
        if self.admission is not None:
            self.admission.release(request_id)
        self._count_in_flight()

    def _count_in_flight(self) -> None:
        if self.admission is not None:
            self.admission.count(len(self.active))

    def admission_health(self) -> dict[str, Any]:
        """For /health: the bound and the current load."""
        if self.admission is None:
            return {"in_flight": len(self.active), "max_in_flight": None}
        return self.admission.snapshot(len(self.active))

    async def generate(
        self,
        params: GenerationParams,
        request_id: str | None = None,
        on_event: Any = None,
        preview_every: int = 0,
        priority: int = DEFAULT_LEVEL,
    ) -> Any:
        request_id = request_id or new_request_id()
        if request_id not in self.active:
            self.admit(request_id, params)
        try:
            output = await self.backend.generate(
                request_id, params, on_event, preview_every=preview_every, priority=priority
            )
            self.key_limits.charge(request_id, output.timings.get(DEVICE_SECONDS, 0.0))
            return output
        except GenerationFailed as exc:
            if self.drain_expired and exc.state == RequestState.CANCELLED:  # the shutdown cancelled it, not the client
                raise APIError(
                    503,
                    f"the head shut down before this request finished (it had {self.drain_seconds:g}s to drain, "
                    "--disagg-drain-timeout); retry it",
                    code=HEAD_SHUT_DOWN,
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None
            status = exc.status_code if exc.status_code >= 400 else 500
            headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 and self.draining else None
            param = refused_field(str(exc)) if status == 400 else None
            raise APIError(status, str(exc), param=param, code=exc.code, headers=headers) from None
        finally:
            self.release(request_id)


def refused_field(message: str) -> str | None:
    """The request field a worker's refusal names, as its message leads with it after the worker's
    own prefix ("denoiser tcp://...: loras: adapter 'x' ..." -> "loras"; "size/num_frames: ..." -> "size")."""
    for part in message.split(": ")[:3]:
        name = part.split("/", 1)[0]
        if name in FIELDS:
            return name
    return None


FIELDS = frozenset(p.name for p in CONTRACT)


REQUEST_ID_HEADER = "X-Request-Id"  # an image answer's: the id the head's logs and traces know the request by


@contextlib.contextmanager
def errors_named(request_id: str) -> Iterator[None]:
    """An APIError raised inside answers with the request's id (X-Request-Id): the head logs a
    failure under it; so is every line logged inside (log_format.about)."""
    try:
        with about(request_id):
            yield
    except APIError as exc:
        exc.headers = {**(exc.headers or {}), REQUEST_ID_HEADER: request_id}
        raise


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
