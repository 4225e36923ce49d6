"""POST /v1/images/edits with FLUX.1 Kontext: real processes on CPU, byte for byte against stock diffusers.

Monolithic, three roles (the combined encoder encodes the reference) and four roles (prompt
encoder -> image encoder -> denoiser -> decoder) return the pixels FluxKontextPipeline.__call__
returns; bad reference images get a 400 naming `image` and leave every process running.
"""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import zlib
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from PIL import Image

import triptych_dev
from tests.worker.test_role_pipelines import reference_png, stock_kontext_edit
from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_dev.localdeploy import local_monolithic

pytestmark = pytest.mark.slow

CPU = [["cpu"]]
FIELDS = {"prompt": "make it a watercolor", "size": "64x48", "seed": "7", "num_inference_steps": "2",
          "guidance_scale": "2.5", "n": "2"}  # fmt: skip
REFERENCE = reference_png(40, 56)
PARAMS = GenerationParams(FIELDS["prompt"], 64, 48, num_inference_steps=2, guidance_scale=2.5, seed=7,
                          num_outputs=2, image=REFERENCE)  # fmt: skip


def edit(client, files=None, **fields):  # type: ignore[no-untyped-def]
    files = {"image": ("ref.png", REFERENCE, "image/png")} if files is None else files
    data = {k: v for k, v in {**FIELDS, **fields}.items() if v is not None}
    return client.post("/v1/images/edits", data=data, files=files or None)


def pixels_of(response) -> np.ndarray:  # type: ignore[no-untyped-def]
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    return np.stack([np.array(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in data])[:, None]


@pytest.fixture(scope="module")
def expected(tiny_models) -> np.ndarray:
    return stock_kontext_edit(tiny_models["tiny-flux-kontext"], PARAMS).numpy()


@pytest.fixture(scope="module")
def four_roles(tiny_models, tmp_path_factory) -> Iterator[triptych_dev.pool.Pool]:
    with triptych_dev.launch_pool(
        tiny_models["tiny-flux-kontext"], prompt_encoder_devices=CPU, image_encoder_devices=CPU,
        workdir=tmp_path_factory.mktemp("four"), reference_url_networks="127.0.0.0/8",  # to the roles that take it
    ) as pool:  # fmt: skip
        yield pool


def test_four_roles_equal_stock_diffusers(four_roles, expected) -> None:
    with four_roles.deployment.client(300) as c:
        assert np.array_equal(pixels_of(edit(c)), expected)
        workers = c.get("/health").json()["workers"]
    assert [w["dispatched"] for w in workers["image_encoder"]] == [1]
    (image_encoder,) = four_roles.deployment.workers(Role.IMAGE_ENCODER)
    assert "stages ImageEncodingStage; loaded vae (" in image_encoder.log.read_text()


def test_three_roles_and_monolithic_equal_stock_diffusers(tiny_models, tmp_path, expected) -> None:
    model = tiny_models["tiny-flux-kontext"]
    with triptych_dev.launch_pool(model, encoder_devices=CPU, workdir=tmp_path / "three") as pool:
        with pool.deployment.client(300) as c:
            assert np.array_equal(pixels_of(edit(c)), expected)
    with local_monolithic(model, tmp_path / "mono", flags=("--device", "cpu")) as dep, dep.client(300) as c:
        assert np.array_equal(pixels_of(edit(c)), expected)


def _png_header(width: int, height: int, body: bytes = b"", mode: tuple[int, int] = (8, 2)) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, *mode, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def _bomb() -> bytes:
    """A 1-bit 12000x12000 PNG of zeros: ~20 KB on the wire, 144 megapixels decoded."""
    rows = 12000
    raw = zlib.compressobj(9)
    body = b"".join(raw.compress(b"\x00" * (1 + 12000 // 8)) for _ in range(rows)) + raw.flush()
    return _png_header(12000, rows, body, mode=(1, 0))


BAD_IMAGES = {
    "not-an-image": b"this is text, not a picture",
    "truncated": REFERENCE[: len(REFERENCE) // 2],
    "zero-by-zero": _png_header(0, 0),
    "20000x20000": _png_header(20000, 20000, zlib.compress(b"\x00" * 1000)),
    "decompression-bomb": _bomb(),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_images_get_a_400_naming_the_field_and_every_process_lives(four_roles, case: str) -> None:
    with four_roles.deployment.client(300) as c:
        r = edit(c, files={"image": ("ref.png", BAD_IMAGES[case], "image/png")})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "image"
        assert r.json()["error"]["message"].startswith("image: ")
        assert all(p.popen.poll() is None for p in four_roles.deployment.procs)
        health = c.get("/health").json()["workers"]
    assert all(w["alive"] for ws in health.values() for w in ws)


class _Files(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = REFERENCE if self.path == "/ref.png" else None
        self.send_response(200 if body else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


def test_a_url_reference_is_fetched_by_the_image_encoder_or_without_a_size_by_the_head(four_roles, expected) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        with four_roles.deployment.client(300) as c:
            assert np.array_equal(pixels_of(edit(c, files={}, image=f"{base}/ref.png")), expected)
            missing = edit(c, files={}, image=f"{base}/missing.png")
            assert missing.status_code == 400 and "image: GET" in missing.text and "404" in missing.text
            local = edit(c, files={}, image="file:///etc/passwd")
            assert local.status_code == 400 and local.json()["error"]["param"] == "image"
            # refused as cloud metadata (169.254.169.254) is: not public, not in --reference-url-networks
            # (TEST-NET-1, so a broken check dials nothing real; the ranges: tests/unit/test_reference.py)
            private = edit(c, files={}, image="http://192.0.2.1/latest/meta-data/ref.png")
            assert private.status_code == 400 and "not a public address" in private.text
            # Without a size the output keeps the reference's: the head fetches it to learn it and
            # inlines it, and the edit is the one an upload of the same file without a size gets.
            no_size = pixels_of(edit(c, files={}, image=f"{base}/ref.png", size=None))
            uploaded = pixels_of(edit(c, size=None))
    finally:
        server.shutdown()
    assert no_size.shape[2:4] == (56, 40) and np.array_equal(no_size, uploaded)


def test_without_a_size_the_output_keeps_the_reference_size_cropped_to_the_model_multiple(four_roles) -> None:
    fields = {k: v for k, v in FIELDS.items() if k != "size"}
    with four_roles.deployment.client(300) as c:
        r = c.post("/v1/images/edits", data={**fields, "n": "1"},
                   files={"image": ("ref.png", reference_png(45, 58), "image/png")})  # fmt: skip
    assert pixels_of(r).shape[2:4] == (56, 40)  # 58x45 cropped to the tiny model's multiple of 8


def test_text_only_models_answer_edits_with_a_400(tiny_models, tmp_path) -> None:
    with local_monolithic(tiny_models["tiny-flux"], tmp_path, flags=("--device", "cpu")) as dep, dep.client(60) as c:
        r = edit(c)
    assert r.status_code == 400 and r.json()["error"]["param"] == "image"
    assert msgspec.structs.replace(PARAMS, image=None).has_reference is False
