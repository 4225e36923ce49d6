"""Large answers stream: a b64_json image answer is written as it is encoded (api/image_body.py), so the
head never holds the PNGs, their base64 and the JSON of them at once; small ones are sent whole.

The app is driven through ASGI directly, its body counted and dropped as it is sent, so the memory
traced is the head's own (a test client would hold the whole body itself).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from prometheus_client import CollectorRegistry

from triptych.families import ModelInfo
from triptych_dev import asgi_call
from triptych_dev.asgi_call import FixedPixels
from triptych_head.api import image_body
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext
from triptych_head.api.schemas import ImageGenerationResponse
from triptych_head.media import png_bytes


def noise(n: int, side: int) -> np.ndarray:
    """Pixels PNG cannot compress: the PNGs are about as large as the pixels."""
    return np.random.default_rng(0).integers(0, 256, (n, 1, side, side, 3), dtype=np.uint8)


async def post(
    app: Any, body: dict[str, Any], keep: bool, key: str | None = None
) -> tuple[int, dict[str, str], int, bytes]:
    """One POST /v1/images/generations through ASGI (with an Idempotency-Key `key`): status, headers,
    body size, and the body if `keep`."""
    answer = await asgi_call.post(app, body, keep, [] if key is None else [(b"idempotency-key", key.encode())])
    return answer.status, answer.headers, answer.size, answer.body


def make_app(tmp_path: Path, pixels: np.ndarray) -> Any:
    model = ModelInfo("tiny", "FluxPipeline", "image", 4, 3.5, max_side=4096)
    return create_app(HeadContext(FixedPixels(pixels), model, tmp_path, CollectorRegistry()))


REQUEST = {"prompt": "noise", "size": "1024x1024", "n": 2, "response_format": "b64_json", "seed": 1}


def test_a_large_b64_answer_is_streamed_and_is_the_json_the_model_would_give(tmp_path):
    pixels = noise(2, 1024)
    assert pixels.nbytes > image_body.STREAM_PIXELS
    status, headers, _, body = asyncio.run(post(make_app(tmp_path, pixels), REQUEST, keep=True))
    assert status == 200, body[:500]
    assert "content-length" not in headers  # streamed (chunked on the wire)
    assert headers["server-timing"] == "total;dur=1"
    answer = json.loads(body)
    assert set(answer) == {"created", "data", "seed"} and len(answer["data"]) == 2
    assert answer["seed"] == REQUEST["seed"]  # what makes the same pixels again
    for i, item in enumerate(answer["data"]):
        assert item["url"] is None
        decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))
        assert np.array_equal(decoded, pixels[i, 0])


def test_a_small_answer_is_sent_whole(tmp_path):
    pixels = noise(1, 16)
    small = {**REQUEST, "size": "16x16", "n": 1}
    status, headers, size, body = asyncio.run(post(make_app(tmp_path, pixels), small, keep=True))
    assert status == 200
    assert headers["content-length"] == str(size) == str(len(body))
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(json.loads(body)["data"][0]["b64_json"]))))
    assert np.array_equal(decoded, pixels[0, 0])


def test_the_head_holds_less_than_the_body_once_while_answering_a_large_b64_request(tmp_path):
    """Peak memory traced while answering (the pixels were made before) is under the body's size:
    one PNG and one chunk of base64 at a time. Building it whole held the PNGs, their base64 and
    the JSON at once: about 2.7 times the body."""
    pixels = noise(2, 1024)
    app = make_app(tmp_path, pixels)

    async def measured() -> tuple[int, int]:
        await post(app, {**REQUEST, "size": "16x16"}, keep=False)  # warm up: imports, caches, the routes
        tracemalloc.start()
        try:
            status, _, size, _ = await post(app, REQUEST, keep=False)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert status == 200
        return size, peak

    size, peak = asyncio.run(measured())
    assert size > pixels.nbytes  # base64 of incompressible PNGs: about 4/3 of the pixels
    assert peak < size, f"peak {peak / 2**20:.1f} MiB traced for a {size / 2**20:.1f} MiB body"


def test_an_idempotent_large_answer_is_stored_and_replayed_without_being_held_whole(tmp_path):
    """With an Idempotency-Key the large answer is written to the store as it is encoded and sent
    out of it, the first time and on a replay: byte for byte the same body, and the head's peak
    memory (traced) stays under the body's size both times."""
    pixels = noise(2, 1024)
    app = make_app(tmp_path, pixels)

    async def measured(keep: bool) -> tuple[int, dict[str, str], int, bytes, int]:
        tracemalloc.start()
        try:
            status, headers, size, body = await post(app, REQUEST, keep=keep, key="large-1")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return status, headers, size, body, peak

    async def both() -> list[tuple[int, dict[str, str], int, bytes, int]]:
        await post(app, {**REQUEST, "size": "16x16"}, keep=False, key="warm-up")  # imports, caches, the routes
        runs = [await measured(keep=False), await measured(keep=False)]
        runs.append(await measured(keep=True))  # a second replay, kept to check its bytes
        return runs

    first, replay, kept = asyncio.run(both())
    for status, headers, size, _, peak in (first, replay):
        assert status == 200 and "content-length" not in headers  # streamed
        assert peak < size, f"peak {peak / 2**20:.1f} MiB traced for a {size / 2**20:.1f} MiB body"
    assert "idempotent-replayed" not in first[1] and replay[1]["idempotent-replayed"] == "true"
    assert first[2] == replay[2] == kept[2] > pixels.nbytes
    answer = json.loads(kept[3])
    for i, item in enumerate(answer["data"]):
        decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))
        assert np.array_equal(decoded, pixels[i, 0])
    assert not list((tmp_path / ".staging").glob("answer-*")), "the spooled answer was stored, not left behind"


