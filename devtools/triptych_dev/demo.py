"""`make demo` (`triptych demo`): the tiny models served by the full disaggregated pipeline as local processes.

Starts a head plus one encoder, denoiser and decoder per model (separate processes, real ZMQ and
Mooncake TCP, through `triptych_dev.launch_pool`), asks the FLUX-style package for an image and the
Wan-style package for a video; then a FLUX.1 Kontext-style package with split encoders (prompt
encoder, image encoder, denoiser, decoder) edits that image. Writes all three under --out.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

from triptych_dev.pool import launch_pool
from triptych_dev.tiny_models import write_tiny_models

CPU = [["cpu"]]


def make_image(model: Path, out: Path) -> Path:
    with launch_pool(model, workdir=out / "logs" / "image") as pool, pool.deployment.client() as c:
        print(f"demo: image deployment up (head {pool.url}); generating...", flush=True)
        r = c.post(
            "/v1/images/generations",
            json={
                "prompt": "a lighthouse at dusk, oil painting",
                "size": "128x128",
                "seed": 7,
                "num_inference_steps": 4,
            },
        )
        r.raise_for_status()
        path = out / "demo-image.png"
        path.write_bytes(base64.b64decode(r.json()["data"][0]["b64_json"]))
        return path


def make_edit(model: Path, reference: Path, out: Path) -> Path:
    with (
        launch_pool(
            model, prompt_encoder_devices=CPU, image_encoder_devices=CPU, workdir=out / "logs" / "edit"
        ) as pool,
        pool.deployment.client() as c,
    ):
        print(f"demo: edit deployment up with split encoders (head {pool.url}); editing...", flush=True)
        r = c.post(
            "/v1/images/edits",
            data={"prompt": "the same lighthouse at night", "seed": "7", "num_inference_steps": "4"},
            files={"image": (reference.name, reference.read_bytes(), "image/png")},
        )
        r.raise_for_status()
        path = out / "demo-edit.png"
        path.write_bytes(base64.b64decode(r.json()["data"][0]["b64_json"]))
        return path


def make_video(model: Path, out: Path) -> Path:
    with launch_pool(model, workdir=out / "logs" / "video") as pool, pool.deployment.client() as c:
        print(f"demo: video deployment up (head {pool.url}); generating...", flush=True)
        body = {"prompt": "waves rolling onto a beach", "size": "64x64", "num_frames": 9, "seed": 7,
                "num_inference_steps": 4, "fps": 8}  # fmt: skip
        job = c.post("/v1/videos", json=body).raise_for_status().json()
        deadline = time.monotonic() + 300
        shown = ""
        while job["status"] not in ("completed", "failed", "cancelled"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"video job {job['id']} still {job['status']} after 300s")
            time.sleep(0.1)
            job = c.get(f"/v1/videos/{job['id']}").raise_for_status().json()
            line = f"demo: video {job['status']} {job['progress']}% ({job['state']})"
            if line != shown:
                print(line, flush=True)
                shown = line
        if job["status"] != "completed":
            raise RuntimeError(f"video job failed: {job.get('error')}")
        path = out / "demo-video.mp4"
        path.write_bytes(c.get(f"/v1/videos/{job['id']}/content").raise_for_status().content)
        return path


def run(models: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> int:
    """Write the tiny packages under `models` (if missing), then the image, video and edit under `out_dir`."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    flux, wan, kontext = write_tiny_models(models, families=["tiny-flux", "tiny-wan", "tiny-flux-kontext"])
    image = make_image(flux.resolve(), out)
    video = make_video(wan.resolve(), out)
    edit = make_edit(kontext.resolve(), image, out)
    print(f"image: {image}")
    print(f"video: {video}")
    print(f"edit: {edit}")
    return 0
