"""Encoding decoded pixels into the files clients receive: images (PNG, JPEG or WebP) and MP4 videos,
on the head's pool of encoding threads (MediaPool)."""

from __future__ import annotations

import asyncio
import io
import time
import zipfile
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np
from PIL import Image
from prometheus_client import CollectorRegistry, Histogram

from triptych.contract import DEFAULT_QUALITY, PNG
from triptych.cpus import usable_cpus

T = TypeVar("T")
MEDIA_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class MediaPool:
    """Where the head's CPU-bound encodes run (the PNGs of all but small answers, MP4s, ZIPs of PNGs):
    one thread per CPU the head may use (triptych.cpus), so that a burst of large answers queues
    here instead of running as many encodes as asyncio's default executor has threads (host CPUs
    + 4), which in a container with a CPU limit throttles the event loop and the DiffusionServer's
    loop with them (docs/benchmarks.md, "Media encoding"). PIL and libx264 encode without holding
    the GIL. Blocking I/O (the result store) stays on the default executor: it never waits behind
    an encode. Threads start on first use."""

    def __init__(self, threads: int | None = None, registry: CollectorRegistry | None = None):
        self.threads = threads if threads is not None else usable_cpus()
        if self.threads < 1:
            raise ValueError(f"a media pool needs at least 1 thread, got {self.threads}")
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="media")
        # /metrics: a wait that grows says the head needs more CPUs (or heads) for its answers.
        self._waited = Histogram(
            "triptych_media_wait_seconds",
            "How long an encode of an answer waited for a thread of the head's media pool",
            buckets=MEDIA_BUCKETS,
            registry=registry,
        )
        self._took = Histogram(
            "triptych_media_encode_seconds",
            "Seconds each encode (a PNG; an MP4 and its frames, stored; a ZIP's next frame) took on its thread",
            buckets=MEDIA_BUCKETS,
            registry=registry,
        )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the pool."""
        queued = time.perf_counter()

        def timed() -> T:
            started = time.perf_counter()
            self._waited.observe(started - queued)
            try:
                return fn(*args)
            finally:
                self._took.observe(time.perf_counter() - started)

        return await asyncio.get_running_loop().run_in_executor(self._pool, timed)

    async def iterate(self, items: Iterator[T]) -> AsyncIterator[T]:
        """Each item of a blocking iterator (e.g. png_zip_chunks), produced on the pool."""
        end = object()
        while (item := await self.run(next, items, end)) is not end:
            yield item  # type: ignore[misc]  # not `end`

    def close(self) -> None:
        """Queued encodes are dropped; running ones finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def png_bytes(image: np.ndarray) -> bytes:
    """One uint8 [H, W, 3] image as PNG."""
    buf = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


FULL_COLOUR_QUALITY = 90  # a JPEG of this quality or more is not chroma subsampled


@dataclass(frozen=True)
class ImageFormat:
    """How an image answer's files are written (the request's output_format and output_compression):
    PNG, lossless and the default, or JPEG or WebP at a quality of 0-100 (lossy, however high)."""

    name: str = PNG  # triptych.contract.IMAGE_FORMATS
    quality: int | None = None  # jpeg, webp; None: DEFAULT_QUALITY

    @property
    def media_type(self) -> str:
        return f"image/{self.name}"

    @property
    def suffix(self) -> str:
        return ".jpg" if self.name == "jpeg" else f".{self.name}"

    def encode(self, image: np.ndarray) -> bytes:
        """One uint8 [H, W, 3] image in this format."""
        if self.name == PNG:
            return png_bytes(image)
        buf = io.BytesIO()
        quality = DEFAULT_QUALITY if self.quality is None else self.quality
        # A high-quality JPEG keeps full-resolution colour (4:4:4): PIL's default 4:2:0 halves it, which
        # on fine detail costs more than the quality buys (WebP's lossy mode is always 4:2:0).
        full_colour = {"subsampling": 0} if self.name == "jpeg" and quality >= FULL_COLOUR_QUALITY else {}
        Image.fromarray(image, mode="RGB").save(buf, format=self.name.upper(), quality=quality, **full_colour)
        return buf.getvalue()


def write_mp4(frames: np.ndarray, path: Path, fps: int, threads: int) -> Path:
    """uint8 [F, H, W, 3] frames as an H.264 MP4 (odd sizes are padded by one pixel), libx264 on
    `threads` threads (its default is 1.5 per host CPU, whatever the container's limit).

    PyAV (FFmpeg's libraries, libx264 included in its wheels) rather than an ffmpeg binary: the
    head image stays small (imageio-ffmpeg's static binary alone is ~170 MB).
    """
    import av

    _, h, w, _ = frames.shape
    if h % 2 or w % 2:  # yuv420p needs even dimensions
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part.mp4")
    try:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.height, stream.width = frames.shape[1:3]
            stream.pix_fmt = "yuv420p"
            # crf 18: visually lossless; the exact frames are kept beside the MP4
            stream.options = {"crf": "18", "threads": str(threads)}
            for frame in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
            container.mux(stream.encode())  # flush the encoder
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)  # an encode that failed (a full disk) leaves no part behind
    return path


def save_frames(frames: np.ndarray, path: Path) -> None:
    np.save(path, np.ascontiguousarray(frames, dtype=np.uint8), allow_pickle=False)


def load_frames(path: Path | BinaryIO, mmap: bool = False) -> np.ndarray:
    """The saved frames; `mmap` (a path only): mapped from the file, read as they are used."""
    return np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)


class _Pending:
    """The write-only, unseekable file a streamed ZipFile writes into (it then writes data
    descriptors, not a header rewritten in place); taken out piece by piece."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


ZIP_EPOCH = 315532800  # 1980-01-01 UTC: the earliest time a ZIP entry can carry


def png_zip_chunks(frames: np.ndarray, made_at: int = ZIP_EPOCH) -> Iterator[bytes]:
    """uint8 [F, H, W, 3] as a ZIP of lossless PNGs named frame-00000.png, ..., in pieces as each frame
    is encoded: one frame's PNG held at a time (blocking: iterate it in a thread). `frames` may be a
    memory map of the stored frames. Every entry is dated `made_at` (unix seconds, UTC), not the time of
    zipping, so the same frames give the same bytes on every fetch, through any head."""
    stamp = time.gmtime(max(made_at, ZIP_EPOCH))[:6]
    out = _Pending()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:  # type: ignore[call-overload]
        for i, frame in enumerate(frames):
            entry = zipfile.ZipInfo(f"frame-{i:05d}.png", date_time=stamp)
            entry.external_attr = 0o600 << 16  # what a named writestr gives: owner may read and write
            zf.writestr(entry, png_bytes(np.asarray(frame)))
            yield out.take()
    yield out.take()  # the central directory
