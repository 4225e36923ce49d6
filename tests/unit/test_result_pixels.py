"""The head's view of a decoder's pixels: no copy of the frame, and every encoder of an answer reads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zmq

from triptych.protocol import tensors_to_frames
from triptych_head.backend import pixels_from_frames
from triptych_head.media import load_frames, png_bytes, png_zip_chunks, save_frames, write_mp4


def _received(pixels: np.ndarray) -> tuple[list[dict], list[memoryview]]:
    """The pixels as the head's frontend client gets them: zmq frames received without a copy."""
    specs, frames = tensors_to_frames({"pixels": pixels})
    ctx = zmq.Context()
    try:
        with ctx.socket(zmq.PAIR) as a, ctx.socket(zmq.PAIR) as b:
            a.bind("inproc://pixels")
            b.connect("inproc://pixels")
            a.send_multipart(frames)
            return specs, [part.buffer for part in b.recv_multipart(copy=False)]
    finally:
        ctx.term()


def test_the_pixels_are_a_view_on_the_received_frame_not_a_copy(tmp_path: Path) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (1, 3, 16, 16, 3), dtype=np.uint8)
    specs, frames = _received(pixels)
    out = pixels_from_frames(specs, frames)
    assert np.shares_memory(out, np.frombuffer(frames[0], dtype=np.uint8))
    np.testing.assert_array_equal(out, pixels)
    # What the answers do with it: PNGs, a frames ZIP, the frames file and the MP4.
    assert png_bytes(out[0, 0]).startswith(b"\x89PNG")
    assert b"".join(png_zip_chunks(out[0])).startswith(b"PK")
    save_frames(out[0], tmp_path / "v.frames.npy")
    np.testing.assert_array_equal(load_frames(tmp_path / "v.frames.npy"), pixels[0])
    assert write_mp4(out[0], tmp_path / "v.mp4", fps=8, threads=2).stat().st_size > 0


def test_pixels_of_the_wrong_size_are_refused() -> None:
    specs, _ = _received(np.zeros((1, 1, 4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="expected 48"):
        pixels_from_frames(specs, [memoryview(b"\0" * 47)])
