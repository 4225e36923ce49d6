"""POST /v1/images/edits at the head's door: the form, the reference and the size (a scripted backend)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import io
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlencode

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend, validate
from triptych.families import ModelInfo
from triptych.reference import allow_url_networks, parse_networks
from triptych_dev import asgi_call
from triptych_head.api import reference as edit_reference
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext


def png(width: int = 40, height: int = 36) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


def head_context(
    backend: ScriptedBackend, tmp_path: Path, edits: bool = True, max_request_bytes: int = 16 << 20,
    max_side: int = 4096,
) -> HeadContext:  # fmt: skip
    model = ModelInfo(
        "kontext", "FluxKontextPipeline", "image", 4, 3.5, edits=edits, size_multiple=16, max_side=max_side
    )
    return HeadContext(
        backend=backend, model=model, output_path=tmp_path, registry=CollectorRegistry(), validate=validate,
        max_request_bytes=max_request_bytes,
    )  # fmt: skip


def client_for(
    backend: ScriptedBackend, tmp_path: Path, edits: bool = True, max_request_bytes: int = 16 << 20,
    max_side: int = 4096,
) -> TestClient:  # fmt: skip
    return TestClient(create_app(head_context(backend, tmp_path, edits, max_request_bytes, max_side)))


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend()


def post(client: TestClient, files=None, **fields):  # type: ignore[no-untyped-def]
    files = {"image": ("r.png", png(), "image/png")} if files is None else files
    return client.post("/v1/images/edits", data={"prompt": "night", **fields}, files=files or None)


def test_an_upload_is_inlined_and_its_size_cropped_to_the_model_multiple(backend, tmp_path) -> None:
    with client_for(backend, tmp_path) as c:
        r = post(c, seed="3", n="2")
    assert r.status_code == 200, r.text
    (params,) = backend.calls
    assert params.image == png() and params.image_url is None
    assert (params.width, params.height, params.seed, params.num_outputs) == (32, 32, 3, 2)


def test_an_upload_over_the_reference_limit_is_a_413_naming_image_before_any_work(backend, tmp_path) -> None:
    """A --max-request-bytes above 16 MiB let a larger reference through to a control message it
    could not fit in, after the prompt encoder had run."""
    from triptych.reference import MAX_REFERENCE_BYTES

    big = png() + bytes(MAX_REFERENCE_BYTES)  # a PNG reads to its end chunk; the rest is never looked at
    with client_for(backend, tmp_path, max_request_bytes=64 << 20) as c:
        r = post(c, files={"image": ("r.png", big, "image/png")})
        ok = post(c, files={"image": ("r.png", png() + bytes(MAX_REFERENCE_BYTES - len(png())), "image/png")})
    assert r.status_code == 413 and r.json()["error"]["param"] == "image", r.text
    assert r.json()["error"]["message"].startswith(f"image: the file is {len(big)} bytes, over the 16 MiB")
    assert ok.status_code == 200, ok.text
    assert len(backend.calls) == 1


def test_a_url_reference_with_a_size_is_passed_on_unfetched(backend, tmp_path) -> None:
    with client_for(backend, tmp_path) as c:
        ok = post(c, files={}, image="https://example.com/r.png", size="64x48")
        not_http = post(c, files={}, image="file:///etc/passwd", size="64x48")
    assert ok.status_code == 200 and backend.calls[0].image_url == "https://example.com/r.png"
    assert backend.calls[0].image is None and (backend.calls[0].width, backend.calls[0].height) == (64, 48)
    assert not_http.status_code == 400 and not_http.json()["error"]["param"] == "image"


class _Images(http.server.BaseHTTPRequestHandler):
    """/r.png: a 40x36 PNG; /big.png: one of 3 MiB; anything else 404. Counts the GETs."""

    gets: list[str] = []

    def do_GET(self) -> None:
        self.gets.append(self.path)
        body = {"/r.png": png(), "/big.png": b"\x89PNG" + bytes(3 << 20)}.get(self.path, b"")
        try:
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # /big.png's reader stops at its limit, as it means to (see tests/unit/test_reference.py)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def loopback_server(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server on loopback, which the URL policy lets the head reach for the test only."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    allow_url_networks(parse_networks("127.0.0.0/8"))
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        allow_url_networks([])
        server.shutdown()


@pytest.fixture
def images() -> Iterator[str]:
    _Images.gets = []
    with loopback_server(_Images) as url:
        yield url


def test_a_url_reference_without_a_size_is_fetched_by_the_head_and_keeps_its_size(backend, tmp_path, images) -> None:
    """The output keeps the reference's size, so the head needs it before any worker runs: it fetches
    the URL (the image encoder's guards), inlines the bytes as an upload, and crops the size."""
    with client_for(backend, tmp_path) as c:
        r = post(c, files={}, image=f"{images}/r.png", seed="3")
    assert r.status_code == 200, r.text
    (params,) = backend.calls
    assert params.image == png() and params.image_url is None  # inlined: the image encoder fetches nothing
    assert (params.width, params.height) == (32, 32)
    assert _Images.gets == ["/r.png"]


def test_a_url_the_head_cannot_use_is_a_400_naming_image(backend, tmp_path, images) -> None:
    ctx_limit = 1 << 20  # the head fetches no more than it takes as an upload
    with client_for(backend, tmp_path, max_request_bytes=ctx_limit) as c:
        missing = post(c, files={}, image=f"{images}/missing.png")
        too_big = post(c, files={}, image=f"{images}/big.png")
    allow_url_networks([])
    with client_for(backend, tmp_path) as c:
        private = post(c, files={}, image=f"{images}/r.png")  # loopback, not listed: refused before connecting
    for r, says in ((missing, "answered 404"), (too_big, f"larger than {ctx_limit} bytes"), (private, "not a public")):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "image" and says in error["message"], error
        assert "with one, the image encoder does" in error["message"]
    assert backend.calls == [] and _Images.gets == ["/missing.png", "/big.png"]


@pytest.mark.parametrize(
    ("files", "fields", "param"),
    [
        ({}, {}, "image"),  # no reference
        ({"image": ("r.png", b"GIF89a-not-really", "image/gif")}, {}, "image"),
        ({"image": ("r.png", png(8, 8), "image/png")}, {}, "image"),  # smaller than the multiple: no size
        ({"mask": ("m.png", png(), "image/png")}, {}, "mask"),
        (None, {"n": "0"}, "n"),
        (None, {"size": "10x10"}, "size"),
        (None, {"unknown": "1"}, "unknown"),
        (None, {"image": "https://example.com/r.png"}, "image"),  # a file and a URL
    ],
)
def test_bad_forms_get_a_400_naming_the_field(backend, tmp_path, files, fields, param) -> None:
    with client_for(backend, tmp_path) as c:
        r = post(c, files=files, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert backend.calls == []


def test_a_mask_is_refused_saying_an_edit_takes_none(backend, tmp_path) -> None:
    with client_for(backend, tmp_path) as c:
        r = post(c, files={"image": ("r.png", png(), "image/png"), "mask": ("m.png", png(), "image/png")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mask", r.text
    assert "no mask is taken" in r.json()["error"]["message"] and backend.calls == []


def test_json_bodies_and_text_only_models_are_refused(backend, tmp_path) -> None:
    with client_for(backend, tmp_path) as c:
        assert c.post("/v1/images/edits", json={"prompt": "x"}).status_code == 400
    with client_for(backend, tmp_path, edits=False) as c:
        r = post(c)
    assert r.status_code == 400 and r.json()["error"]["param"] == "image"


class _Trickle(http.server.BaseHTTPRequestHandler):
    """Answers 200 and trickles four bytes (no image) over TRICKLE_S, as a slow or hostile host may;
    counts the GETs it serves at once."""

    lock = threading.Lock()
    active = 0
    most = 0

    def do_GET(self) -> None:
        with self.lock:
            _Trickle.active += 1
            _Trickle.most = max(_Trickle.most, _Trickle.active)
        try:
            self.send_response(200)
            self.end_headers()
            for _ in range(4):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(TRICKLE_S / 4)
        finally:
            with self.lock:
                _Trickle.active -= 1

    def log_message(self, *args: object) -> None:
        pass


TRICKLE_S = 1.0


@pytest.fixture
def trickle() -> Iterator[str]:
    _Trickle.active = _Trickle.most = 0
    with loopback_server(_Trickle) as url:
        yield url


def test_slow_reference_fetches_run_on_their_own_threads_and_hold_up_no_other_work(backend, tmp_path, trickle) -> None:
    """Size-less edits' URLs are fetched on the head's few fetch threads: while they trickle, work
    on asyncio's default executor (another request's Idempotency-Key lookup, url answer, video job
    save) runs at once, and at most FETCH_THREADS fetches run together (the rest wait their turn)."""
    form = urlencode({"prompt": "night", "image": f"{trickle}/slow.png"}).encode()
    app = create_app(head_context(backend, tmp_path))
    threads = edit_reference.FETCH_THREADS

    async def edits_and_other_work() -> tuple[float, list[asgi_call.Answer]]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2))  # a small machine's few
        form_type = b"application/x-www-form-urlencoded"
        edits = [
            asyncio.create_task(asgi_call.post(app, form, content_type=form_type, path="/v1/images/edits"))
            for _ in range(threads + 2)
        ]
        while _Trickle.active < 2:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        await asyncio.to_thread(time.monotonic)
        return time.monotonic() - started, await asyncio.gather(*edits)

    waited, answers = asyncio.run(edits_and_other_work())
    assert waited < TRICKLE_S / 2, f"work on the default executor waited {waited:.2f}s behind the fetches"
    assert [a.status for a in answers] == [400] * (threads + 2)  # four bytes are no image
    assert _Trickle.most == threads
    assert backend.calls == []


def test_a_deeply_nested_loras_field_is_a_400_naming_loras(backend, tmp_path) -> None:
    with client_for(backend, tmp_path) as c:
        r = post(c, loras="[" * 5000 + "]" * 5000)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "loras"


def test_the_form_s_content_type_is_read_whatever_its_case(backend, tmp_path) -> None:
    body = b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nnight\r\n'
    body += b'--x\r\nContent-Disposition: form-data; name="image"; filename="r.png"\r\n'
    body += b"Content-Type: image/png\r\n\r\n" + png() + b"\r\n--x--\r\n"
    with client_for(backend, tmp_path) as c:
        r = c.post("/v1/images/edits", content=body, headers={"Content-Type": "Multipart/Form-Data; boundary=x"})
    assert r.status_code == 200, r.text
    assert backend.calls[0].image == png()


def test_a_file_that_is_no_image_is_refused_without_python_s_words_for_it(backend, tmp_path) -> None:
    with client_for(backend, tmp_path) as c:
        r = post(c, files={"image": ("r.png", b"GIF89a-not-really", "image/gif")})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "image", error
    assert error["message"].startswith("image: not an image this server reads"), error
    assert "BytesIO" not in error["message"] and " at 0x" not in error["message"], error


@pytest.mark.parametrize(("width", "height"), [(15, 40), (40, 8), (80, 40), (16, 96)])
def test_a_reference_of_a_size_the_model_cannot_make_and_no_size_is_a_400_naming_image(
    backend, tmp_path, width, height
) -> None:
    """Without `size` the output keeps the reference's size: one the model cannot make (16..64
    pixels a side here) is the image's fault, told so with its real size and what to do."""
    with client_for(backend, tmp_path, max_side=64) as c:
        refused = post(c, files={"image": ("r.png", png(width, height), "image/png")})
        sized = post(c, files={"image": ("r.png", png(width, height), "image/png")}, size="32x32")
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "image", error
    assert f"the reference is {width}x{height}" in error["message"] and "16..64" in error["message"], error
    assert "give a size" in error["message"], error
    assert sized.status_code == 200, sized.text
    assert len(backend.calls) == 1


def form_with_prompt(prompt: bytes) -> bytes:
    """A multipart edit whose `prompt` part carries these exact bytes, and an image."""
    body = b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n' + prompt + b"\r\n"
    body += b'--x\r\nContent-Disposition: form-data; name="image"; filename="r.png"\r\n'
    return body + b"Content-Type: image/png\r\n\r\n" + png() + b"\r\n--x--\r\n"


@pytest.mark.parametrize("prompt", [b"caf\xe9", b"night \xff\xfe", b"\xe7\x8c"])  # latin-1, stray bytes, cut short
def test_a_text_field_that_is_not_utf8_is_a_400_naming_it_not_read_as_latin1(backend, tmp_path, prompt) -> None:
    """Starlette reads a text part it cannot decode as latin-1, silently; the head refuses it."""
    with client_for(backend, tmp_path) as c:
        r = c.post("/v1/images/edits", content=form_with_prompt(prompt),
                   headers={"Content-Type": "multipart/form-data; boundary=x"})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt: "), error
    assert "UTF-8" in error["message"], error
    assert backend.calls == []


def test_a_text_field_of_non_ascii_utf8_is_taken_as_it_is(backend, tmp_path) -> None:
    with client_for(backend, tmp_path) as c:
        raw = c.post("/v1/images/edits", content=form_with_prompt("café 猫".encode()),
                     headers={"Content-Type": "multipart/form-data; boundary=x"})  # fmt: skip
        client_made = post(c, prompt="café 猫")  # the test client's own multipart encoding
    assert raw.status_code == 200, raw.text
    assert client_made.status_code == 200, client_made.text
    assert [p.prompt for p in backend.calls] == ["café 猫", "café 猫"]


@pytest.mark.parametrize("prompt", [b"caf%E9", b"caf\xe9"])  # an escaped and a raw latin-1 byte
def test_a_url_encoded_text_field_that_is_not_utf8_is_a_400_naming_it(backend, tmp_path, prompt) -> None:
    """Starlette reads a url-encoded field's bytes as latin-1 and a bad %-escape as U+FFFD, silently:
    the head refuses both, and reads UTF-8, escaped or raw (as `curl -d` sends it), as it is."""
    body = b"image=https%3A%2F%2Fexample.com%2Fr.png&size=64x48&prompt="
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    with client_for(backend, tmp_path) as c:
        bad = c.post("/v1/images/edits", content=body + prompt, headers=form)
        escaped = c.post("/v1/images/edits", content=body + b"caf%C3%A9+%E7%8C%AB", headers=form)
        raw = c.post("/v1/images/edits", content=body + "café 猫".encode(), headers=form)
        percent = c.post("/v1/images/edits", content=body + b"100%25+%2541", headers=form)  # decoded once
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["param"] == "prompt" and "UTF-8" in error["message"], error
    assert [a.status_code for a in (escaped, raw, percent)] == [200] * 3, (escaped.text, raw.text, percent.text)
    assert [p.prompt for p in backend.calls] == ["café 猫", "café 猫", "100% %41"]


@pytest.mark.parametrize("size", [None, "64x48"])  # fetched by the head, or passed on to the image encoder
@pytest.mark.parametrize("ported", [False, True])
def test_a_url_with_a_user_part_is_a_400_naming_image_before_any_connection(
    backend, tmp_path, images, size, ported
) -> None:
    """`http://alice:pa55word@host/r.png` was fetched by the head (a false "the server answered something
    that is not HTTP", nothing asked) or passed on to the image encoder, `alice@host:port` failed as an
    unknown host: a 400 naming `image` now, saying why, before any name is looked up or any connection
    made, repeating neither the user nor the password."""
    from tests.unit.test_reference_errors import no_dials

    address = images.removeprefix("http://") if ported else "127.0.0.1"
    fields = {} if size is None else {"size": size}
    with client_for(backend, tmp_path) as c, no_dials() as dials:
        r = post(c, files={}, image=f"http://alice:pa55word@{address}/r.png", **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "image" and error["message"].startswith(
        f"image: http://{address}/r.png: a URL with user:password@ is not fetched (credentials do not belong in a URL)"
    ), error
    assert "alice" not in r.text and "pa55word" not in r.text, r.text
    assert dials == [] and _Images.gets == [] and backend.calls == [], (dials, _Images.gets)
