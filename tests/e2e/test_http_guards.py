"""The HTTP API under attack and overload, against real processes (a head and simulated workers).

API keys (401, rotation without a restart), the body limit (413 before the body is read), no input
that answers 5xx (schema-driven fuzzing), admission control (429 with Retry-After from observed
stage times, visible in /metrics and /health), and cancellation when an image client disconnects.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.e2e.harness import deployment
from tests.e2e.test_null_pipeline import metric
from triptych.roles import Role
from triptych_dev.localdeploy import LocalDeployment, local_monolithic

pytestmark = pytest.mark.slow

KEYS = ("sk-first-key", "sk-second-key")
INSTANT = ("--simulate-seconds", "0", "--simulate-seconds-per-unit", "0")
BODY_LIMIT = 64 * 1024
SMALL = {"prompt": "a red square", "size": "32x32", "seed": 1, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def flux(tiny_models):
    return tiny_models["tiny-flux"]


def write_keys(path: Path, *keys: str) -> None:
    """Replace the file as a Secret update does: a new file swapped in at once."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("# API keys of this head\n\n" + "".join(f"{k}  # a client\n" for k in keys))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def guarded(flux, tmp_path_factory) -> Any:
    """A head with API keys and a 64 KiB body limit over instant simulated workers."""
    tmp = tmp_path_factory.mktemp("guarded")
    keys = tmp / "api-keys"
    write_keys(keys, *KEYS)
    flags = ("--api-keys-file", str(keys), "--max-request-bytes", str(BODY_LIMIT))
    with deployment(flux, tmp, simulate=True, worker_flags=INSTANT, head_flags=flags) as dep:
        yield dep, keys


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error", error
    if code is not None:
        assert error["code"] == code, error
    return error  # type: ignore[no-any-return]


# --- API keys ---------------------------------------------------------------------------------


def test_the_api_wants_a_valid_key_and_the_probes_and_metrics_do_not(guarded):
    dep, _ = guarded
    with dep.client(timeout=30) as c:
        for headers in ({}, auth("sk-wrong"), {"Authorization": "Basic c2stZmlyc3Qta2V5"}, auth(KEYS[0] + "x")):
            r = c.post("/v1/images/generations", json=SMALL, headers=headers)
            assert_openai_error(r, 401, "invalid_api_key")
            assert r.headers["WWW-Authenticate"] == "Bearer"
        for path in ("/v1/models", "/v1/videos", "/openapi.json", "/v1/files/images/x.png"):
            assert c.get(path).status_code == 401, path
        for key in KEYS:
            assert c.post("/v1/images/generations", json=SMALL, headers=auth(key)).status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert c.get(path).status_code == 200, path


def test_rotating_the_keys_file_takes_effect_without_a_restart(guarded):
    dep, keys = guarded
    pid = dep.head.popen.pid
    try:
        write_keys(keys, KEYS[1], "sk-rotated-in")
        with dep.client(timeout=30) as c:
            deadline = time.monotonic() + 10
            while c.get("/v1/models", headers=auth(KEYS[0])).status_code != 401:
                assert time.monotonic() < deadline, "the removed key still works"
                time.sleep(0.2)
            assert c.get("/v1/models", headers=auth("sk-rotated-in")).status_code == 200
            assert c.get("/v1/models", headers=auth(KEYS[1])).status_code == 200
        assert dep.head.popen.poll() is None and dep.head.popen.pid == pid
    finally:
        write_keys(keys, *KEYS)
        time.sleep(1.5)  # past the head's re-check interval, for the tests after this one


# --- body limit -------------------------------------------------------------------------------


