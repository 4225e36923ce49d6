"""The body of a plain image answer ({"created", "data": [{"b64_json"}, ...], "seed"}): small ones whole, large ones
streamed, each image in the request's output_format (media.ImageFormat: PNG unless asked otherwise);
a streamed request's `completed` event (image_stream.py) carries the same JSON, with its id and
Server-Timing around it, and is written the same way.

A large b64_json answer is written as it is encoded: one image's file at a time (on the head's
MediaPool), its base64 in chunks of B64_CHUNK bytes, so the head holds the decoded pixels, one file and
one chunk, never the files, their base64 and the JSON of it all at once (about four times the body; for
the contract's largest answer, 8 images of 4096x4096, that was about 1.9 GB). The bytes are the
same JSON the response model would give. A small answer (most of them) is encoded on the event
loop and sent whole: a thread hand-off and a chunked stream cost more than encoding a few KiB.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import numpy as np
from fastapi import Response
from fastapi.responses import StreamingResponse

from triptych_head.api.schemas import ImageData, ImageGenerationResponse
from triptych_head.media import ImageFormat, MediaPool

INLINE_PIXELS = 64 << 10  # pixel bytes (all images) encoded on the event loop: under ~1 ms of encoding
STREAM_PIXELS = 4 << 20  # pixel bytes above which a b64_json answer is streamed rather than built whole
B64_CHUNK = 3 * (256 << 10)  # file bytes per base64 chunk: a multiple of 3, so the chunks concatenate


def images_of(pixels: np.ndarray) -> list[np.ndarray]:
    """Each output's first frame, uint8 [H, W, 3]."""
    return [img[0] for img in pixels]


async def encode_images(pixels: np.ndarray, media: MediaPool, form: ImageFormat) -> list[bytes]:
    """Every output as a file of `form`: on the loop when small, else on the media pool (one encode per
    image, so an answer of several images uses as many of its threads as are free)."""
    if pixels.nbytes <= INLINE_PIXELS:
        return [form.encode(img) for img in images_of(pixels)]
    return list(await asyncio.gather(*(media.run(form.encode, img) for img in images_of(pixels))))


def streams(values: dict[str, Any], pixels: np.ndarray) -> bool:
    """Whether the answer is streamed: base64 images large enough for it to matter."""
    return values["response_format"] == "b64_json" and pixels.nbytes > STREAM_PIXELS


def whole(answer: ImageGenerationResponse, headers: dict[str, str]) -> Response:
    """The answer as one body: the response model's JSON."""
    return Response(answer.model_dump_json(), media_type="application/json", headers=headers)


def streamed(
    pixels: np.ndarray, seed: int, media: MediaPool, form: ImageFormat, headers: dict[str, str]
) -> StreamingResponse:
    """The b64_json answer written as each image is encoded (see the module's docstring)."""
    body = b64_body(images_of(pixels), int(time.time()), seed, media, form)
    return StreamingResponse(body, media_type="application/json", headers=headers)


async def b64_body(
    images: Iterable[np.ndarray],
    created: int,
    seed: int,
    media: MediaPool,
    form: ImageFormat,
    first: dict[str, Any] | None = None,
    last: dict[str, Any] | None = None,
) -> AsyncIterator[bytes]:
    """The JSON of ImageGenerationResponse(created, [ImageData(b64_json=...), ...], seed), in pieces; `first`
    and `last`: fields before and after the model's (a streamed request's `completed` event: its id
    and its Server-Timing), as json.dumps writes them."""
    yield b"{" + (_inside(first) + b"," if first else b"") + b'"created":%d,"data":[' % created
    for i, image in enumerate(images):
        file = await media.run(form.encode, image)
        yield b'{"b64_json":"' if i == 0 else b',{"b64_json":"'
        for start in range(0, len(file), B64_CHUNK):
            yield base64.b64encode(file[start : start + B64_CHUNK])
        del file
        yield b'","url":null}'
    yield b'],"seed":%d' % seed + (b"," + _inside(last) if last else b"") + b"}"


def _inside(fields: dict[str, Any]) -> bytes:
    """`fields` as the inside of a JSON object."""
    return json.dumps(fields, separators=(",", ":")).encode()[1:-1]


def b64_data(files: list[bytes]) -> list[ImageData]:
    return [ImageData(b64_json=base64.b64encode(file).decode()) for file in files]
