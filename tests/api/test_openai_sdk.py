"""OpenAI's own Python SDK against a head served over a real socket: what a client written for OpenAI's
API sends (a video request as multipart/form-data, `seconds` as text, an edit's file part, ...) is
served, and what the head answers parses into the SDK's types; a refusal is the SDK's
BadRequestError naming the parameter."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import uvicorn
from PIL import Image
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend, validate
from triptych.families import ModelInfo
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext

WAN = ModelInfo("tiny-wan", "WanPipeline", "video", 4, 5.0, size_multiple=16, frame_step=4, max_frames=81)
FLUX = ModelInfo("tiny-flux", "FluxPipeline", "image", 4, 3.5, size_multiple=16, max_steps=50)
KONTEXT = ModelInfo("tiny-kontext", "FluxKontextPipeline", "image", 4, 2.5, size_multiple=16, edits=True)
QUICK = {"num_inference_steps": 1}  # a field of this API beyond OpenAI's, as the SDK sends one: extra_body


@contextmanager
def serving(ctx: HeadContext) -> Iterator[int]:
    """The head of `ctx`, served by uvicorn on a loopback port (yielded) until the block ends."""
    config = uvicorn.Config(create_app(ctx), host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the head did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def sdk(model: ModelInfo, folder: Path) -> Iterator[openai.OpenAI]:
    """An OpenAI client of a head (scripted workers) that uvicorn serves on a loopback port."""
    ctx = HeadContext(
        backend=ScriptedBackend(), model=model, output_path=folder, registry=CollectorRegistry(), validate=validate
    )
    with serving(ctx) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        try:
            yield client
        finally:
            client.close()


def _completed(client: openai.OpenAI, video_id: str) -> openai.types.Video:
    deadline = time.monotonic() + 30
    while (video := client.videos.retrieve(video_id)).status != "completed":
        assert video.status in ("queued", "in_progress") and time.monotonic() < deadline, video
        time.sleep(0.02)
    return video


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK warns of OpenAI's own video service
def test_a_video_made_listed_downloaded_and_deleted_through_the_sdk(tmp_path: Path) -> None:
    with sdk(WAN, tmp_path) as client:
        video = client.videos.create(prompt="waves", seconds="4", size="32x16", model="tiny-wan", extra_body=QUICK)
        assert (video.object, video.seconds, video.size, video.model) == ("video", "4.0625", "32x16", "tiny-wan")
        done = _completed(client, video.id)
        assert done.progress == 100 and done.expires_at is not None and done.expires_at > done.created_at
        mp4 = client.videos.download_content(video.id).content
        assert mp4[4:8] == b"ftyp"
        thumbnail = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="thumbnail").content))
        assert (thumbnail.format, thumbnail.size) == ("WEBP", (32, 16))
        other = client.videos.create(prompt="more waves", size="32x16", extra_body={**QUICK, "num_frames": 5})
        _completed(client, other.id)
        newest_first = [v.id for v in client.videos.list(limit=1)]  # the SDK walks the pages, one job each
        assert sorted(newest_first) == sorted([video.id, other.id])
        assert [v.id for v in client.videos.list(order="asc")] == newest_first[::-1]
        assert client.videos.delete(video.id).deleted is True
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)
    assert not list(tmp_path.rglob(f"{video.id}*")), "the job's JSON, MP4, frames and thumbnail all go with it"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_video_the_model_cannot_make_is_the_sdk_s_bad_request_naming_the_parameter(tmp_path: Path) -> None:
    with sdk(WAN, tmp_path) as client:
        with pytest.raises(openai.BadRequestError) as too_long:
            client.videos.create(prompt="waves", seconds="12", size="32x16")
        with pytest.raises(openai.BadRequestError) as reference:
            client.videos.create(prompt="waves", input_reference=("cat.png", b"\x89PNG", "image/png"))
    assert too_long.value.param == "seconds" and "at most 81 (5.0625 s)" in too_long.value.message
    assert reference.value.param == "input_reference" and "videos are made from text only" in reference.value.message


def test_images_made_as_the_sdk_asks_them(tmp_path: Path) -> None:
    with sdk(FLUX, tmp_path) as client:
        two = client.images.generate(prompt="fox", size="32x16", n=2, extra_body=QUICK)
        assert len(two.data) == 2
        assert Image.open(io.BytesIO(base64.b64decode(two.data[0].b64_json or ""))).size == (32, 16)
        linked = client.images.generate(
            prompt="fox", size="32x16", response_format="url", output_format="jpeg", extra_body=QUICK
        )
        assert linked.data[0].url is not None and linked.data[0].url.endswith(".jpg")
        assert [m.id for m in client.models.list()] == ["tiny-flux"]
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.generate(prompt="fox", size="33x16")
    assert refused.value.param == "size" and "try 32" in refused.value.message


def test_an_edit_uploaded_as_the_sdk_uploads_it(tmp_path: Path) -> None:
    reference = io.BytesIO()
    Image.new("RGB", (48, 32), "red").save(reference, "PNG")
    with sdk(KONTEXT, tmp_path) as client:
        edited = client.images.edit(
            image=("red.png", reference.getvalue(), "image/png"), prompt="make it blue", extra_body=QUICK
        )
        with pytest.raises(openai.BadRequestError) as masked:
            client.images.edit(
                image=("red.png", reference.getvalue(), "image/png"),
                mask=("mask.png", reference.getvalue(), "image/png"),
                prompt="make it blue",
            )
    assert Image.open(io.BytesIO(base64.b64decode(edited.data[0].b64_json or ""))).size == (48, 32)
    assert masked.value.param == "mask" and "no mask is taken" in masked.value.message
