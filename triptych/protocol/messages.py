"""Every control message that crosses a socket, one frozen msgspec Struct each (codec.Message).

Three conversations:
- API client <-> head frontend (ROUTER at scheduler_port): Submit, Cancel / RequestEvent, RequestResult.
- head -> worker (worker's PULL at its --scheduler-port): Ping, Work, WorkBatch, TransferAlloc,
  TransferPush, TransferReady, CancelWork.
- worker -> head (head's PULL at scheduler_port + role offset): Heartbeat, Progress,
  TransferStaged, TransferAllocated, TransferRefused, WorkRefused, TransferPushed, Result, Failed.

A worker may serve several heads (replicated heads): it heartbeats to each, every head->worker
message names its head (`head_id`), and each request's messages go back to the head that sent it.

The transfer flow (docs/design.md, "Transfer flow"): the sender reports TransferStaged; the head picks a
receiver and sends TransferAlloc; the receiver answers TransferAllocated (or TransferRefused
when its pool is full, and the head retries when it has room); the head sends TransferPush to
the sender; the sender writes through Mooncake and reports TransferPushed; the head sends
TransferReady to the receiver, which loads the tensors and runs its stages.

Batching (--batching-mode dynamic): the head sends a group of compatible requests for the first
role as one WorkBatch, and tags each TransferReady of a group for a later role with `batch_id` and
`batch_size`, so the receiver runs the group as one batched forward once all of it has arrived.
Workers report the batch each request ran in (`batch_size`, `batch_leader`) with its output.

`instance` is the worker URL as the head knows it; workers echo it back so the head never has
to trust a worker's idea of its own address.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from triptych.params import GenerationParams
from triptych.protocol.codec import Message

__all__ = [
    "Submit", "Cancel", "RequestEvent", "RequestResult",
    "Ping", "Work", "WorkBatch", "TransferAlloc", "TransferPush", "TransferReady", "CancelWork",
    "Heartbeat", "EncoderCacheStats", "StepCacheStats", "Progress", "TransferStaged", "TransferAllocated",
    "TransferRefused", "WorkRefused", "HandOff", "BatchResized", "TransferPushed", "Result", "Failed",
    "HEAD_TO_WORKER",
]  # fmt: skip

# Checked by the decoder, so a handler never sees a negative size or address, a duration no clock
# measures (negative, NaN, infinite: the head's work estimate and Retry-After are built from them),
# or a status code that is not an HTTP error.
MAX_SECONDS = 7 * 24 * 3600.0
Count = Annotated[int, msgspec.Meta(ge=0)]
# A request's named priority level (triptych.priority: 0 low, 1 normal, 2 high).
Level = Annotated[int, msgspec.Meta(ge=0, le=2)]
# The level it is dispatched at, raised one step per --disagg-priority-aging waited (preemption.aged).
AgedLevel = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
HttpError = Annotated[int, msgspec.Meta(ge=400, le=599)]
# A denoising preview (PNG of the latents' low-resolution RGB projection, worker/triptych_worker/preview.py).
PREVIEW_MAX_BYTES = 1 << 20
PreviewPNG = Annotated[bytes, msgspec.Meta(max_length=PREVIEW_MAX_BYTES)]

# --- API client <-> head frontend ---------------------------------------------------------


class Submit(Message, tag="submit", frozen=True):
    """A new request. `watch`: also stream a RequestEvent for every state change and denoising step.

    Without it the client hears only how the request ends (RequestResult, or a RequestEvent
    carrying the error), which spares the head and the client a message per state change.
    `preview_every` k > 0 (with `watch`): every k-th step's event carries a preview image.
    """

    request_id: str
    params: GenerationParams
    watch: bool = False
    preview_every: Count = 0
    priority: Level = 1  # triptych.priority's level (0 low, 1 normal, 2 high), the API key's ceiling checked


class Cancel(Message, tag="cancel", frozen=True):
    request_id: str


# An error's code when the head stopped under the request (a drain that ran out, its loop ended):
# the client sends it again, under its Idempotency-Key, to another head (triptych.client).
HEAD_SHUT_DOWN = "head_shut_down"


class RequestEvent(Message, tag="event", frozen=True):
    """A state change or denoising progress of one request, streamed to the API client."""

    request_id: str
    state: str  # a RequestState's value (triptych_head.state), or REJECTED
    step: Count = 0
    total_steps: Count = 0
    error: str | None = None
    status_code: int = 0
    preview: PreviewPNG = b""  # a PNG of the current latents, every preview_every steps
    role: str = ""  # the role of the hop the request is at ("": before or after its hops)
    # "suspended": its denoising stopped at a step boundary for a higher-priority request (its state
    # kept in a denoiser's pool); "resumed": it runs again from that step ("": any other event)
    preemption: str = ""
    code: str = ""  # with an error: its code in the answer ("": the state's name); head_shut_down, say


class RequestResult(Message, tag="result", frozen=True):
    """Decoded pixels (uint8, [N, F, H, W, 3]) as raw frames described by `tensors`."""

    request_id: str
    tensors: list[dict[str, Any]]
    timings: dict[str, float]
    server_timing: str = ""  # where its time went, as the answer's Server-Timing header (triptych_head.timeline)


# --- head -> worker -----------------------------------------------------------------------


class Ping(Message, tag="ping", frozen=True):
    instance: str
    head_id: str = ""  # new for each head process; a worker drops all it held for the previous one
    # The head has seen this worker's draining heartbeat and dispatches nothing more to it; every
    # message it sent before this ping has already arrived (one connection keeps them in order).
    drain_acknowledged: bool = False
    # The endpoint this worker's heartbeats reach this head by (their `via`): a worker serving several
    # heads learns which head is where, and sends each request's messages to the head that owns it.
    via: str = ""


class Work(Message, tag="work", frozen=True):
    """Start a request on the first role of the pipeline (no incoming tensors)."""

    request_id: str
    instance: str
    params: GenerationParams
    progress: bool = False  # report every denoising step (someone watches the request)
    preview_every: Count = 0  # with progress: a preview PNG every k steps (0: none)
    head_id: str = ""  # the head that sends it (Ping.head_id): whose request this is, on a worker serving several
    traceparent: str = ""  # the request's trace (W3C Trace Context) when the head traces it (triptych.tracing)
    priority: AgedLevel = 1  # its effective level when dispatched: a worker runs its queued jobs highest first


class WorkBatch(Message, tag="work_batch", frozen=True):
    """Start a group of compatible requests (triptych.batching) on the first role, as one batch."""

    instance: str
    items: list[Work]
    head_id: str = ""  # the head that sends it (Ping.head_id): whose request this is, on a worker serving several


class TransferAlloc(Message, tag="transfer_alloc", frozen=True):
    request_id: str
    instance: str
    nbytes: Count
    standing: bool = False  # keep the slot after this transfer as a standing receive slot
    head_id: str = ""  # the head that sends it (Ping.head_id): whose request this is, on a worker serving several


class TransferPush(Message, tag="transfer_push", frozen=True):
    request_id: str
    instance: str
    dest_session: str
    dest_addr: Count
    head_id: str = ""  # the head that sends it (Ping.head_id): whose request this is, on a worker serving several
    # The receiver's slot at dest_addr holds this many bytes: a sender never writes more (0: not said).
    slot_bytes: Count = 0


class TransferReady(Message, tag="transfer_ready", frozen=True):
    """The tensors described by `manifest` sit in the receiver's slot; run the stages."""

    request_id: str
    instance: str
    params: GenerationParams
    manifest: list[dict[str, Any]]
    meta: dict[str, Any]
    slot_addr: Count = 0  # a standing slot the head assigned without transfer_alloc (0: the allocated one)
    progress: bool = False  # report every denoising step (someone watches the request)
    preview_every: Count = 0  # with progress: a preview PNG every k steps (0: none)
    # A group the head dispatched to this receiver together: run its members as one batch once
    # `batch_size` of them have arrived ("": not part of a group).
    batch_id: str = ""
    batch_size: Count = 1
    head_id: str = ""  # the head that sends it (Ping.head_id): whose request this is, on a worker serving several
    traceparent: str = ""  # as Work's
    # The input is the continuation this worker itself staged for the request (a suspended request
    # resuming where it stopped): nothing was written, no slot was reserved.
    in_place: bool = False
    priority: AgedLevel = 1  # as Work's
    # The request edits a reference image, which `params` no longer carries past the encoders: like
    # every edit (triptych.batching) it runs in no batch with others.
    edit: bool = False


