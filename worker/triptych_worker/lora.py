"""A request's LoRA adapters on the denoiser and the prompt encoder: loaded on first use, kept in a cache
bounded in bytes, activated with the request's weights for its denoising or its text encoding only.

    adapters = LoraAdapters(adapter, catalog, capacity_bytes)
    with adapters.applied(batch.params) as applied:  # load what is missing, set_adapters(names, weights) ...
        adapter.denoise(batch)  # ... disable_lora(); `applied`: the request's adapters that reach a text encoder here
    adapters.held()                       # the names loaded now, least recently used first (heartbeats)

The calls are the stock pipeline's own, on the role's pipeline: `pipe.load_lora_weights(source,
adapter_name=name)` once per adapter, then per request `pipe.set_adapters(names, adapter_weights=weights)`
and `enable_lora()`, and `disable_lora()` after it, so a request without adapters runs the base
weights: peft's layers skip every adapter while disabled. A denoiser's pipeline holds the transformer
only, so an adapter's text-encoder tensors are not loaded there; a prompt encoder's holds the text
encoders only, so it loads an adapter's text-encoder tensors only (the stock loader's own
`lora_state_dict` and `load_lora_into_text_encoder`, the two steps `load_lora_weights` takes for them),
and an adapter without any costs it nothing: it is remembered as such and never loaded there. Monolithic
mode and a full-pipeline denoiser hold both and load both parts, one cache for both stages. The pixels
are the stock pipeline's after the same `load_lora_weights` / `set_adapters` calls
(tests/e2e/test_lora.py).

An adapter the catalogue does not hold, a missing file (or one without adapter weights: a path the
process checked at start-up, triptych.lora.LoraCatalog.check_sources, may be gone or changed since, or
have come with a re-read catalogue), one whose tensors fit no layer of this transformer (or of these
text encoders), or a set larger than the cache fails that request only, with BadAdapter (a 400 naming
`loras`); the worker keeps serving, its other adapters as they were.

On a multi-device denoiser every rank holds its own copy of the adapters (parallel/ranks.py; a TP rank
its shards of them, parallel/tensor.py): each
job's adapter sources come pinned from rank 0 (`pinned`), and the ranks agree that every one of them
loaded before any denoises (`agree`), so a load that fails on one rank fails the request on all of
them at the same point and they stay in step.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from triptych.lora import FIELD, BadAdapter, LoraCatalog, source_problem
from triptych.params import GenerationParams, LoraWeight

if TYPE_CHECKING:
    from triptych_worker.adapters.base import FamilyAdapter

log = logging.getLogger(__name__)


class LoraAdapters:
    """The LoRA adapters loaded into one role's transformer and/or text encoders, least recently used first."""

    def __init__(self, adapter: FamilyAdapter, catalog: LoraCatalog, capacity_bytes: int):
        self.adapter = adapter
        self.catalog = catalog
        self.capacity_bytes = capacity_bytes
        self._held: OrderedDict[str, int] = OrderedDict()  # name -> bytes of its tensors
        self._loaded_from: dict[str, str] = {}  # name -> the catalogue's source it was loaded from
        self._lock = threading.Lock()  # heartbeats read the names from another thread
        self.loads = 0
        self.evictions = 0
        self._load_seconds = 0.0  # over every load: the head's estimate of a load's cost (heartbeats)
        self._in_text_encoders: set[str] = set()  # the held adapters with tensors in a text encoder
        self._no_part_here: dict[str, str] = {}  # name -> source: adapters with nothing for this encoder
        # A multi-device denoiser's ranks: given whether this rank's loads succeeded, whether every rank's did.
        self.agree: Callable[[bool], bool] | None = None
        pipe = adapter.pipe
        self.has_transformer = getattr(pipe, "transformer", None) is not None
        # The text encoders the pipeline's LoRA loader knows (FLUX.1: text_encoder, not T5; Wan: none).
        self.text_encoders = [
            c for c in getattr(pipe, "_lora_loadable_modules", ()) if "text_encoder" in c and getattr(pipe, c, None)
        ]
        self.place = "denoiser" if self.has_transformer else "encoder"
        if pipe is not None and getattr(pipe, "text_encoder", "none declared") is None:
            # A denoiser holds no text encoder (the encoder ran it): the stock load_lora_weights would
            # fail on an adapter's text-encoder tensors after loading its transformer's. They have
            # nowhere to go here, so that step loads nothing.
            pipe.load_lora_into_text_encoder = _no_text_encoder

    @property
    def inert(self) -> bool:
        """Whether no adapter can reach this pipeline (a decoder, or a prompt encoder whose text encoders
        the family's LoRA loader does not know, as Wan's): its requests load nothing."""
        return self.adapter.pipe is None or not (self.has_transformer or self.text_encoders)

    def held(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._held)

    def mean_load_seconds(self) -> float:
        """How long a load took here on average (0 before the first)."""
        return self._load_seconds / self.loads if self.loads else 0.0

    def sizes(self) -> dict[str, int]:
        """Bytes of each adapter loaded now."""
        with self._lock:
            return dict(self._held)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._held.values())

    @contextmanager
    def applied(self, params: GenerationParams) -> Iterator[tuple[LoraWeight, ...]]:
        """The request's adapters active with its weights while the block runs; nothing when it names none.
        It yields those of them whose tensors reach a text encoder here (what a prompt embedding depends on).
        The catalogue is read once for the whole block: what is loaded and what the block reads of
        `catalog` (the prompt cache's key) name the same files even when the catalogue changes meanwhile."""
        if not params.loras or self.inert:
            yield ()
            return
        pipe = self.adapter.pipe
        with self.pinned(self.sources(params)):
            try:
                self._ensure_together([lora.name for lora in params.loras])
                loras = [lora for lora in params.loras if lora.name not in self._no_part_here]
                if loras:
                    pipe.set_adapters([lora.name for lora in loras], adapter_weights=[lora.weight for lora in loras])
                    pipe.enable_lora()
                yield tuple(lora for lora in loras if lora.name in self._in_text_encoders)
            finally:
                if self.held():  # a load activates its adapter too: whatever happened, the next request starts clean
                    pipe.disable_lora()

    def sources(self, params: GenerationParams) -> dict[str, str]:
        """The catalogue's source of each adapter the request names (those it holds)."""
        found = {lora.name: self.catalog.source(lora.name) for lora in params.loras}
        return {name: source for name, source in found.items() if source is not None}

    @contextmanager
    def pinned(self, sources: Mapping[str, str]) -> Iterator[None]:
        """Adapter names resolve to `sources` alone while the block runs (a multi-device denoiser's job:
        every rank loads what rank 0's catalogue said as it sent the job)."""
        catalog, self.catalog = self.catalog, LoraCatalog(sources)
        try:
            yield
        finally:
            self.catalog = catalog

    def _ensure_together(self, names: Sequence[str]) -> None:
        """`_ensure`, then, on a multi-device denoiser, every rank's word that its loads succeeded: a
        failure on any rank fails the request on every rank here, before it denoises."""
        if self.agree is None:
            self._ensure(names)
            return
        try:
            self._ensure(names)
        except Exception:
            self.agree(False)
            raise
        if not self.agree(True):
            raise BadAdapter(
                f"{FIELD}: adapters {', '.join(names)} could not be loaded on every rank of this {self.place} "
                "(another rank's log names the failure)"
            )

    def _ensure(self, names: Sequence[str]) -> None:
        """Load the adapters of `names` not loaded yet (or loaded from a file their catalogue entry no
        longer names), then unload the least recently used others until the cache fits its bytes. A
        load that fails still leaves the cache within its bytes (what loaded before it counts)."""
        try:
            for name in names:
                source = self.catalog.source(name)
                with self._lock:
                    held = name in self._held
                    if held and self._loaded_from.get(name) == source:
                        self._held.move_to_end(name)
                        continue
                if held:  # its catalogue entry names another file now: what is loaded is not that adapter
                    self._unload(name)
                if name in self._no_part_here and self._no_part_here[name] == source:
                    continue
                self._no_part_here.pop(name, None)  # its catalogue entry changed: look at the new one
                self._load(name)
        except BaseException:
            self._evict(keep=set())
            raise
        self._evict(keep={name for name in names if name in self.held()})

    def _load(self, name: str) -> None:
        source = self.catalog.source(name)
        if source is None:
            raise BadAdapter(
                f"{FIELD}: adapter {name!r} is not in this {self.place}'s catalogue (--lora, --lora-catalog)"
            )
        problem = source_problem(source)  # a path without adapter weights (a hub id is downloaded: not here)
        if problem is not None:
            raise BadAdapter(f"{FIELD}: adapter {name!r}: {problem} on this {self.place}")
        started = time.perf_counter()
        if self.has_transformer:
            self._load_with_transformer(name, source)
        else:
            self._load_into_text_encoders(name, source)
        if name in self._no_part_here:
            return
        with self._lock:
            self._loaded_from[name] = source
        self.loads += 1
        self._load_seconds += time.perf_counter() - started
        log.info("loaded LoRA adapter %s from %s (%d bytes)", name, source, self._held[name])

    def _load_with_transformer(self, name: str, source: str) -> None:
        """The stock load_lora_weights: the transformer's part, and the text encoders' where the pipeline holds them."""
        pipe = self.adapter.pipe
        shapes, linears = _base_shapes(pipe.transformer), _base_linears(pipe.transformer)
        failure: Exception | None = None
        try:
            pipe.load_lora_weights(source, adapter_name=name)
        except Exception as exc:
            failure = exc
        if _base_shapes(pipe.transformer) != shapes or getattr(pipe.transformer, "_transformer_norm_layers", None):
            # diffusers widened base layers to fit it (FLUX Control LoRAs) or overwrote norm weights: that
            # changes the model for every request, so undo it (which unloads every adapter) and refuse it.
            self._reset(linears)
            raise BadAdapter(
                f"{FIELD}: adapter {name!r} ({source}) does not fit this model's transformer: it would change the "
                "base model's own layers (wider inputs or norm weights), which a per-request adapter may not"
            ) from failure
        if failure is not None:
            self._drop_partial(name)
            raise BadAdapter(
                f"{FIELD}: adapter {name!r} ({source}) cannot be loaded into this model's transformer: "
                f"{type(failure).__name__}: {_first_line(failure)}"
            ) from failure
        if _adapter_bytes(pipe.transformer, name) == 0:  # its tensors named no layer of it (another family's adapter)
            self._drop_partial(name)
            raise BadAdapter(f"{FIELD}: adapter {name!r} ({source}) has no tensors for this model's transformer")
        self._hold(name)

    def _load_into_text_encoders(self, name: str, source: str) -> None:
        """A prompt encoder's load: the two steps of the stock load_lora_weights that read the file and load
        its text-encoder tensors; an adapter with none is remembered and costs nothing more."""
        pipe = self.adapter.pipe
        try:
            state_dict, alphas, metadata = pipe.lora_state_dict(source, return_alphas=True, return_lora_metadata=True)
            prefixes = tuple(f"{c}." for c in self.text_encoders)
            if not any(key.startswith(prefixes) for key in state_dict):
                self._no_part_here[name] = source
                log.info("LoRA adapter %s (%s) has no text-encoder tensors: nothing to load here", name, source)
                return
            for component in self.text_encoders:
                pipe.load_lora_into_text_encoder(
                    state_dict, network_alphas=alphas, text_encoder=getattr(pipe, component), prefix=component,
                    lora_scale=pipe.lora_scale, adapter_name=name, metadata=metadata, _pipeline=pipe,
                )  # fmt: skip
        except Exception as exc:
            self._drop_partial(name)
            raise BadAdapter(
                f"{FIELD}: adapter {name!r} ({source}) cannot be loaded into this model's text encoder: "
                f"{type(exc).__name__}: {_first_line(exc)}"
            ) from exc
        if not self._bytes_in(self.text_encoders, name):
            self._drop_partial(name)
            raise BadAdapter(f"{FIELD}: adapter {name!r} ({source}) has no tensors for this model's text encoder")
        self._hold(name)

    def _hold(self, name: str) -> None:
        """Count a loaded adapter's bytes, over every part of the pipeline it reached."""
        if self._bytes_in(self.text_encoders, name):
            self._in_text_encoders.add(name)
        nbytes = self._bytes_in(["transformer", *self.text_encoders], name)
        with self._lock:
            self._held[name] = nbytes

    def _bytes_in(self, components: Sequence[str], name: str) -> int:
        pipe = self.adapter.pipe
        return sum(_adapter_bytes(getattr(pipe, c), name) for c in components if getattr(pipe, c, None) is not None)

    def _evict(self, keep: set[str]) -> None:
        with self._lock:
            order = list(self._held)
        for name in order:
            if self.held_bytes() <= self.capacity_bytes:
                return
            if name not in keep:
                self._unload(name)
                self.evictions += 1
        if self.held_bytes() > self.capacity_bytes:
            with self._lock:
                needed = sum(self._held.get(name, 0) for name in keep)
            for name in keep:
                self._unload(name)
            raise BadAdapter(
                f"{FIELD}: adapters {', '.join(sorted(keep))} need {needed} bytes together, more than this "
                f"{self.place}'s --lora-cache-bytes {self.capacity_bytes}"
            )

    def _unload(self, name: str) -> None:
        with self._lock:
            held = self._held.pop(name, None)
            self._loaded_from.pop(name, None)
        self._in_text_encoders.discard(name)
        if held is not None:
            self.adapter.pipe.delete_adapters(name)
            log.info("unloaded LoRA adapter %s (%d bytes)", name, held)

    def _reset(self, linears: dict[str, Any]) -> None:
        """Unload every adapter (norm weights one overwrote come back) and put back the transformer's
        own linear layers where diffusers replaced them with wider ones (`linears`: from before)."""
        pipe = self.adapter.pipe
        pipe.unload_lora_weights()
        transformer = pipe.transformer
        for path, linear in linears.items():
            parent, _, child = path.rpartition(".")
            owner = transformer.get_submodule(parent) if parent else transformer
            if getattr(owner, child) is not linear:
                setattr(owner, child, linear)
        with self._lock:
            self.evictions += len(self._held)
            self._held.clear()
            self._loaded_from.clear()
        self._in_text_encoders.clear()

    def _drop_partial(self, name: str) -> None:
        """Whatever a failed load left of adapter `name` in the transformer or the text encoders."""
        pipe = self.adapter.pipe
        parts = [getattr(pipe, c, None) for c in ("transformer", *self.text_encoders)]
        if any(name in (getattr(part, "peft_config", None) or {}) for part in parts):
            try:
                self.adapter.pipe.delete_adapters(name)
            except Exception:
                log.exception("removing what a failed load of LoRA adapter %s left", name)