def raw_http(dep: LocalDeployment, head: bytes, body_parts: list[bytes], timeout: float = 10) -> tuple[int, bytes]:
    """Send a request head and some body parts on a raw socket (never necessarily all of the body);
    return the status and the response bytes read until the server closed or `timeout`."""
    port = int(dep.http.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        for part in body_parts:
            s.sendall(part)
        s.settimeout(timeout)
        data = b""
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in data or not _complete(data):
            if time.monotonic() > deadline:
                break
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, data


def _complete(data: bytes) -> bool:
    header, _, body = data.partition(b"\r\n\r\n")
    for line in header.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return False


def request_head(dep: LocalDeployment, extra: str) -> bytes:
    return (
        f"POST /v1/images/generations HTTP/1.1\r\nHost: {dep.http[7:]}\r\nAuthorization: Bearer {KEYS[0]}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def test_a_declared_oversized_body_is_refused_before_it_is_sent(guarded):
    dep, _ = guarded
    started = time.monotonic()
    status, data = raw_http(dep, request_head(dep, f"Content-Length: {64 << 20}\r\n"), [])  # no body at all
    took = time.monotonic() - started
    assert status == 413, data
    # Answered from the request head alone, at once; a head waiting for the body never would (raw_http
    # gives up after 10 s).
    assert took < 5, f"the 413 came {took:.1f}s after the request head"
    error = json.loads(data.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"], error


def test_an_oversized_chunked_body_is_refused_while_it_streams(guarded):
    dep, _ = guarded
    chunk = b"x" * 16384
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (BODY_LIMIT // len(chunk) + 2)  # the final chunk never comes
    status, data = raw_http(dep, request_head(dep, "Transfer-Encoding: chunked\r\n"), parts)
    assert status == 413, data
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def test_the_head_never_buffers_an_oversized_body_and_keeps_serving(guarded):
    dep, _ = guarded
    pid = dep.head.popen.pid
    before = peak_rss(pid)
    port = int(dep.http.rsplit(":", 1)[1])
    chunk = b"x" * (1 << 20)
    for _ in range(2):  # 64 MiB each, the audit's size
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(request_head(dep, "Transfer-Encoding: chunked\r\n"))
            try:
                for _ in range(64):
                    s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # refused and closed part way: what should happen
                pass
    with dep.client(timeout=30) as c:
        assert c.post("/v1/images/generations", json=SMALL, headers=auth(KEYS[0])).status_code == 200
    grew = peak_rss(pid) - before
    assert grew < 16 << 20, f"the head's peak memory grew by {grew >> 20} MiB"


def test_a_body_under_the_limit_is_served(guarded):
    dep, _ = guarded
    with dep.client(timeout=30) as c:
        body = {**SMALL, "prompt": "y" * 20_000}
        assert c.post("/v1/images/generations", json=body, headers=auth(KEYS[0])).status_code == 200


# --- no input answers 5xx ---------------------------------------------------------------------

JUNK_STRINGS = [
    "", " ", "file:///etc/passwd", "file:", "fail:encoder", "fail:denoiser", "fail:decoder", "../../etc/passwd",
    "\x00", "%00", "画像🌊", "${jndi:ldap://x}", "%s%n", "a" * 30_000, "32x32\n", "-32x32", "0x0", "99999x99999",
    "[" * 5000 + "]" * 5000, "\uff13\uff12x\uff13\uff12",  # JSON nested too deep to parse, as text; fullwidth digits
]  # fmt: skip
JUNK_VALUES: list[Any] = [
    None, True, 0, -1, 1.5, 2**63, 2**64, 10**40, -(10**40), 1e308, [], {}, [1, "a", None],
    {"a": [{"b": {"c": None}}]}, "7",
]  # fmt: skip
RAW_JUNK = ['"\\ud800"', '"x\\udfff"', "NaN", "Infinity", "-Infinity", "1e999", "[" * 5000 + "]" * 5000]


def fuzz_cases(schema: dict[str, Any]) -> list[tuple[str, str, bytes, str | None]]:
    """(method, path, body, field) cases from the OpenAPI schema: every property of every JSON body
    gets wrong types, out-of-range numbers, odd strings and raw JSON oddities, one at a time."""
    components = schema["components"]["schemas"]
    cases: list[tuple[str, str, bytes, str | None]] = []
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            if "$ref" not in ref:
                continue
            model = components[ref["$ref"].rsplit("/", 1)[1]]
            base = {"prompt": "fuzz", "size": "32x32", "num_inference_steps": 2, "seed": 3}
            if "num_frames" in model["properties"]:
                base["num_frames"] = 1
            for field in model["properties"]:
                for value in [*JUNK_STRINGS, *JUNK_VALUES]:
                    cases.append((method, path, json.dumps({**base, field: value}).encode(), field))
                for raw in RAW_JUNK:
                    text = json.dumps({**base, field: "RAW"}).replace('"RAW"', raw)
                    cases.append((method, path, text.encode(), field))
            for whole in (b"", b"null", b"[]", b'"x"', b"{", b"\xff\xfe", b"[" * 5000 + b"]" * 5000, b'{"a":1}'):
                cases.append((method, path, whole, None))
    for junk in [*JUNK_STRINGS[:14], "..", ".hidden", "x" * 5000]:
        q = quote(junk, safe="")
        for path in (f"/v1/videos/{q}", f"/v1/videos/{q}/content", f"/v1/files/images/{q}", f"/v1/files/{q}/x"):
            cases.append(("get", path, b"", None))
        cases.append(("get", f"/v1/videos/x/content?variant={q}", b"", "variant"))
        for param in ("limit", "after", "order"):  # the list of jobs: its query, one junk value at a time
            cases.append(("get", f"/v1/videos?{param}={q}", b"", param))
        cases.append(("delete", f"/v1/videos/{q}", b"", None))
    return cases


def fuzz(dep: LocalDeployment, headers: dict[str, str]) -> None:
    """Every case of fuzz_cases against `dep`: none may answer 5xx; every refusal is an OpenAI-style
    error naming the field it is about."""
    with dep.client(timeout=60) as c:
        schema = c.get("/openapi.json", headers=headers).json()
        cases = fuzz_cases(schema)
        assert 600 < len(cases) < 3000  # bounded, and every field was covered
        failures = []
        for method, path, body, field in cases:
            r = c.request(method, path, content=body, headers={**headers, "Content-Type": "application/json"})
            if r.status_code >= 500:
                failures.append(f"{method} {path[:120]} {body[:80]!r}: {r.status_code} {r.text[:200]}")
                continue
            if r.status_code >= 400:
                error = r.json()["error"]
                named = (
                    field is None
                    or error["param"] == field
                    or (error["param"] == "model" and path == "/v1/videos" and "images" in error["message"])
                    or (error["param"] is None and "body" in error["message"])  # not JSON that parses at all
                )
                if not (error["message"] and named):
                    failures.append(f"{method} {path[:120]} {body[:80]!r}: {r.status_code} not naming {field}: {error}")
        assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures[:20])
        assert c.get("/health").json()["status"] == "ok"


def test_no_input_answers_5xx_and_every_refusal_names_what_is_wrong(guarded):
    dep, _ = guarded
    fuzz(dep, auth(KEYS[0]))


def test_no_video_input_answers_5xx(tiny_models, tmp_path):
    # Video jobs are asynchronous: the valid ones pile up faster than a slow machine runs them, and
    # this test is about input, not the admission bound (tested below), so the bound is out of reach.
    head = ("--max-queued-requests", "100000")
    with deployment(tiny_models["tiny-wan"], tmp_path, simulate=True, worker_flags=INSTANT, head_flags=head) as dep:
        fuzz(dep, {})


# --- admission control ------------------------------------------------------------------------

DENOISE_S = 2.0


def test_beyond_the_bound_requests_get_429_with_retry_after_from_observed_stage_times(flux, tmp_path):
    # One slot per worker (3) + 1 queued: 4 requests in flight; the denoiser takes 2 s per request.
    role_flags = {
        Role.ENCODER: INSTANT,
        Role.DECODER: INSTANT,
        Role.DENOISER: ("--simulate-seconds", str(DENOISE_S), "--simulate-seconds-per-unit", "0"),
    }
    workers = ("--worker-capacity", "1")
    head = ("--max-queued-requests", "1")
    with (
        deployment(flux, tmp_path, simulate=True, worker_flags=workers, role_flags=role_flags, head_flags=head) as dep,
        dep.client(timeout=60) as c,
    ):
        assert c.post("/v1/images/generations", json=SMALL).status_code == 200  # calibrates the denoiser's time
        deadline = time.monotonic() + 5
        while metric(c, "triptych_admission_retry_after_seconds") < DENOISE_S:
            assert time.monotonic() < deadline, "the Retry-After estimate never reflected the observed 2 s"
            time.sleep(0.1)
        admission = c.get("/health").json()["admission"]
        assert admission["worker_slots"] == 3 and admission["max_in_flight"] == 4, admission
        assert metric(c, "triptych_admission_max_in_flight_requests") == 4
        go = threading.Barrier(12)

        def one() -> httpx.Response:
            go.wait(10)
            return c.post("/v1/images/generations", json=SMALL)

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(one) for _ in range(12)]
            in_flight = []
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not all(f.done() for f in futures):
                in_flight.append(c.get("/health").json()["admission"]["in_flight"])
                time.sleep(0.1)
            responses = [f.result(60) for f in futures]
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429}, codes
        assert 4 <= codes.count(200) <= 6 and codes.count(429) >= 6, codes  # a few may arrive once one ended
        assert max(in_flight) <= 4, in_flight
        for r in responses:
            if r.status_code == 429:
                assert_openai_error(r, 429, "overloaded")
                assert DENOISE_S <= int(r.headers["Retry-After"]) <= DENOISE_S + 1, r.headers
        assert metric(c, "triptych_rejected_overloaded_requests_total") == codes.count(429)
        assert c.get("/health").json()["admission"]["in_flight"] == 0


# --- cancellation on disconnect ---------------------------------------------------------------


def test_an_image_client_that_disconnects_leaves_no_work_on_the_workers(flux, tmp_path):
    # A 32x32 step is 1/1024 of a megapixel-step: 0.25 s each, so 100 steps take 25 s and one step 0.25 s.
    per_step = ("--simulate-seconds", "0", "--simulate-seconds-per-unit", str(0.25 * 1024))
    role_flags = {Role.ENCODER: INSTANT, Role.DECODER: INSTANT, Role.DENOISER: per_step}
    # Stopping the abandoned request and reporting it takes about a second (a step, a heartbeat); one
    # left running would hold its worker for the ~20 s of steps still to go.
    bound = 8
    with deployment(flux, tmp_path, simulate=True, role_flags=role_flags) as dep, dep.client(timeout=30) as c:
        body = json.dumps({**SMALL, "num_inference_steps": 100}).encode()
        port = int(dep.http.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            deadline = time.monotonic() + 10
            while metric(c, "triptych_role_running_requests") < 1:
                assert time.monotonic() < deadline, "the request never reached a worker"
                time.sleep(0.05)
            time.sleep(1.0)
        gone = time.monotonic()
        while True:  # within about a second every slot and every pool byte is free again, as the workers report
            workers = [w for ws in c.get("/health").json()["workers"].values() for w in ws]
            if all(
                w["free_slots"] == w["capacity"] and w["free_bytes"] + w["standing_bytes"] == w["pool_bytes"]
                for w in workers
            ):
                break
            assert time.monotonic() - gone < bound, f"work still held {time.monotonic() - gone:.1f}s later: {workers}"
            time.sleep(0.1)
        deadline = time.monotonic() + 5
        while counter(c, "triptych_requests_total", state="CANCELLED") < 1:
            assert time.monotonic() < deadline, "the request was not cancelled"
            time.sleep(0.1)
        assert c.get("/health").json()["admission"]["in_flight"] == 0
        # The denoiser really stopped: a one-step request does not wait behind ~20 s of abandoned steps.
        started = time.monotonic()
        assert c.post("/v1/images/generations", json={**SMALL, "num_inference_steps": 1}).status_code == 200
        took = time.monotonic() - started
        assert took < bound, f"the abandoned request kept the denoiser busy: a one-step request took {took:.1f}s"


def counter(c: httpx.Client, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_in_monolithic_mode_a_disconnected_client_stops_its_request_at_the_next_step(flux, tmp_path):
    heavy = {**SMALL, "size": "256x256", "n": 4}
    with local_monolithic(flux, tmp_path, flags=("--device", "cpu")) as dep, dep.client(timeout=120) as c:

        def generate(body: dict[str, Any], steps: int) -> float:
            started = time.monotonic()
            assert c.post("/v1/images/generations", json={**body, "num_inference_steps": steps}).status_code == 200
            return time.monotonic() - started

        generate(heavy, 1)  # the first request is slower (warm-up)
        per_step = (generate(heavy, 21) - generate(heavy, 1)) / 20  # without what a request costs besides steps
        abandoned_s = 500 * per_step  # how long a request of 500 steps holds the device
        assert abandoned_s > 8, f"500 steps of {per_step * 1e3:.1f} ms are too short to tell"
        body = json.dumps({**heavy, "num_inference_steps": 500}).encode()
        port = int(dep.http.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            time.sleep(1.0)
        # One request at a time on the device: the next one waits for the abandoned one to stop. Stopped
        # at its next step, that is about one step; left running, the rest of its 500 steps (less the
        # 1 s slept). A quarter of those, measured under the same load, tells the two apart.
        took = generate(SMALL, 1)
        assert took < abandoned_s / 4, f"the abandoned request kept the pipeline busy: {took:.1f}s for one step"
