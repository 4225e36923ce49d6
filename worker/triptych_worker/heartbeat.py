"""What a worker tells each head in its heartbeats: who it is, its room (pool, slots, standing
receive slots), whether it drains, what it holds that routing prefers (cached prompts, step
caches, LoRA adapters), and its open descriptors against its limit (exported for alerting). The head
schedules on nothing else (docs/design.md, "Membership and discovery")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from triptych.open_files import open_files, open_files_limit
from triptych.protocol import EncoderCacheStats, Heartbeat, StepCacheStats

if TYPE_CHECKING:
    from triptych_worker.runtime import Worker

UNMAPPED = "?"  # a heartbeat's head_id before that endpoint's head is known: no head takes it as its own


def state(worker: Worker, endpoint: str = "", head_id: str = "") -> Heartbeat:
    """`worker`'s state for the head at `endpoint` (`head_id` there, "" when not known yet)."""
    instance = worker.heads.instance_for(head_id) or worker.instance
    if not worker.heads.single and not head_id:
        head_id = UNMAPPED  # no head dispatches to it before its ping has told which endpoint it is
    standing = list(worker._standing.values())
    return Heartbeat(
        instance=instance,
        role=worker.role.value,
        session=worker.transport.session_id,
        # A full-pipeline worker's token pool takes no transfer: it reports none.
        pool_bytes=0 if worker.full_pipeline else worker.pool.pool_bytes,
        free_bytes=0 if worker.full_pipeline else worker.pool.free_bytes,
        capacity=worker.args.worker_capacity * worker.args.batching_max_size,  # that many batches
        model=worker.args.model_path,
        model_fingerprint=worker.model_fingerprint,
        standing_bytes=worker.pool.reserved_bytes(standing),
        standing_slots=tuple((alloc.addr, alloc.nbytes) for alloc in standing),
        draining=worker.draining,
        head_id=head_id,
        max_batch=worker.args.batching_max_size,
        devices=worker.args.num_gpus,
        dtype=worker.dtype,
        full_pipeline=worker.full_pipeline,
        encoder_cache=_encoder_cache(worker),
        step_cache=_step_cache(worker),
        loras=_loras_held(worker),
        lora_load_s=_lora_load_seconds(worker),
        via=endpoint,
        others_busy=_busy_for_others(worker, head_id),
        held=len(worker._held_requests()),
        peak_held=worker._peak_held,
        open_files=open_files(),
        open_files_limit=open_files_limit(),
    )


def _busy_for_others(worker: Worker, head_id: str) -> int:
    """Slots held for heads other than `head_id` (0 for a worker serving one head)."""
    if worker.heads.single:
        return 0
    return sum(1 for r in worker._held_requests() if worker.heads.owner(r) != head_id)


def _encoder_cache(worker: Worker) -> EncoderCacheStats | None:
    cache = getattr(worker.pipeline, "encoder_cache", None)  # only model pipelines that encode prompts have one
    return None if cache is None else cache.stats()


def _step_cache(worker: Worker) -> tuple[StepCacheStats, ...]:
    caching = getattr(worker.pipeline, "step_cache", None)  # only model pipelines that denoise have one
    return () if caching is None else caching.stats()


def _loras_held(worker: Worker) -> tuple[str, ...]:
    loras = getattr(worker.pipeline, "loras", None)  # model pipelines that encode prompts or denoise hold adapters
    return () if loras is None else loras.held()


def _lora_load_seconds(worker: Worker) -> float:
    loras = getattr(worker.pipeline, "loras", None)
    return 0.0 if loras is None else loras.mean_load_seconds()
