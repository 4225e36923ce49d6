"""A request's step cache on the denoiser: the diffusers hook attached for one request (or one batch
of the same mode) and removed after it, and what it skipped.

    cache = StepCaching(adapter)
    with cache.applied(batch.params):     # enable_cache(config) ... disable_cache(), in a finally
        adapter.denoise(batch)
    cache.stats()                         # per mode: requests, attention computations run and skipped

The config is the one a stock pipeline would be given (`pipe.transformer.enable_cache(config)`),
with `current_timestep_callback=lambda: pipe.current_timestep` where the hook needs one: the
adapters' loops set `pipe._current_timestep` as the stock loops do, so the hook sees the same
timesteps and the pixels are the stock pipeline's with that hook (tests/e2e/test_step_cache.py).

On a multi-device denoiser every rank attaches the same hook to its copy of the transformer. The
interval modes decide by the step alone, so the ranks skip the same computations; first_block
decides by how much the first block's output changed, which a sequence-parallel rank sees for its
shard of the tokens only: there `first_block_change` (parallel/apply.py) gives every rank the whole
sequence's figure, so they all skip, or all compute, the same steps. A CFG-parallel rank runs one
guidance branch, with the cache context the stock loop gives it, except for SHARED_BY_BRANCHES.

Skips are counted the same way for every mode, by what did not run: each attention module's query
projection counts its calls, and a transformer forward would have called each once. A skipped
block (first_block) counts its attentions, a reused or predicted attention (pyramid attention
broadcast, taylorseer) counts itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from triptych.params import GenerationParams
from triptych.protocol import StepCacheStats
from triptych.step_cache import StepCache

if TYPE_CHECKING:
    import torch

    from triptych_worker.adapters.base import FamilyAdapter

SHARED_BY_BRANCHES = ("pyramid_attention_broadcast",)
"""Modes whose diffusers hook keeps one state per module, not one per cache context: on one device a
step's guidance branches share it (the uncond pass may reuse the cond pass's attention), which
CFG-parallel ranks, one branch each, cannot reproduce (parallel/families.check_request)."""

ResidualChange = Callable[["torch.Tensor", "torch.Tensor"], float]
"""(this step's first-block residual, the last computed step's) -> their relative mean absolute difference."""


def hook_config(cache: StepCache, current_timestep: Any) -> Any:
    """The diffusers cache config of `cache` (a mode that is on), as a stock pipeline would be given it."""
    from diffusers.hooks import FirstBlockCacheConfig, PyramidAttentionBroadcastConfig, TaylorSeerCacheConfig

    if cache.mode == "first_block":
        return FirstBlockCacheConfig(threshold=cache.threshold)
    if cache.mode == "pyramid_attention_broadcast":
        return PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=cache.interval, current_timestep_callback=current_timestep
        )
    if cache.mode == "taylorseer":
        return TaylorSeerCacheConfig(cache_interval=cache.interval)
    raise ValueError(f"step_cache: unknown mode {cache.mode!r}")


class StepCaching:
    """The denoiser's step caches over its adapter's transformer, and their running counts."""

    def __init__(self, adapter: FamilyAdapter):
        self.adapter = adapter
        self._counts: dict[str, list[int]] = {}  # mode -> [requests, computed, skipped]
        self._lock = threading.Lock()  # heartbeats read the counts from another thread
        self.first_block_change: ResidualChange | None = None  # set on a multi-device denoiser's ranks

    @contextmanager
    def applied(self, params: GenerationParams) -> Iterator[None]:
        """The request's cache hook on the transformer while the block runs; nothing when it asks for none."""
        cache = params.resolved_step_cache
        if not cache.on:
            yield
            return
        pipe = self.adapter.pipe
        transformer = pipe.transformer
        config = hook_config(cache, lambda: pipe.current_timestep)
        counter = _AttentionCounter(transformer)
        transformer.enable_cache(config)
        try:
            if cache.mode == "first_block" and self.first_block_change is not None:
                _decide_first_block_by(transformer, self.first_block_change)
            yield
        finally:
            transformer.disable_cache()
            counter.remove()
            self._add(cache.mode, counter.computed, counter.expected - counter.computed)

    def _add(self, mode: str, computed: int, skipped: int) -> None:
        with self._lock:
            counts = self._counts.setdefault(mode, [0, 0, 0])
            counts[0] += 1
            counts[1] += computed
            counts[2] += skipped

    def stats(self) -> tuple[StepCacheStats, ...]:
        """Per mode used since the worker started: requests (batches), attention computations run and skipped."""
        with self._lock:
            return tuple(
                StepCacheStats(mode, requests, computed, skipped)
                for mode, (requests, computed, skipped) in sorted(self._counts.items())
            )


def _decide_first_block_by(transformer: Any, change: ResidualChange) -> None:
    """Make the first-block cache's head hook decide with `change` (what its own decision computes, the
    relative mean absolute difference of the first block's residuals, over every rank's tokens)."""
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    hooks = [
        hook
        for module in transformer.modules()
        for hook in getattr(getattr(module, "_diffusers_hook", None), "hooks", {}).values()
        if isinstance(hook, FBCHeadBlockHook)
    ]
    if len(hooks) != 1:
        raise RuntimeError(f"step_cache: first_block: found {len(hooks)} head-block hooks in the transformer, not 1")
    (hook,) = hooks

    def should_compute_remaining_blocks(residual: torch.Tensor) -> bool:
        previous = hook.state_manager.get_state().head_block_residual
        return previous is None or change(residual, previous) > hook.threshold

    hook._should_compute_remaining_blocks = should_compute_remaining_blocks


class _AttentionCounter:
    """Counts the transformer's forwards and its attention modules' query projections while attached."""

    def __init__(self, transformer: Any):
        from diffusers.models.attention import AttentionModuleMixin
        from diffusers.models.attention_processor import Attention

        self.forwards = 0
        self.computed = 0
        probes = [m.to_q for m in transformer.modules() if isinstance(m, Attention | AttentionModuleMixin)]
        self.attentions = len(probes)
        self._handles = [transformer.register_forward_pre_hook(self._forward)]
        self._handles += [probe.register_forward_pre_hook(self._attention) for probe in probes]

    def _forward(self, module: Any, args: Any) -> None:
        self.forwards += 1

    def _attention(self, module: Any, args: Any) -> None:
        self.computed += 1

    @property
    def expected(self) -> int:
        return self.forwards * self.attentions

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
