"""How the HTTP API reaches the pipeline: the DiffusionServer in its process, or the stages in it (monolithic).

Both backends take a request id and GenerationParams, report events (state changes, denoising
progress) through a callback, and return the decoded pixels or raise GenerationFailed. A request's
priority level (triptych.priority) orders the DiffusionServer's queues, and monolithic mode's one
queue (local_queue.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from triptych.config import DEFAULT_PRIORITY_AGING_S
from triptych.params import GenerationParams
from triptych.priority import DEFAULT_LEVEL
from triptych.protocol import Cancel, RequestEvent, RequestResult, Submit, TensorSpec
from triptych.protocol.messages import HEAD_SHUT_DOWN
from triptych.protocol.tensors import PIXELS
from triptych.roles import Role
from triptych_head.api.errors import internal_error
from triptych_head.local_channel import ChannelClosed, LocalChannel
from triptych_head.local_queue import PriorityRunner
from triptych_head.state import REJECTED, RequestState
from triptych_head.timeline import DEVICE_SECONDS, server_timing

ProgressCallback = Callable[[int, int, bytes], None]  # (step, total steps, a preview PNG or b"")

log = logging.getLogger(__name__)

EventCallback = Callable[[RequestEvent], None]


@dataclass
class GenerationOutput:
    pixels: np.ndarray  # uint8 [num_outputs, frames, height, width, 3]
    timings: dict[str, float] = field(default_factory=dict)
    server_timing: str = ""  # where its time went (timeline.py), for the answer's Server-Timing header


class GenerationFailed(Exception):
    """A request that ended without its output; `code`: the error's code in the answer (default: the
    state it ended in, lower case)."""

    def __init__(self, message: str, status_code: int = 500, state: str = RequestState.FAILED, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.state = state
        self.code = code or state.lower()


class Backend(Protocol):
    async def start(self) -> None: ...
    async def generate(
        self,
        request_id: str,
        params: GenerationParams,
        on_event: EventCallback | None = None,
        preview_every: int = 0,
        priority: int = DEFAULT_LEVEL,
    ) -> GenerationOutput: ...
    async def cancel(self, request_id: str) -> None: ...
    async def close(self) -> None: ...


def pixels_from_frames(specs: list[dict[str, Any]], frames: list[Any]) -> np.ndarray:
    """The PIXELS tensor of a result, as numpy (the head needs no torch): a view on its
    frame (the message is the head's alone, and the view keeps it alive), not a copy."""
    for raw, frame in zip(specs, frames, strict=False):
        spec = TensorSpec.from_wire(raw)
        if spec.name != PIXELS:
            continue
        if spec.dtype != "uint8" or len(spec.shape) != 5 or spec.shape[-1] != 3:
            raise ValueError(f"pixels must be uint8 [N, F, H, W, 3], got {spec.dtype} {list(spec.shape)}")
        buf = memoryview(frame)
        if buf.nbytes != spec.nbytes:
            raise ValueError(f"pixels frame has {buf.nbytes} bytes, expected {spec.nbytes}")
        return np.frombuffer(buf, dtype=np.uint8).reshape(spec.shape)
    raise ValueError("result carries no pixels tensor")


class LocalClient:
    """The head's own API on its DiffusionServer's in-process channel (local_channel.py),
    multiplexing concurrent requests: typed messages each way, no socket and no encoding."""

    def __init__(self, channel: LocalChannel):
        self._channel = channel
        self._pending: dict[str, tuple[asyncio.Future[GenerationOutput], EventCallback | None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._channel.connect(self._from_server, self._server_stopped)

    async def generate(
        self,
        request_id: str,
        params: GenerationParams,
        on_event: EventCallback | None = None,
        preview_every: int = 0,
        priority: int = DEFAULT_LEVEL,
    ) -> GenerationOutput:
        assert self._loop is not None, "start() first"
        if request_id in self._pending:
            raise GenerationFailed(f"request id {request_id!r} is already active", 409, REJECTED)
        watch = on_event is not None
        submit = Submit(request_id, params, watch=watch, preview_every=preview_every, priority=priority)
        future: asyncio.Future[GenerationOutput] = self._loop.create_future()
        self._pending[request_id] = (future, on_event)
        try:
            try:
                self._channel.put(submit)
            except ChannelClosed as exc:
                raise GenerationFailed(f"{exc}; retry on another head", 503, code=HEAD_SHUT_DOWN) from None
            return await future
        except asyncio.CancelledError:
            await self.cancel(request_id)
            raise
        finally:
            self._pending.pop(request_id, None)

    async def cancel(self, request_id: str) -> None:
        try:
            self._channel.put(Cancel(request_id))
        except ChannelClosed:
            pass  # nothing runs any more

    def _from_server(self, msg: Any, frames: Sequence[Any]) -> None:
        """On the server's thread: the answer goes to this client's loop."""
        self._to_loop(self._answer, msg, frames)

    def _server_stopped(self) -> None:
        """On the server's thread, once its loop has ended: what it held is never answered."""
        self._to_loop(self._fail_pending)

    def _to_loop(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has closed: the API is gone, nobody waits for it
            pass

    def _fail_pending(self) -> None:
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(
                    GenerationFailed(
                        "the head's DiffusionServer stopped; retry on another head", 503, code=HEAD_SHUT_DOWN
                    )
                )

    def _answer(self, msg: Any, frames: Sequence[Any]) -> None:
        entry = self._pending.get(msg.request_id)
        if entry is None:
            return
        future, on_event = entry
        if future.done():
            return
        if isinstance(msg, RequestResult):
            try:
                pixels = pixels_from_frames(msg.tensors, list(frames))
                future.set_result(GenerationOutput(pixels, dict(msg.timings), msg.server_timing))
            except ValueError as exc:
                future.set_exception(GenerationFailed(f"bad result from the decoder: {exc}", 502))
        elif isinstance(msg, RequestEvent):
            if msg.error is not None:
                future.set_exception(GenerationFailed(msg.error, msg.status_code or 500, msg.state, msg.code or None))
            elif on_event is not None:
                on_event(msg)

    async def close(self) -> None:
        self._channel.connect(lambda msg, frames: None)  # answers after this are nobody's


class InProcessPipeline(Protocol):
    """The one interface monolithic mode needs from the worker package (triptych_worker.pipeline.RolePipeline)."""

    def validate(self, params: GenerationParams) -> None: ...
    def generate(self, params: GenerationParams, on_progress: ProgressCallback, preview_every: int = 0) -> np.ndarray:
        """Every stage of a request; the pixels as uint8 [num_outputs, frames, height, width, 3];
        `on_progress` after each denoising step, with a preview every `preview_every` steps."""
        ...


# Monolithic mode reports its denoising steps as the disaggregated denoiser does.
RUNNING = RequestState.DENOISING_RUNNING.value


class LocalBackend:
    """Monolithic mode: every stage in this process, one request at a time on the device."""

    def __init__(
        self,
        pipeline: InProcessPipeline,
        after_request: Callable[[], None] | None = None,
        aging_s: float = DEFAULT_PRIORITY_AGING_S,
    ):
        self._pipeline = pipeline
        self._after_request = after_request  # e.g. copy the pipeline's step cache counts to /metrics
        self._runner = PriorityRunner(aging_s)  # highest priority first, aged as the head's queues are
        # Requests submitted and not ended, and those of them cancelled (their next step stops them):
        # a cancel of one that ended is not kept for ever. The lock: the run's end is on the runner's thread.
        self._live: set[str] = set()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    async def start(self) -> None:
        pass

    async def generate(
        self,
        request_id: str,
        params: GenerationParams,
        on_event: EventCallback | None = None,
        preview_every: int = 0,
        priority: int = DEFAULT_LEVEL,
    ) -> GenerationOutput:
        loop = asyncio.get_running_loop()

        def progress(step: int, total: int, preview: bytes) -> None:
            if request_id in self._cancelled:
                raise GenerationFailed("cancelled by the client", 499, RequestState.CANCELLED)
            if on_event is not None:
                event = RequestEvent(request_id, RUNNING, step, total, preview=preview, role=Role.DENOISER.value)
                loop.call_soon_threadsafe(on_event, event)

        ran = [0.0]  # seconds the pipeline ran it (on its one device): its device-seconds

        def run() -> np.ndarray:
            began = time.perf_counter()
            try:
                if request_id in self._cancelled:  # while it waited its turn (a drain's end cancels every one)
                    raise GenerationFailed("cancelled by the client", 499, RequestState.CANCELLED)
                return self._stages(request_id, params, progress, preview_every if on_event else 0)
            finally:
                ran[0] = time.perf_counter() - began
                self._ended(request_id)
                if self._after_request is not None:
                    self._after_request()

        started = loop.time()
        with self._lock:
            self._live.add(request_id)
        queued = self._runner.submit(run, priority)
        try:
            pixels = await asyncio.wrap_future(queued)
        except asyncio.CancelledError:  # the client went away: never run it, or stop at its next step
            if queued.cancel():  # it never ran
                self._ended(request_id)
            else:  # it runs: progress raises at its next step
                await self.cancel(request_id)
            raise
        except GenerationFailed:
            raise
        except Exception:  # the head's own code around the stages (after_request, the queue): not the client's
            log.exception("request %s failed", request_id)
            raise GenerationFailed(internal_error(request_id), code="internal_error") from None
        total = loop.time() - started
        timings = {"total": total, DEVICE_SECONDS: ran[0]}
        return GenerationOutput(pixels=pixels, timings=timings, server_timing=server_timing({}, total))

    def _stages(self, request_id: str, params: GenerationParams, progress: ProgressCallback, every: int) -> np.ndarray:
        """The pipeline's stages, which fail as a worker's do (triptych_worker.compute._fails_alone): a
        ValueError (the request's reference, adapter, or a parameter the model cannot serve) is a 400,
        any other exception (the model's own failure: CUDA out of memory) a 500 that says it, type and
        text, as a worker's error does (docs/security.md), and the head's log has its traceback."""
        try:
            return self._pipeline.generate(params, progress, every)
        except GenerationFailed:  # cancelled at a step
            raise
        except ValueError as exc:
            raise GenerationFailed(str(exc), 400) from None
        except Exception as exc:
            log.exception("request %s failed", request_id)
            raise GenerationFailed(f"{type(exc).__name__}: {exc}") from None

    async def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._live:
                self._cancelled.add(request_id)

    def _ended(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)
            self._cancelled.discard(request_id)

    async def close(self) -> None:
        self._runner.shutdown()
