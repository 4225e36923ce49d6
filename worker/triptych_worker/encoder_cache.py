"""EncoderCache: prompt embeddings kept for repeated prompts (--encoder-cache-bytes), least recently used out first.

    cache = EncoderCache(256 << 20)
    tensors = cache.get(key)           # copies of what was stored, or None
    cache.put(key, batch_outputs)      # stores copies

The key is everything the text encoders' output depends on: the model, then what the family's
adapter says its `encode_texts` reads (`FamilyAdapter.text_encoding_key`: the prompt, the negative
prompt where the family encodes one, whether classifier-free guidance needs it, the outputs per
prompt, max_sequence_length). Entries are copies in and copies out, so no later stage (which may
work in place) can change what a later request gets. Bounded in bytes: an entry larger than the
whole bound is not kept; otherwise the least recently used entries go until the new one fits.
Thread-safe: the worker's heartbeat reads the stats while a request encodes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING

from triptych.protocol import EncoderCacheStats

if TYPE_CHECKING:
    import torch

Embeddings = dict[str, "torch.Tensor"]


def embeddings_bytes(tensors: Embeddings) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _copy(tensors: Embeddings) -> Embeddings:
    return {name: t.detach().clone() for name, t in tensors.items()}


class EncoderCache:
    """An LRU of text-encoder outputs bounded to `capacity_bytes` (0: keeps nothing, counts misses)."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"--encoder-cache-bytes {capacity_bytes} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[Hashable, tuple[Embeddings, int]] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Embeddings | None:
        """Copies of the embeddings stored under `key` (now the most recently used), or None (a miss)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            stored = entry[0]
        return _copy(stored)  # outside the lock: entries are never changed once stored

    def put(self, key: Hashable, tensors: Embeddings) -> None:
        """Keep copies of `tensors` under `key`, dropping the least recently used entries to make room."""
        nbytes = embeddings_bytes(tensors)
        if nbytes > self.capacity_bytes:
            return  # would never fit (or the cache is off)
        stored = _copy(tensors)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            while self._bytes + nbytes > self.capacity_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
                self._evictions += 1
            self._entries[key] = (stored, nbytes)
            self._bytes += nbytes

    def stats(self) -> EncoderCacheStats:
        with self._lock:
            return EncoderCacheStats(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                bytes=self._bytes,
                capacity_bytes=self.capacity_bytes,
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
