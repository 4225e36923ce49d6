"""Encoding decoded pixels into the files clients receive: PNG images and MP4 videos."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image


def png_bytes(image: np.ndarray) -> bytes:
    """One uint8 [H, W, 3] image as PNG."""
    buf = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def write_mp4(frames: np.ndarray, path: Path, fps: int) -> Path:
    """uint8 [F, H, W, 3] frames as an H.264 MP4 (odd sizes are padded by one pixel).

    PyAV (FFmpeg's libraries, libx264 included in its wheels) rather than an ffmpeg binary: the
    head image stays small (imageio-ffmpeg's static binary alone is ~170 MB).
    """
    import av

    _, h, w, _ = frames.shape
    if h % 2 or w % 2:  # yuv420p needs even dimensions
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part.mp4")
    with av.open(str(tmp), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18"}  # visually lossless; the exact frames are kept beside the MP4
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())  # flush the encoder
    tmp.replace(path)
    return path


def save_frames(frames: np.ndarray, path: Path) -> None:
    np.save(path, np.ascontiguousarray(frames, dtype=np.uint8), allow_pickle=False)


def load_frames(path: Path | BinaryIO) -> np.ndarray:
    return np.load(path, allow_pickle=False)


def png_zip(frames: np.ndarray) -> bytes:
    """uint8 [F, H, W, 3] as a ZIP of lossless PNGs named frame-00000.png, ..."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for i, frame in enumerate(frames):
            zf.writestr(f"frame-{i:05d}.png", png_bytes(frame))
    return buf.getvalue()
