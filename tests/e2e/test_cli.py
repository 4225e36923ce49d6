"""`triptych generate / edit / video / status` as a user runs them, against real deployments with the
tiny models: the PNG is the API's (for an edit too: FLUX.1 Kontext with an uploaded or URL
reference), a video shows its progress and Ctrl-C cancels it on the server."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.e2e.harness import deployment
from tests.worker.test_role_pipelines import reference_png
from triptych.client import Reference, TriptychClient
from triptych.roles import Role
from triptych_dev.localdeploy import LocalDeployment

pytestmark = pytest.mark.slow

KEY = "cli-test-key"
IMAGE = {"prompt": "a lighthouse at dusk", "size": "64x48", "seed": 21, "num_inference_steps": 3}
EDIT = {"prompt": "make it a watercolor", "size": "64x48", "seed": "7", "num_inference_steps": "2",
        "guidance_scale": "2.5"}  # fmt: skip
EDIT_FLAGS = ("--size", "64x48", "--seed", "7", "--steps", "2", "--guidance", "2.5")


def triptych(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "triptych", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.fixture(scope="module")
def flux(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    tmp = tmp_path_factory.mktemp("flux")
    (tmp / "keys.txt").write_text(KEY + "\n")
    with deployment(tiny_models["tiny-flux"], tmp, head_flags=("--api-keys-file", str(tmp / "keys.txt"))) as dep:
        yield dep


@pytest.fixture(scope="module")
def wan(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    with deployment(tiny_models["tiny-wan"], tmp_path_factory.mktemp("wan"), denoisers=2) as dep:
        yield dep


@pytest.fixture(scope="module")
def kontext(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    """FLUX.1 Kontext (takes a reference image), three roles: the encoder encodes the reference."""
    local = {Role.ENCODER: ("--reference-url-networks", "127.0.0.0/8")}  # URL references served on loopback
    with deployment(tiny_models["tiny-flux-kontext"], tmp_path_factory.mktemp("kontext"), role_flags=local) as dep:
        yield dep


def test_generate_writes_the_png_the_api_returns(flux: LocalDeployment, tmp_path: Path):
    out = tmp_path / "out.png"
    args = ["generate", IMAGE["prompt"], "-o", str(out), "--size", IMAGE["size"], "--seed", str(IMAGE["seed"])]
    done = triptych(*args, "--steps", "3", env={"TRIPTYCH_URL": flux.http, "TRIPTYCH_API_KEY": KEY})
    assert done.returncode == 0, done.stderr
    r = httpx.post(f"{flux.http}/v1/images/generations", json=IMAGE, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=120)  # fmt: skip
    assert out.read_bytes() == base64.b64decode(r.json()["data"][0]["b64_json"])
    assert "denoiser step 3/3" in done.stderr and f"wrote {out} (seed {IMAGE['seed']})" in done.stderr


def test_generate_asks_for_the_format_of_its_output_file(flux: LocalDeployment, tmp_path: Path):
    """-o out.jpg asks for a JPEG (--output-format and --output-compression say so outright): a real
    head encodes the same pixels the PNG answer carries, lossily."""
    env = {"TRIPTYCH_URL": flux.http, "TRIPTYCH_API_KEY": KEY}
    args = ["--size", IMAGE["size"], "--seed", str(IMAGE["seed"]), "--steps", "3"]
    jpeg, webp = tmp_path / "out.jpg", tmp_path / "small.webp"
    assert (done := triptych("generate", IMAGE["prompt"], "-o", str(jpeg), *args, env=env)).returncode == 0, done.stderr
    small = ("--output-format", "webp", "--output-compression", "20")
    assert (done := triptych("generate", IMAGE["prompt"], "-o", str(webp), *args, *small, env=env)).returncode == 0
    r = httpx.post(f"{flux.http}/v1/images/generations", json=IMAGE, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=120)  # fmt: skip
    png = base64.b64decode(r.json()["data"][0]["b64_json"])
    lossless = np.asarray(Image.open(io.BytesIO(png)), dtype=int)
    assert jpeg.read_bytes().startswith(b"\xff\xd8\xff") and webp.read_bytes()[8:12] == b"WEBP"
    pixels = np.asarray(Image.open(jpeg), dtype=int)
    assert pixels.shape == lossless.shape and np.abs(pixels - lossless).mean() < 2  # of 255: quality 100
    assert Image.open(webp).size == (64, 48) and webp.stat().st_size < len(png)


def test_generate_n_writes_numbered_files_and_a_missing_key_is_a_one_line_error(flux: LocalDeployment, tmp_path):
    out = tmp_path / "many.png"
    done = triptych("generate", "boats", "-o", str(out), "--n", "2", "--size", "32x32", "--steps", "2",
                    "--url", flux.http, "--api-key", KEY)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [p.name for p in sorted(tmp_path.glob("many-*.png"))] == ["many-0.png", "many-1.png"]
    # No --seed: the head drew one, and the command says which, so that --seed makes the same images.
    seeds = set(re.findall(r"wrote \S+many-[01]\.png \(seed (\d+)\)", done.stderr))
    assert len(seeds) == 1, done.stderr
    again = triptych("generate", "boats", "-o", str(tmp_path / "again.png"), "--n", "2", "--size", "32x32", "--steps",
                     "2", "--seed", seeds.pop(), "--url", flux.http, "--api-key", KEY)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again-1.png").read_bytes() == (tmp_path / "many-1.png").read_bytes()
    denied = triptych("generate", "boats", "-o", str(out), "--url", flux.http)
    assert denied.returncode == 1
    assert denied.stderr.strip() == "triptych: error: 401: missing API key: send 'Authorization: Bearer YOUR_KEY'"
    bad = triptych("generate", "boats", "-o", str(out), "--size", "64by64", "--url", flux.http, "--api-key", KEY)
    assert bad.returncode == 1 and "size" in bad.stderr and "64by64" in bad.stderr
    gone = triptych("status", "--url", "http://127.0.0.1:9")
    assert gone.returncode == 1 and gone.stderr.startswith("triptych: error: cannot reach http://127.0.0.1:9")
    nowhere = triptych("generate", "boats", "-o", str(out), "--url", "http://127.0.0.1:9")  # streams: never connected
    assert nowhere.returncode == 1 and nowhere.stderr.startswith("triptych: error: cannot reach http://127.0.0.1:9")


def test_status_prints_each_role_s_instances_and_free_slots(wan: LocalDeployment):
    done = triptych("status", "--url", wan.http)  # off a terminal, as in a CI log: no width to fit
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if "tcp://127.0.0.1:" in line]
    assert len(rows) == 4, done.stdout  # one encoder, two denoisers, one decoder
    workers = [p.url for p in wan.procs if p.role is not Role.SERVER]
    assert sorted(url for row in rows for url in workers if f" {url} " in row) == sorted(workers), done.stdout
    assert all("ready" in row and "2/2" in row for row in rows), done.stdout
    assert [row.split("│")[1].strip() for row in rows] == ["encoder", "denoiser", "", "decoder"]
    assert all(row.split("│")[4].strip() == "1 float32" for row in rows), done.stdout  # devices, dtype


def test_video_shows_its_progress_and_writes_the_mp4(wan: LocalDeployment, tmp_path: Path):
    out = tmp_path / "out.mp4"
    done = triptych("video", "waves", "-o", str(out), "--size", "64x64", "--frames", "5", "--steps", "4",
                    "--seed", "3", "--url", wan.http)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("video_") and lines[0].endswith(" queued")
    steps = [line for line in lines if line.startswith("denoiser step ")]
    assert steps == [f"denoiser step {k}/4" for k in range(1, 5)]
    roles = [line.split()[0] for line in lines if line.endswith("_RUNNING")]
    assert roles == ["encoder", "denoiser", "decoder"]
    assert out.read_bytes()[4:8] == b"ftyp"
    assert lines[-1] == f"wrote {out} ({out.stat().st_size} bytes, seed 3)"

    listed = triptych("videos", "--url", wan.http)  # the job, among the others this deployment ran
    assert listed.returncode == 0, listed.stderr
    (row,) = [line for line in listed.stdout.splitlines() if lines[0].split()[0] in line]
    assert [cell.strip() for cell in row.split("│")[2:6]] == ["completed", "100%", "64x64", "5"], row
    assert listed.stdout.strip().endswith("jobs shown")


def test_ctrl_c_during_video_cancels_the_job_on_the_server_and_frees_its_slots(wan: LocalDeployment, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "triptych", "video", "a long one", "-o", str(tmp_path / "never.mp4"),
         "--size", "64x64", "--frames", "5", "--steps", "200", "--url", wan.http],
        stderr=subprocess.PIPE, text=True,
        # as from a terminal: a suite started in the background (`cmd &`) passes SIGINT on ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert proc.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()  # stderr's lines, read aside: every wait here has a timeout

    def read(stream: IO[str]) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, args=(proc.stderr,), daemon=True)
    reader.start()
    try:
        job_id, seen = "", []
        deadline = time.monotonic() + 180
        while not seen or not seen[-1].startswith("denoiser step 2/200"):
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no progress within 180 s: {seen}")
            if line is None:
                pytest.fail(f"the CLI ended (exit {proc.wait(timeout=30)}) before its second step: {seen}")
            seen.append(line.strip())
            job_id = job_id or (seen[-1].split()[0] if seen[-1].startswith("video_") else "")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        reader.join(timeout=60)
        assert not reader.is_alive(), "stderr still open 60 s after the CLI exited"
    finally:
        proc.kill()  # nothing once it has exited
        proc.wait(timeout=30)
    rest = "".join(iter(lines.get_nowait, None))
    assert f"cancelled {job_id} on the server (cancelled)" in rest
    assert httpx.get(f"{wan.http}/v1/videos/{job_id}", timeout=30).json()["status"] == "cancelled"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = httpx.get(f"{wan.http}/health", timeout=30).json()["workers"]
        if all(w["free_slots"] == w["capacity"] for ws in workers.values() for w in ws):
            break
        time.sleep(0.3)
    else:
        pytest.fail(f"slots still held after the cancel: {workers}")


def test_edit_writes_the_png_the_api_returns_for_the_same_reference(kontext: LocalDeployment, tmp_path: Path):
    reference = tmp_path / "ref.png"
    reference.write_bytes(reference_png(40, 56))
    out = tmp_path / "edited.png"
    done = triptych("edit", str(reference), EDIT["prompt"], "-o", str(out), *EDIT_FLAGS, "--url", kontext.http)
    assert done.returncode == 0, done.stderr
    r = httpx.post(f"{kontext.http}/v1/images/edits", data=EDIT,
                   files={"image": ("ref.png", reference.read_bytes(), "image/png")}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    assert out.read_bytes() == base64.b64decode(r.json()["data"][0]["b64_json"])
    assert "denoiser step 2/2" in done.stderr and f"wrote {out}" in done.stderr
    client = TriptychClient(kontext.http)  # the library call behind it, without streaming
    try:
        body = {**EDIT, "seed": 7, "num_inference_steps": 2, "guidance_scale": 2.5}
        assert client.edit_images(body, Reference.of(str(reference))) == [out.read_bytes()]
    finally:
        client.close()


def test_edit_of_a_url_sends_the_url_for_the_server_to_fetch(kontext: LocalDeployment, tmp_path: Path):
    (tmp_path / "ref.png").write_bytes(reference_png(40, 56))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/ref.png"
        done = triptych("edit", url, EDIT["prompt"], "-o", str(tmp_path / "from-url.png"), *EDIT_FLAGS, "--n", "2",
                        "--url", kontext.http)  # fmt: skip
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    from_file = triptych("edit", str(tmp_path / "ref.png"), EDIT["prompt"], "-o", str(tmp_path / "from-file.png"),
                         *EDIT_FLAGS, "--n", "2", "--url", kontext.http)  # fmt: skip
    assert from_file.returncode == 0, from_file.stderr
    for i in range(2):
        assert (tmp_path / f"from-url-{i}.png").read_bytes() == (tmp_path / f"from-file-{i}.png").read_bytes()


def test_edit_of_a_bad_image_file_or_field_is_a_one_line_error(kontext: LocalDeployment, tmp_path: Path):
    text = tmp_path / "notes.png"
    text.write_text("this is text, not a picture")
    out = tmp_path / "never.png"
    bad = triptych("edit", str(text), "x", "-o", str(out), "--url", kontext.http)
    assert bad.returncode == 1
    assert bad.stderr.startswith("triptych: error: 400: image: not an image") and bad.stderr.count("\n") == 1
    missing = triptych("edit", str(tmp_path / "missing.png"), "x", "-o", str(out), "--url", kontext.http)
    assert missing.returncode == 1
    assert missing.stderr.startswith(f"triptych: error: image: cannot read {tmp_path / 'missing.png'}")
    assert missing.stderr.count("\n") == 1
    reference = tmp_path / "ref.png"
    reference.write_bytes(reference_png(40, 56))
    steps = triptych("edit", str(reference), "x", "-o", str(out), "--steps", "0", "--url", kontext.http)
    assert steps.returncode == 1 and steps.stderr.startswith("triptych: error: 400: num_inference_steps: ")
    assert not out.exists()


def test_a_request_that_fails_on_a_worker_is_a_one_line_error_naming_it(kontext: LocalDeployment, tmp_path: Path):
    # With --size the image encoder fetches the URL (the head does not): its refusal of a private
    # address comes back as the stream's error event, after the head gave the request its id.
    out = tmp_path / "never.png"
    refused = triptych("edit", "http://192.0.2.1/ref.png", "x", "-o", str(out), *EDIT_FLAGS, "--url", kontext.http)
    last = refused.stderr.strip().splitlines()[-1]  # progress lines first (no terminal), then the error
    assert refused.returncode == 1 and last.startswith("triptych: error: encoder ") and "192.0.2.1" in last, last
    assert re.search(r" \(request img_[0-9a-f]{32}\)$", last), last
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["status", "--url", ""], "url: give the head's HTTP URL"),
        (["status", "--url", "http://[::1"], "url 'http://[::1'"),
        (["status", "--url", "127.0.0.1:30000"], "url '127.0.0.1:30000': give the head's http:// or https:// URL"),
        (["status", "--api-key", "ключ"], "api key: an API key is ASCII text"),
        (["generate", "x", "-o", "{tmp}/no/o.png"], "-o {tmp}/no/o.png: its folder {tmp}/no does not exist"),
        (["generate", "x", "-o", "{tmp}"], "-o {tmp}: is a folder"),
        (["generate", "x", "-o", "{tmp}/o.gif"], "-o {tmp}/o.gif: .gif is not a format the head writes"),
        (["generate", "x", "-o", "{tmp}/o.png", "--output-format", "jpeg"], "-o {tmp}/o.png names png, but "),
        (["edit", "r.png", "x", "-o", "{tmp}/o.JPEG", "--output-format", "webp"], "-o {tmp}/o.JPEG names jpeg, but"),
        (["video", "x", "-o", "{tmp}/o.png"], "-o {tmp}/o.png: a video comes as MP4; give a .mp4 file"),
    ],
)
def test_a_bad_connection_or_output_is_a_one_line_error_before_any_request(tmp_path, argv, says):
    """These ended in tracebacks; a bad -o only after the server had done the work (and it was lost).
    No head runs here: each is refused before anything is sent."""
    proc = triptych(*(a.format(tmp=tmp_path) for a in argv), timeout=60)
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"triptych: error: {says.format(tmp=tmp_path)}"), line


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_number_option_is_refused_by_the_command_line(tmp_path, value):
    proc = triptych("generate", "x", "-o", str(tmp_path / "o.png"), "--guidance", value, timeout=60)
    assert proc.returncode == 2 and f"{value!r} is not a finite number" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