def _no_text_encoder(*args: Any, **kwargs: Any) -> None:
    """load_lora_into_text_encoder on a pipeline without text encoders."""


def _base_shapes(transformer: Any) -> dict[str, tuple[int, ...]]:
    """The shapes of the transformer's own parameters (not the adapters'; peft moves an adapted layer's
    own under `base_layer`)."""
    return {
        n.replace(".base_layer.", "."): tuple(p.shape) for n, p in transformer.named_parameters() if ".lora_" not in n
    }


def _base_linears(transformer: Any) -> dict[str, Any]:
    """The transformer's own linear layers by path (under the peft layer that wraps an adapted one)."""
    import torch

    out = {}
    for path, module in transformer.named_modules():
        base = getattr(module, "base_layer", module)
        if isinstance(base, torch.nn.Linear) and ".base_layer" not in path and ".lora_" not in path:
            out[path] = base
    return out


def _adapter_bytes(transformer: Any, name: str) -> int:
    """Bytes of adapter `name`'s tensors in `transformer`: peft's own, named ...lora_A.<name>.weight (B,
    embedding_A/B, DoRA's magnitude_vector alike). Not every name with `.<name>.` in it: an adapter
    named `0` or `attn` would count the model's own blocks."""
    own = re.compile(rf"\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)\.{re.escape(name)}(?:\.|$)")
    return sum(p.numel() * p.element_size() for n, p in transformer.named_parameters() if own.search(n))


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""