class CancelWork(Message, tag="cancel_work", frozen=True):
    """Forget the request: drop queued work, staged buffers and reserved slots."""

    request_id: str
    instance: str
    head_id: str = ""  # the head that sends it (Ping.head_id): whose request this is, on a worker serving several


class HandOff(Message, tag="hand_off", frozen=True):
    """Stop the request's denoising at its next step boundary and stage its state for another
    denoiser (TransferStaged with `continues_at`; docs/design.md "Migration"). A worker that cannot
    (a request past its last step, a multi-rank denoiser) carries on as if never asked."""

    request_id: str
    instance: str
    head_id: str = ""


class BatchResized(Message, tag="batch_resized", frozen=True):
    """A group dispatched to this receiver lost a member (cancelled, failed, refused, retried) after
    another member's TransferReady had counted it in `batch_size`: its members that are queued here
    wait for `batch_size` of them now (1: none; they run as soon as they can)."""

    batch_id: str
    instance: str
    batch_size: Count
    head_id: str = ""


# What a worker acts on.
HEAD_TO_WORKER = (Ping, Work, WorkBatch, TransferAlloc, TransferPush, TransferReady, CancelWork, HandOff, BatchResized)

# --- worker -> head -----------------------------------------------------------------------


class EncoderCacheStats(msgspec.Struct, frozen=True):
    """A worker's prompt-embedding cache since it started (--encoder-cache-bytes), for the head's /metrics."""

    hits: Count = 0
    misses: Count = 0
    evictions: Count = 0
    bytes: Count = 0  # held now
    capacity_bytes: Count = 0


