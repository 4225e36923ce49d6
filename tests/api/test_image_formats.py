"""An image answer's files in the format asked for (output_format png, jpeg or webp; output_compression
the quality of the lossy two): inline, by URL, streamed, large and edited alike; a wrong value is a
400 naming its field."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client import CollectorRegistry

from tests.api.test_edits_form import client_for, png
from tests.api.test_http_api import ScriptedBackend
from triptych.families import ModelInfo
from triptych_head.api import image_body
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext
from triptych_head.media import FULL_COLOUR_QUALITY, ImageFormat

IMAGES = "/v1/images/generations"
BODY = {"prompt": "cat", "size": "64x48", "num_inference_steps": 1}
MODEL = ModelInfo("tiny", "FluxPipeline", "image", 4, 3.5)
MAGIC = {"png": b"\x89PNG", "jpeg": b"\xff\xd8\xff", "webp": b"RIFF"}


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    with TestClient(create_app(HeadContext(ScriptedBackend(), MODEL, tmp_path, CollectorRegistry()))) as c:
        yield c


def decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def expected(width: int = 64, height: int = 48) -> np.ndarray:
    """The scripted backend's image: a vertical gradient."""
    return np.broadcast_to(np.arange(height, dtype=np.uint8)[:, None, None], (height, width, 3))


def file_of(answer: dict, i: int = 0) -> bytes:
    return base64.b64decode(answer["data"][i]["b64_json"])


@pytest.mark.parametrize("form", ["jpeg", "webp"])
def test_a_lossy_format_is_that_format_and_close_to_the_pixels(client: TestClient, form: str) -> None:
    answer = client.post(IMAGES, json={**BODY, "output_format": form})
    assert answer.status_code == 200, answer.text
    data = file_of(answer.json())
    assert data.startswith(MAGIC[form]) and (form != "webp" or data[8:12] == b"WEBP")
    pixels = decoded(data)
    assert pixels.shape == (48, 64, 3)
    assert np.abs(pixels.astype(int) - expected()).mean() < 2, "quality 100 by default: close to the pixels"


def test_png_stays_the_default_and_lossless(client: TestClient) -> None:
    answer = client.post(IMAGES, json=BODY)
    data = file_of(answer.json())
    assert data.startswith(MAGIC["png"]) and np.array_equal(decoded(data), expected())


def test_a_lower_compression_value_makes_a_smaller_file(client: TestClient) -> None:
    sizes = {}
    for quality in (5, 95):
        answer = client.post(IMAGES, json={**BODY, "size": "256x256", "output_format": "jpeg",
                                           "output_compression": quality})  # fmt: skip
        assert answer.status_code == 200, answer.text
        sizes[quality] = len(file_of(answer.json()))
    assert sizes[5] < sizes[95], sizes


def test_a_url_answer_serves_the_file_with_its_suffix_and_type(client: TestClient) -> None:
    for form, suffix in (("jpeg", ".jpg"), ("webp", ".webp"), ("png", ".png")):
        answer = client.post(IMAGES, json={**BODY, "response_format": "url", "output_format": form})
        url = answer.json()["data"][0]["url"]
        assert url.endswith(suffix), url
        served = client.get(url)
        assert served.status_code == 200 and served.headers["content-type"] == f"image/{form}"
        assert served.content.startswith(MAGIC[form])


def test_a_streamed_answer_s_completed_event_carries_the_format(client: TestClient) -> None:
    with client.stream("POST", IMAGES, json={**BODY, "stream": True, "output_format": "webp"}) as r:
        events = r.read().decode()
    (completed,) = [block for block in events.split("\n\n") if block.startswith("event: completed")]
    data = json.loads(completed.split("data: ", 1)[1])
    assert file_of(data).startswith(MAGIC["webp"])


def test_a_large_answer_is_streamed_in_the_format(client: TestClient) -> None:
    body = {**BODY, "size": "1024x1024", "n": 2, "output_format": "jpeg", "output_compression": 80}
    assert 2 * 1024 * 1024 * 3 > image_body.STREAM_PIXELS  # written as it is encoded (image_body.py)
    answer = client.post(IMAGES, json=body)
    assert answer.status_code == 200 and "content-length" not in answer.headers  # streamed
    files = [file_of(answer.json(), i) for i in range(2)]
    assert all(f.startswith(MAGIC["jpeg"]) for f in files)
    assert decoded(files[1]).shape == (1024, 1024, 3)


def test_an_edit_takes_the_format_as_a_form_field(tmp_path: Path) -> None:
    with client_for(ScriptedBackend(), tmp_path) as c:
        fields = {"prompt": "red", "num_inference_steps": "1", "output_format": "jpeg", "output_compression": "50"}
        answer = c.post("/v1/images/edits", data=fields, files={"image": ("in.png", png(), "image/png")})
    assert answer.status_code == 200, answer.text
    assert file_of(answer.json()).startswith(MAGIC["jpeg"])


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"output_format": "gif"}, "output_format", "png"),
        ({"output_format": "jpeg", "output_compression": 101}, "output_compression", "100"),
        ({"output_format": "webp", "output_compression": -1}, "output_compression", "0"),
        ({"output_compression": 50}, "output_compression", "png is lossless"),
        ({"output_format": "jpeg", "output_compression": "high"}, "output_compression", ""),
    ],
)
def test_a_wrong_value_is_a_400_naming_its_field(client: TestClient, extra: dict, field: str, words: str) -> None:
    answer = client.post(IMAGES, json={**BODY, **extra})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and words in error["message"], error


def test_a_high_quality_jpeg_keeps_full_resolution_colour() -> None:
    """Fine colour detail (here noise, the worst case) survives quality >= FULL_COLOUR_QUALITY: PIL's
    default chroma subsampling alone would put the mean error near 47 levels of 255."""
    noise = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    error = {q: np.abs(decoded(ImageFormat("jpeg", q).encode(noise)).astype(int) - noise).mean() for q in (None, 89)}
    assert FULL_COLOUR_QUALITY == 90 and error[None] < 1 and error[89] > 30, error


def test_an_answer_says_its_seed_and_the_seed_makes_the_same_request_again(tmp_path: Path) -> None:
    """A request without a seed gets the one the head drew, in its answer (and in a streamed answer's
    `completed` event); sent back, it is the request the pipeline ran."""
    backend = ScriptedBackend()
    with TestClient(create_app(HeadContext(backend, MODEL, tmp_path, CollectorRegistry()))) as c:
        drawn = c.post(IMAGES, json=BODY).json()["seed"]
        again = c.post(IMAGES, json={**BODY, "seed": drawn}).json()["seed"]
        with c.stream("POST", IMAGES, json={**BODY, "seed": 42, "stream": True}) as r:
            events = r.read().decode()
    assert isinstance(drawn, int) and again == drawn
    assert backend.calls[0].seed == backend.calls[1].seed == drawn, "the same pipeline run"
    (completed,) = [block for block in events.split("\n\n") if block.startswith("event: completed")]
    assert json.loads(completed.split("data: ", 1)[1])["seed"] == 42 == backend.calls[2].seed