async def post_sse(app: Any, body: dict[str, Any], keep: bool, key: str | None = None) -> tuple[Any, list[int]]:
    """One streamed POST (`stream: true`): the answer, and the size of each body message the app sent."""
    pieces: list[int] = []

    async def counted(scope: Any, receive: Any, send: Any) -> None:
        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                pieces.append(len(message.get("body", b"")))
            await send(message)

        await app(scope, receive, sending)

    headers = [] if key is None else [(b"idempotency-key", key.encode())]
    return await asgi_call.post(counted, {**body, "stream": True}, keep, headers), pieces


def completed_data(body: bytes) -> bytes:
    """The `data:` of the stream's one `completed` event, as sent."""
    events = [e for e in body.split(b"\n\n") if e.startswith(b"event: completed\n")]
    assert len(events) == 1, body[:300]
    return events[0].removeprefix(b"event: completed\ndata: ")


def expected_completed(data: bytes, pixels: np.ndarray) -> bytes:
    """What the `completed` event carried when it was built whole: the plain answer's model with the
    request's id first and its Server-Timing last, as one JSON line."""
    got = json.loads(data)
    pngs = [png_bytes(img[0]) for img in pixels]
    answer = ImageGenerationResponse(created=got["created"], data=image_body.b64_data(pngs), seed=REQUEST["seed"])
    whole = {"id": got["id"], **answer.model_dump(), "server_timing": "total;dur=1"}
    return json.dumps(whole, separators=(",", ":")).encode()


def test_a_large_streamed_answer_s_completed_event_is_sent_in_pieces_and_is_the_event_it_was(tmp_path):
    """The `completed` event of a large b64_json stream is written as the plain answer is (one PNG
    and one chunk of base64 at a time): the same bytes as the event built whole, in several body
    messages, and the head's peak memory (traced) under the body's size. Built whole it held the
    PNGs, their base64, the dict, its JSON and the encoded event: one message, about 3x the body."""
    pixels = noise(2, 1024)
    app = make_app(tmp_path, pixels)

    async def measured() -> tuple[Any, list[int], int, Any]:
        await post_sse(app, {**REQUEST, "size": "16x16"}, keep=False)  # warm up: imports, caches, the routes
        tracemalloc.start()
        try:
            answer, pieces = await post_sse(app, REQUEST, keep=False)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        kept, _ = await post_sse(app, REQUEST, keep=True)
        return answer, pieces, peak, kept

    answer, pieces, peak, kept = asyncio.run(measured())
    assert answer.status == 200 and answer.headers["content-type"].startswith("text/event-stream")
    assert answer.size > pixels.nbytes  # base64 of incompressible PNGs: about 4/3 of the pixels
    assert max(pieces) <= 2 * image_body.B64_CHUNK, f"a {max(pieces) / 2**20:.1f} MiB piece: built whole"
    assert len([p for p in pieces if p]) >= 2 * 3, pieces  # each ~3 MiB PNG's base64 in 1 MiB pieces
    assert peak < answer.size, f"peak {peak / 2**20:.1f} MiB traced for a {answer.size / 2**20:.1f} MiB body"
    data = completed_data(kept.body)
    assert data == expected_completed(data, pixels)
    assert json.loads(data)["id"].startswith("img_")


def test_a_small_streamed_answer_s_completed_event_is_the_event_it_was(tmp_path):
    pixels = noise(1, 16)
    answer, _ = asyncio.run(post_sse(make_app(tmp_path, pixels), {**REQUEST, "size": "16x16", "n": 1}, keep=True))
    assert answer.status == 200
    data = completed_data(answer.body)
    assert data == expected_completed(data, pixels)


def test_an_idempotent_large_streamed_answer_is_stored_and_replayed_in_pieces(tmp_path):
    """Under an Idempotency-Key the `completed` event is stored as it is encoded and sent out of the
    store in pieces, the first time and on a replay (that event alone): the same bytes both times."""
    pixels = noise(2, 1024)
    app = make_app(tmp_path, pixels)

    async def measured(keep: bool) -> tuple[Any, list[int], int]:
        tracemalloc.start()
        try:
            answer, pieces = await post_sse(app, REQUEST, keep=keep, key="large-sse")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return answer, pieces, peak

    async def runs() -> list[tuple[Any, list[int], int]]:
        await post_sse(app, {**REQUEST, "size": "16x16"}, keep=False, key="warm-up")  # imports, caches, the routes
        return [await measured(keep=True), await measured(keep=False)]

    (first, first_pieces, _), (replay, replay_pieces, replay_peak) = asyncio.run(runs())
    assert first.status == replay.status == 200
    assert "idempotent-replayed" not in first.headers and replay.headers["idempotent-replayed"] == "true"
    for pieces in (first_pieces, replay_pieces):
        assert max(pieces) <= 2 * image_body.B64_CHUNK and len([p for p in pieces if p]) >= 3, pieces
    assert replay_peak < replay.size, f"peak {replay_peak / 2**20:.1f} MiB for a {replay.size / 2**20:.1f} MiB body"
    data = completed_data(first.body)
    assert data == expected_completed(data, pixels)
    assert replay.size == len(b"event: completed\ndata: " + data + b"\n\n")
