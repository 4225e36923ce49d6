"""The prompt-embedding cache (--encoder-cache-bytes): a repeated prompt skips the text encoders
(counted by forward hooks on the real tiny models' encoders) and yields the same tensors and
pixels; what it holds never changes after it is stored and never exceeds its byte bound."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_worker.encoder_cache import EncoderCache, embeddings_bytes
from triptych_worker.pipeline import RolePipeline, load_role_pipeline
from triptych_worker.stages import PIXELS, StageBatch

FLUX = GenerationParams("a cat on a red chair", width=32, height=32, num_inference_steps=2, seed=5,
                        max_sequence_length=16)  # fmt: skip
WAN = GenerationParams("a dog on the beach", width=32, height=32, num_frames=5, num_inference_steps=2,
                       guidance_scale=4.0, negative_prompt="blurry", seed=5, max_sequence_length=16)  # fmt: skip
MIB = 1 << 20


class ForwardCounter:
    """Counts forward calls of every text encoder a pipeline holds."""

    def __init__(self, pipeline: RolePipeline):
        self.calls = 0
        self._handles = [
            module.register_forward_hook(self._count)
            for name, module in pipeline.adapter.pipe.components.items()
            if name.startswith("text_encoder") and module is not None
        ]
        assert self._handles, "the pipeline holds no text encoder"

    def _count(self, *_: object) -> None:
        self.calls += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def encode(pipeline: RolePipeline, params: GenerationParams) -> dict[str, torch.Tensor]:
    return dict(pipeline.run(StageBatch(params)).tensors)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def flux_encoders(tiny_models: dict[str, Path]) -> tuple[RolePipeline, RolePipeline]:
    """The tiny FLUX encoder role with a cache and without one."""
    model = str(tiny_models["tiny-flux"])
    return load_role_pipeline(model, Role.ENCODER, encoder_cache_bytes=64 * MIB), load_role_pipeline(
        model, Role.ENCODER
    )


def test_a_repeated_prompt_skips_the_text_encoders_and_gives_the_same_embeddings(flux_encoders):
    cached, uncached = flux_encoders
    counter = ForwardCounter(cached)
    try:
        before = cached.encoder_cache.stats()
        first = encode(cached, FLUX)
        calls_first = counter.calls
        second = encode(cached, msgspec.structs.replace(FLUX, seed=6, guidance_scale=7.0, width=64))  # not encoded
        assert calls_first == 2, "both FLUX text encoders run on a miss"
        assert counter.calls == calls_first, "a hit must not run any text encoder"
    finally:
        counter.close()
    stats = cached.encoder_cache.stats()
    assert (stats.hits - before.hits, stats.misses - before.misses) == (1, 1)
    reference = encode(uncached, FLUX)
    assert set(second) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(first[name], tensor) and torch.equal(second[name], tensor), name


@pytest.mark.parametrize(
    "change",
    [{"prompt": "a dog"}, {"max_sequence_length": 32}, {"num_outputs": 2}],
    ids=["prompt", "max_sequence_length", "num_outputs"],
)
def test_a_parameter_the_text_encoders_read_is_part_of_the_key(flux_encoders, change):
    cached, _ = flux_encoders
    encode(cached, FLUX)
    before = cached.encoder_cache.stats()
    encode(cached, msgspec.structs.replace(FLUX, **change))
    assert cached.encoder_cache.stats().misses == before.misses + 1


def test_wan_keys_on_the_negative_prompt_and_on_whether_guidance_needs_it(tiny_models):
    pipeline = load_role_pipeline(str(tiny_models["tiny-wan"]), Role.ENCODER, encoder_cache_bytes=64 * MIB)
    cache = pipeline.encoder_cache
    encode(pipeline, WAN)
    encode(pipeline, msgspec.structs.replace(WAN, guidance_scale=6.0))  # still guided: the same embeddings
    assert (cache.stats().hits, cache.stats().misses) == (1, 1)
    encode(pipeline, msgspec.structs.replace(WAN, negative_prompt="dark"))
    unguided = encode(pipeline, msgspec.structs.replace(WAN, guidance_scale=1.0, negative_prompt=""))
    assert (cache.stats().hits, cache.stats().misses) == (1, 3)
    assert "negative_prompt_embeds" not in unguided


def test_a_full_pipeline_worker_s_cached_encode_gives_the_uncached_pixels(tiny_models):
    model = str(tiny_models["tiny-flux"])
    cached = load_role_pipeline(model, Role.MONOLITHIC, encoder_cache_bytes=64 * MIB)
    uncached = load_role_pipeline(model, Role.MONOLITHIC)
    first = cached.run(StageBatch(FLUX)).tensors[PIXELS]
    again = cached.run(StageBatch(FLUX)).tensors[PIXELS]
    assert cached.encoder_cache.stats().hits == 1
    assert torch.equal(first, uncached.run(StageBatch(FLUX)).tensors[PIXELS]) and torch.equal(again, first)


def test_what_the_cache_holds_never_changes_when_a_stage_writes_in_place():
    cache = EncoderCache(MIB)
    original = torch.arange(8, dtype=torch.float32)
    stored = {"prompt_embeds": original.clone()}
    cache.put("k", stored)
    stored["prompt_embeds"].mul_(0)  # the encoder's own output, changed after it was stored
    got = cache.get("k")
    assert got is not None
    got["prompt_embeds"].add_(100)  # a later stage working in place on what a hit handed it
    again = cache.get("k")
    assert again is not None and torch.equal(again["prompt_embeds"], original)


def test_the_cache_never_holds_more_than_its_bound_and_counts_evictions():
    entry = {"prompt_embeds": torch.zeros(1000)}  # 4000 bytes
    bound = 10_000
    cache = EncoderCache(bound)
    for i in range(50):
        cache.put(f"prompt {i}", entry)
        assert cache.stats().bytes <= bound
    stats = cache.stats()
    assert len(cache) == 2 and stats.bytes == 2 * embeddings_bytes(entry) and stats.evictions == 48
    assert cache.get("prompt 49") is not None and cache.get("prompt 0") is None  # the oldest went first


def test_the_least_recently_used_entry_goes_first():
    cache = EncoderCache(3 * 400)
    for key in "abc":
        cache.put(key, {"t": torch.zeros(100)})
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("d", {"t": torch.zeros(100)})
    assert cache.get("b") is None and cache.get("a") is not None


def test_an_entry_larger_than_the_bound_or_a_zero_bound_keeps_nothing():
    cache = EncoderCache(100)
    cache.put("big", {"t": torch.zeros(100)})
    assert len(cache) == 0 and cache.get("big") is None and cache.stats().misses == 1
    off = EncoderCache(0)
    off.put("k", {"t": torch.zeros(1)})
    assert len(off) == 0
    with pytest.raises(ValueError, match="--encoder-cache-bytes -1"):
        EncoderCache(-1)