class StepCacheStats(msgspec.Struct, frozen=True):
    """A denoiser's requests with one step cache mode since it started (triptych/step_cache.py), for /metrics."""

    mode: str
    requests: Count = 0  # requests, or batches of them, the mode's hook was attached for
    computed: Count = 0  # attention computations the transformer ran with it
    skipped: Count = 0  # attention computations it skipped (reused or predicted)


class Heartbeat(Message, tag="heartbeat", frozen=True):
    instance: str
    role: str
    session: str
    pool_bytes: Count
    free_bytes: Count
    capacity: Count
    model: str
    standing_bytes: Count = 0  # pool bytes held as standing receive slots (not free, not leaked)
    draining: bool = False  # SIGTERM: it finishes what it holds and then exits; send it no new work
    # The head (Ping.head_id) this worker serves; a head ignores heartbeats naming another head, so it
    # dispatches nothing to a worker before that worker has dropped a previous head's work.
    head_id: str = ""
    full_pipeline: bool = False  # runs every stage and returns pixels (--disagg-full-pipeline)
    # Several heads: the endpoint this heartbeat was sent to (echoed in Ping.via), and the scheduling
    # slots it holds for the other heads (a head counts them as taken).
    via: str = ""
    others_busy: Count = 0
    model_fingerprint: str = ""  # its package's (ModelPackage.fingerprint): a head refuses another model's worker
    held: Count = 0  # requests holding one of its scheduling slots now, for every head
    peak_held: Count = 0  # the most it has held at once since it started (never above its capacity)
    encoder_cache: EncoderCacheStats | None = None  # None: this worker encodes no prompts
    step_cache: tuple[StepCacheStats, ...] = ()  # per step cache mode its denoising used
    loras: tuple[str, ...] = ()  # the LoRA adapters it holds loaded (the head routes denoising by them)
    lora_load_s: Seconds = 0.0  # the mean seconds its adapter loads took (0: none yet); the head's estimate
    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 1  # its --batching-max-size: the largest group it runs at once
    devices: Annotated[int, msgspec.Meta(ge=1)] = 1  # its --num-gpus: a request's device-seconds are stage x this
    dtype: str = ""  # what its model computes in (--dtype resolved); "" for a simulated worker
    # Its standing receive slots, (address, bytes) each: the head assigns the ones it does not know yet
    # (reserved at the worker's start-up) without a transfer_alloc.
    standing_slots: tuple[tuple[Count, Count], ...] = ()
    # Descriptors its process has open, and its soft limit (0: none, or not reported): Mooncake keeps
    # connections to departed peers (docs/transfer.md), which the head exports to alert on.
    open_files: Count = 0
    open_files_limit: Count = 0


class Progress(Message, tag="progress", frozen=True):
    request_id: str
    instance: str
    step: Count
    total: Count
    preview: PreviewPNG = b""  # a PNG of the current latents when this step is a preview step
    # The stage uses its inputs in place: its receive slot is busy until the stage's last report.
    inputs_held: bool = False


class TransferStaged(Message, tag="transfer_staged", frozen=True):
    """The sender finished its stages; `nbytes` of tensors wait in its transfer buffer."""

    request_id: str
    instance: str
    nbytes: Count
    manifest: list[dict[str, Any]]
    meta: dict[str, Any]
    seconds: Seconds
    batch_size: Count = 1  # how many requests ran in the same batched forward as this one
    batch_leader: bool = True  # the first of them: the head counts each batch once
    # A continuation: the denoising stopped before this step, and another denoiser runs the rest
    # (docs/design.md "Migration"); None: the role's finished outputs, for the next role.
    continues_at: Count | None = None


class TransferAllocated(Message, tag="transfer_allocated", frozen=True):
    request_id: str
    instance: str
    session: str
    addr: Count
    standing: bool = False  # the slot stays reserved as a standing slot for this receiver's later transfers


class TransferRefused(Message, tag="transfer_refused", frozen=True):
    """No room in the receive pool now (`fatal` False: retry later) or ever (`fatal` True)."""

    request_id: str
    instance: str
    reason: str
    fatal: bool


class WorkRefused(Message, tag="work_refused", frozen=True):
    """A worker serving several heads has no scheduling slot free for this Work, or an earlier run of the
    request that the head cancelled here is still stopping: the head gives it to another instance (or to
    this one after its next heartbeat)."""

    request_id: str
    instance: str
    reason: str


class TransferPushed(Message, tag="transfer_pushed", frozen=True):
    request_id: str
    instance: str
    nbytes: Count
    seconds: Seconds


class Result(Message, tag="worker_result", frozen=True):
    """Final pixels from the decoder, as raw frames described by `tensors`."""

    request_id: str
    instance: str
    tensors: list[dict[str, Any]]
    seconds: Seconds
    batch_size: Count = 1  # as TransferStaged's
    batch_leader: bool = True


class Failed(Message, tag="failed", frozen=True):
    request_id: str
    instance: str
    error: str
    status_code: HttpError = 500  # what the HTTP client should see: 413 for a payload no pool can take
    write_pending: bool = False  # a push gave up waiting, but Mooncake may still write into the receiver's slot
