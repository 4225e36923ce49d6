"""Progress as Server-Sent Events, against real processes with the tiny models: every state and
denoising step in order, previews every k steps, the result last; a stalled SSE client does not
slow the pipeline."""

from __future__ import annotations

import base64
import io
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.e2e.harness import deployment
from triptych.client import Event, TriptychClient, iter_sse
from triptych_dev.localdeploy import LocalDeployment

pytestmark = pytest.mark.slow

VIDEO = {"prompt": "waves on a beach", "size": "64x64", "num_frames": 5, "seed": 7, "num_inference_steps": 6}
IMAGE = {"prompt": "a lighthouse at dusk", "size": "64x48", "seed": 3, "num_inference_steps": 4}
ROLE_ORDER = ["encoder", "denoiser", "decoder"]
VAE_SCALE = 4  # the tiny models' VAE downsampling: a preview is the latent grid, WIDTH/4 x HEIGHT/4


@pytest.fixture(scope="module")
def wan(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    with deployment(tiny_models["tiny-wan"], tmp_path_factory.mktemp("wan")) as dep:
        yield dep


@pytest.fixture(scope="module")
def flux(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    with deployment(tiny_models["tiny-flux"], tmp_path_factory.mktemp("flux")) as dep:
        yield dep


def png_size(b64: str) -> tuple[int, int]:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.mode == "RGB"
    return image.size


def assert_progress_in_order(events: list[Event], steps: int, preview_every: int, preview_size: tuple[int, int]):
    names = [e.event for e in events]
    assert names[-1] == "completed", names
    assert "error" not in names and "dropped" not in names
    states = [e.data["state"] for e in events if e.event == "state"]
    roles = list(dict.fromkeys(e.data["role"] for e in events if e.data.get("role")))
    assert roles == ROLE_ORDER, states
    assert states[-1] == "DECODER_RUNNING"
    step_events = [e.data for e in events if e.event == "step"]
    assert [s["step"] for s in step_events] == list(range(1, steps + 1))
    assert {s["total_steps"] for s in step_events} == {steps}
    with_preview = [s["step"] for s in step_events if "preview" in s]
    assert with_preview == [k for k in range(1, steps + 1) if k % preview_every == 0]
    for s in step_events:
        if "preview" in s:
            assert png_size(s["preview"]) == preview_size


def test_a_video_streams_every_state_and_step_in_order_with_previews_and_ends_with_the_job(wan: LocalDeployment):
    client = TriptychClient(wan.http)
    job = client.create_video({**VIDEO, "preview_every": 2})
    events = list(client.video_events(job["id"]))
    assert_progress_in_order(events, steps=6, preview_every=2, preview_size=(64 // VAE_SCALE, 64 // VAE_SCALE))
    final = events[-1].data
    assert final["id"] == job["id"] and final["status"] == "completed"
    assert client.http.get(client.url + final["content_url"]).content[4:8] == b"ftyp"  # an MP4
    # Asked again just after it ended: the same story at once, from the feed's history (kept a minute).
    again = list(client.video_events(job["id"]))
    assert [(e.event, e.data.get("step")) for e in again] == [(e.event, e.data.get("step")) for e in events]


def test_a_streamed_image_ends_with_the_same_png_as_the_plain_api(flux: LocalDeployment):
    client = TriptychClient(flux.http)
    events = list(client.stream_images({**IMAGE, "preview_every": 1}))
    assert_progress_in_order(events, steps=4, preview_every=1, preview_size=(64 // VAE_SCALE, 48 // VAE_SCALE))
    streamed = base64.b64decode(events[-1].data["data"][0]["b64_json"])
    assert streamed == client.generate_images(IMAGE)[0]


def test_previews_without_a_stream_are_refused_naming_the_field(flux: LocalDeployment):
    r = httpx.post(f"{flux.http}/v1/images/generations", json={**IMAGE, "preview_every": 2}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "preview_every"
    r = httpx.post(f"{flux.http}/v1/videos", json={**VIDEO, "preview_every": -1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "preview_every"


def stalled_subscriber(http: str, video_id: str) -> socket.socket:
    """An SSE client that asks for a job's events and never reads them (a tiny receive window)."""
    host, port = http.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect((host, int(port)))
    sock.sendall(f"GET /v1/videos/{video_id}/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return sock


def unsent_bytes(http: str, client: socket.socket) -> int:
    """The head's Send-Q towards `client`: bytes its kernel holds because the client reads none."""
    port, client_port = http.rsplit(":", 1)[1], client.getsockname()[1]
    out = subprocess.run(
        ["ss", "-tnH", "state", "established", f"( sport = :{port} and dport = :{client_port} )"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return int(out[1])  # Recv-Q Send-Q Local Peer


def timed_video(client: TriptychClient, body: dict, stall: bool, wan: LocalDeployment) -> tuple[float, list[Event]]:
    """Seconds from POST to the completed event, as a reading client sees them; with `stall`, a second
    subscriber that never reads is connected before the first step."""
    started = time.monotonic()
    job = client.create_video(body)
    stalled = stalled_subscriber(wan.http, job["id"]) if stall else None
    try:
        events = list(client.video_events(job["id"]))
        elapsed = time.monotonic() - started
        if stalled is not None:  # still connected, and the head holds events it could not send it
            stalled.settimeout(5)
            assert stalled.recv(64, socket.MSG_PEEK).startswith(b"HTTP/1.1 200")
            assert unsent_bytes(wan.http, stalled) > 0, "the stalled client was not stalled"
    finally:
        if stalled is not None:
            stalled.close()
    return elapsed, events


def test_a_stalled_sse_client_does_not_slow_the_request(wan: LocalDeployment):
    # 256x256: every step's preview is a 64x64 PNG (~16 KB as base64), so 12 of them overflow what a
    # never-read connection buffers (its receive window, the kernel's and the server's send buffers).
    body = {**VIDEO, "size": "256x256", "num_inference_steps": 12, "preview_every": 1}
    client = TriptychClient(wan.http)
    timed_video(client, body, stall=False, wan=wan)  # warm-up: first-request costs out of the figures
    plain, stalled = [], []
    for _ in range(2):
        seconds, events = timed_video(client, body, stall=False, wan=wan)
        plain.append(seconds)
        assert_progress_in_order(events, 12, 1, (64, 64))
        seconds, events = timed_video(client, body, stall=True, wan=wan)
        stalled.append(seconds)
        assert_progress_in_order(events, 12, 1, (64, 64))  # the reading client lost nothing
    print(f"request latency without a stalled client {plain}, with one {stalled}")
    assert statistics.median(stalled) <= 1.5 * statistics.median(plain) + 1.0, (plain, stalled)


def test_the_sse_parser_reads_events_and_skips_keepalives():
    lines = ["event: step", 'data: {"step": 1}', "", ": keep-alive", "", "event: completed", "data: {}", ""]
    assert list(iter_sse(lines)) == [Event("step", {"step": 1}), Event("completed", {})]
