"""The HTTP contract: OpenAI-style bodies and errors, video jobs, OpenAPI.

The backend here is a stand-in that returns fixed pixels (named as such: ScriptedBackend); the
real backends are exercised end to end in tests/e2e.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client import CollectorRegistry

from triptych.families import ModelInfo
from triptych.params import GenerationParams
from triptych.protocol import RequestEvent
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext
from triptych_head.backend import GenerationFailed, GenerationOutput
from triptych_head.results import Retention


class ScriptedBackend:
    """Stand-in backend: a gradient image per output, progress events, optional failure/slowness."""

    def __init__(self) -> None:
        self.calls: list[GenerationParams] = []
        self.request_ids: list[str] = []  # the id each call was made under
        self.fail: GenerationFailed | None = None
        self.step_delay = 0.0
        self.cancelled: list[str] = []
        self.priorities: list[int] = []  # each call's priority level, as the DiffusionServer would get it
        self.device_seconds = 0.0  # what each request reports it used (timeline.DEVICE_SECONDS)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    async def generate(self, request_id, params, on_event=None, preview_every=0, priority=1):
        self.calls.append(params)
        self.request_ids.append(request_id)
        self.priorities.append(priority)
        for step in range(1, params.num_inference_steps + 1):
            await asyncio.sleep(self.step_delay)
            if on_event:
                total = params.num_inference_steps
                on_event(RequestEvent(request_id, "DENOISING_RUNNING", step, total, role="denoiser"))
        if self.fail:
            raise self.fail
        y = np.arange(params.height, dtype=np.uint8)[:, None, None]
        frame = np.broadcast_to(y, (params.height, params.width, 3))
        pixels = np.broadcast_to(frame, (params.num_outputs, params.num_frames, *frame.shape)).copy()
        return GenerationOutput(pixels=pixels, timings={"device_seconds": self.device_seconds})


def validate(params: GenerationParams) -> None:
    if params.width % 16 or params.height % 16:
        raise ValueError(f"width {params.width} and height {params.height} must be multiples of 16")


@pytest.fixture
def backend():
    return ScriptedBackend()


def make_client(
    backend, tmp_path: Path, kind: str = "video", retention: Retention | None = None, model: ModelInfo | None = None
) -> TestClient:
    ctx = HeadContext(
        backend=backend,
        model=model or ModelInfo("tiny", "WanPipeline" if kind == "video" else "FluxPipeline", kind, 4, 3.5),
        output_path=tmp_path,
        registry=CollectorRegistry(),
        validate=validate,
        retention=retention or Retention(),
    )
    return TestClient(create_app(ctx))


@pytest.fixture
def client(backend, tmp_path):
    with make_client(backend, tmp_path) as c:
        yield c


def test_image_generation_returns_n_pngs_of_the_requested_size(client, backend):
    r = client.post("/v1/images/generations", json={"prompt": "cat", "size": "64x32", "n": 2, "seed": 5})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 2
    img = Image.open(io.BytesIO(base64.b64decode(data[0]["b64_json"])))
    assert img.size == (64, 32)
    p = backend.calls[0]
    assert (p.width, p.height, p.num_outputs, p.seed, p.num_inference_steps) == (64, 32, 2, 5, 4)


def test_url_response_format_serves_the_file(client):
    r = client.post("/v1/images/generations", json={"prompt": "cat", "size": "32x32", "response_format": "url"})
    url = r.json()["data"][0]["url"]
    png = client.get(url)
    assert png.status_code == 200 and png.content.startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"size": "32x32"}, "prompt"),
        ({"prompt": "", "size": "32x32"}, "prompt"),
        ({"prompt": "x", "size": "big"}, "size"),
        ({"prompt": "x", "size": "100000x2"}, "size"),
        ({"prompt": "x", "size": "40x40"}, "size"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
        ({"prompt": "x", "response_format": "gif"}, "response_format"),
        ({"prompt": "x", "bogus": 1}, "bogus"),
        ({"prompt": "x", "model": "other"}, "model"),
    ],
)
def test_invalid_input_is_a_4xx_naming_the_field(client, backend, body, param):
    r = client.post("/v1/images/generations", json=body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    assert backend.calls == []


def test_malformed_json_is_a_400(client):
    r = client.post("/v1/images/generations", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_pipeline_failure_is_reported_with_its_status(client, backend):
    backend.fail = GenerationFailed("denoiser tcp://x stopped responding", 503)
    r = client.post("/v1/images/generations", json={"prompt": "cat", "size": "32x32"})
    assert r.status_code == 503
    assert "stopped responding" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("denoiser tcp://127.0.0.1:7: loras: adapter 'ink' (/a) has no tensors for this model's transformer", "loras"),
        ("denoiser tcp://127.0.0.1:7: size/num_frames: the request makes 9 tokens, which do not split", "size"),
        ("step_cache: pyramid_attention_broadcast keeps one cache for both guidance branches", "step_cache"),
        ("encoder tcp://127.0.0.1:7: the text encoder ran out of memory", None),
    ],
)
def test_a_worker_s_refusal_names_the_field_it_leads_with(client, backend, message, param):
    backend.fail = GenerationFailed(message, 400)
    r = client.post("/v1/images/generations", json={"prompt": "cat", "size": "32x32"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == message and r.json()["error"]["param"] == param


def wait_for(client, job_id, status, timeout=10, headers=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/videos/{job_id}", headers=headers).json()
        if job["status"] == status:
            return job
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} not {status}: {job}")


def test_video_job_reports_progress_and_serves_mp4_and_exact_frames(client):
    r = client.post("/v1/videos", json={"prompt": "waves", "size": "32x16", "num_frames": 5, "num_inference_steps": 3})
    assert r.status_code == 200 and r.json()["status"] in ("queued", "in_progress")
    job = wait_for(client, r.json()["id"], "completed")
    assert job["progress"] == 100 and job["step"] == 3 and job["total_steps"] == 3
    mp4 = client.get(f"/v1/videos/{job['id']}/content")
    assert mp4.headers["content-type"] == "video/mp4" and mp4.content[4:8] == b"ftyp"
    frames = zipfile.ZipFile(io.BytesIO(client.get(f"/v1/videos/{job['id']}/content?variant=frames").content))
    names = sorted(frames.namelist())
    assert len(names) == 5
    first = np.array(Image.open(io.BytesIO(frames.read(names[0]))))
    assert first.shape == (16, 32, 3) and first[7, 0, 0] == 7


def test_video_content_before_completion_is_409_and_unknown_job_404(client, backend):
    backend.step_delay = 0.2
    job = client.post("/v1/videos", json={"prompt": "w", "size": "32x32", "num_inference_steps": 20}).json()
    assert client.get(f"/v1/videos/{job['id']}/content").status_code == 409
    assert client.get("/v1/videos/video_nope").status_code == 404
    cancelled = client.delete(f"/v1/videos/{job['id']}").json()
    assert cancelled["status"] == "cancelled"


def test_videos_are_refused_by_an_image_model(backend, tmp_path):
    with make_client(backend, tmp_path, kind="image") as c:
        r = c.post("/v1/videos", json={"prompt": "w", "size": "32x32"})
        assert r.status_code == 400 and "/v1/images/generations" in r.json()["error"]["message"]


def test_openapi_models_health_metrics(client):
    schema = client.get("/openapi.json").json()
    assert {"/v1/images/generations", "/v1/videos", "/v1/videos/{video_id}", "/v1/models"} <= set(schema["paths"])
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["edits"] is False  # the playground shows no reference upload
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/metrics").status_code == 200


def test_health_fails_once_the_backend_s_loop_stopped_unless_the_head_drains(backend, tmp_path):
    """Liveness: a head whose DiffusionServer loop died serves nothing; the kubelet must restart it.
    A draining head's loop ends on purpose: it stays alive until the drain is done."""
    loop = threading.Thread(target=lambda: None)
    loop.start()
    loop.join()  # as a loop that raised
    ctx = HeadContext(backend=backend, model=ModelInfo("tiny", "FluxPipeline", "image", 4, 3.5), output_path=tmp_path,
                      registry=CollectorRegistry(), alive=loop.is_alive)  # fmt: skip
    with TestClient(create_app(ctx)) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "stopped", r.text
        ctx.draining = True
        assert c.get("/health").status_code == 200


def test_every_name_of_the_model_is_accepted_and_listed_and_another_is_a_404_naming_them(backend, tmp_path):
    ctx_model = ModelInfo("wan", "WanPipeline", "video", 4, 3.5, aliases=("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "0123"))
    with make_client(backend, tmp_path, model=ctx_model) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == list(ctx_model.names)
        for name in ctx_model.names:
            r = c.post("/v1/videos", json={"model": name, "prompt": "raccoon", "size": "64x32", "num_frames": 5})
            assert r.status_code == 200, (name, r.text)
        r = c.post("/v1/videos", json={"model": "other/model", "prompt": "raccoon"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert (
            "'wan'" in r.json()["error"]["message"]
            and "'Wan-AI/Wan2.1-T2V-1.3B-Diffusers'" in r.json()["error"]["message"]
        )
