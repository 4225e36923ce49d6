"""The head's pool of encoding threads (media.py MediaPool): as wide as the head's CPUs, and what
the answers encode on (image_body.py, videos.py)."""

from __future__ import annotations

import asyncio
import io
import threading
import time
import zipfile
from typing import Any

import numpy as np
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from triptych.cpus import usable_cpus
from triptych_head.api import image_body
from triptych_head.media import ImageFormat, MediaPool, png_bytes, png_zip_chunks


class CountingPool(MediaPool):
    """A MediaPool that records how many of its jobs ran at once, and on which threads."""

    def __init__(self, threads: int, registry: CollectorRegistry | None = None):
        super().__init__(threads, registry)
        self._lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.jobs = 0
        self.thread_names: set[str] = set()

    async def run(self, fn: Any, *args: Any) -> Any:
        def counted() -> Any:
            with self._lock:
                self.running += 1
                self.jobs += 1
                self.most = max(self.most, self.running)
                self.thread_names.add(threading.current_thread().name)
            try:
                time.sleep(0.02)  # long enough for the other jobs to start, were there threads for them
                return fn(*args)
            finally:
                with self._lock:
                    self.running -= 1

        return await super().run(counted)


def noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def decoded(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_by_default_as_wide_as_the_cpus_the_head_may_use():
    pool = MediaPool()
    try:
        assert pool.threads == usable_cpus()
    finally:
        pool.close()
    with pytest.raises(ValueError, match="at least 1 thread"):
        MediaPool(0)


def test_encodes_queue_for_its_threads_and_each_image_comes_back_in_order():
    registry = CollectorRegistry()
    pool = CountingPool(2, registry)
    pixels = np.stack([noise(128, 128, seed)[None] for seed in range(6)])  # [6, 1, H, W, 3]: over INLINE_PIXELS
    assert pixels.nbytes > image_body.INLINE_PIXELS
    try:
        pngs = asyncio.run(image_body.encode_images(pixels, pool, ImageFormat()))
    finally:
        pool.close()
    assert pool.jobs == 6 and pool.most == 2, "six encodes, never more at once than the pool's two threads"
    # /metrics: each encode's wait for a thread (two waited one round of 20 ms, two waited two) and run.
    assert registry.get_sample_value("triptych_media_encode_seconds_count") == 6
    assert registry.get_sample_value("triptych_media_wait_seconds_count") == 6
    assert registry.get_sample_value("triptych_media_wait_seconds_sum") >= 0.1  # >= 2 x 20 ms + 2 x 40 ms
    assert all(name.startswith("media") for name in pool.thread_names)
    for png, image in zip(pngs, pixels, strict=True):
        assert np.array_equal(decoded(png), image[0])


def test_a_small_answer_is_encoded_on_the_loop_without_the_pool():
    pool = CountingPool(1)
    try:
        pngs = asyncio.run(image_body.encode_images(noise(16, 16)[None, None], pool, ImageFormat()))
    finally:
        pool.close()
    assert pool.jobs == 0 and len(pngs) == 1


def test_a_streamed_b64_answer_encodes_on_the_pool():
    pool = CountingPool(1)
    images = [noise(64, 64, seed) for seed in range(3)]

    async def body() -> bytes:
        return b"".join([piece async for piece in image_body.b64_body(images, 123, 7, pool, ImageFormat())])

    try:
        raw = asyncio.run(body())
    finally:
        pool.close()
    assert pool.jobs == 3 and pool.most == 1
    assert raw.startswith(b'{"created":123,"data":[{"b64_json":"') and raw.endswith(b'],"seed":7}')


def test_iterate_yields_a_blocking_iterators_items_in_order_from_the_pool():
    pool = MediaPool(1)
    frames = np.stack([noise(32, 48, seed) for seed in range(4)])
    seen_threads: list[str] = []

    def chunks() -> Any:
        for chunk in png_zip_chunks(frames):
            seen_threads.append(threading.current_thread().name)
            yield chunk

    async def collect() -> list[bytes]:
        return [chunk async for chunk in pool.iterate(chunks())]

    try:
        got = asyncio.run(collect())
    finally:
        pool.close()
    assert got == list(png_zip_chunks(frames))
    assert seen_threads and all(name.startswith("media") for name in seen_threads)


def test_a_frames_zip_is_dated_by_the_job_not_by_when_it_is_fetched(monkeypatch):
    frames = np.stack([noise(16, 8, seed) for seed in range(3)])
    made_at = 1_780_000_000  # 2026-05-28 20:26:40 UTC
    first = b"".join(png_zip_chunks(frames, made_at))
    monkeypatch.setattr(time, "time", lambda: made_at + 3600.0)  # fetched an hour later, elsewhere
    assert b"".join(png_zip_chunks(frames, made_at)) == first
    with zipfile.ZipFile(io.BytesIO(first)) as zf:
        infos = zf.infolist()
        assert [i.filename for i in infos] == ["frame-00000.png", "frame-00001.png", "frame-00002.png"]
        assert {i.date_time for i in infos} == {(2026, 5, 28, 20, 26, 40)}
        assert all(np.array_equal(decoded(zf.read(i)), frame) for i, frame in zip(infos, frames, strict=True))


def test_png_bytes_round_trip():
    image = noise(40, 24)
    assert np.array_equal(decoded(png_bytes(image)), image)
