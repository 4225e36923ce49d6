"""Idempotency-Key: a retried request answers its first run, whichever head it reaches, and two
runs of one key never go at once; a different body under the key, or a bad key, is refused."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from tests.api.test_http_api import ScriptedBackend, make_client
from tests.api.test_progress_api import events
from triptych.client import iter_sse
from triptych_head.backend import GenerationFailed

IMAGE = {"prompt": "a cat", "size": "32x32"}


def _key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": value}


def test_a_retry_with_the_same_key_gets_the_first_answer_without_a_second_run(tmp_path):
    backend = ScriptedBackend()
    with make_client(backend, tmp_path, kind="image") as c:
        first = c.post("/v1/images/generations", json=IMAGE, headers=_key("k-1"))
        again = c.post("/v1/images/generations", json=IMAGE, headers=_key("k-1"))
        other = c.post("/v1/images/generations", json=IMAGE, headers=_key("k-2"))
        plain = c.post("/v1/images/generations", json=IMAGE)
        assert "triptych_idempotent_replays_total 1.0" in c.get("/metrics").text
    assert first.status_code == again.status_code == other.status_code == plain.status_code == 200
    assert again.content == first.content and again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert len(backend.calls) == 3  # k-1 once, k-2 once, the request without a key


def test_retries_at_once_through_two_heads_make_exactly_one_run(tmp_path):
    backends = [ScriptedBackend(), ScriptedBackend()]
    for b in backends:
        b.step_delay = 0.1  # the first run is still going when the others arrive
    with make_client(backends[0], tmp_path, kind="image") as a, make_client(backends[1], tmp_path, kind="image") as b:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda c: c.post("/v1/images/generations", json=IMAGE, headers=_key("once")),
                                    [a, b, a, b, a, b]))  # fmt: skip
        later = b.post("/v1/images/generations", json=IMAGE, headers=_key("once"))
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    assert len(backends[0].calls) + len(backends[1].calls) == 1
    assert {r.content for r in [*answers, later]} == {answers[0].content}
    assert sum(r.headers.get("Idempotent-Replayed") == "true" for r in answers) == 5


def test_a_failed_run_is_run_again_by_the_retry(tmp_path):
    backend = ScriptedBackend()
    backend.fail = GenerationFailed("the decoder died", 503)
    with make_client(backend, tmp_path, kind="image") as c:
        failed = c.post("/v1/images/generations", json=IMAGE, headers=_key("retry-me"))
        backend.fail = None
        ok = c.post("/v1/images/generations", json=IMAGE, headers=_key("retry-me"))
        replay = c.post("/v1/images/generations", json=IMAGE, headers=_key("retry-me"))
    assert failed.status_code == 503 and ok.status_code == 200, (failed.text, ok.text)
    assert replay.content == ok.content and len(backend.calls) == 2


def test_a_video_job_is_made_once_per_key(tmp_path):
    body = {"prompt": "waves", "size": "32x16", "num_frames": 5, "num_inference_steps": 2}
    backend = ScriptedBackend()
    with make_client(backend, tmp_path) as c:
        first = c.post("/v1/videos", json=body, headers=_key("video-1"))
        again = c.post("/v1/videos", json=body, headers=_key("video-1"))
        assert first.json()["id"] == again.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
        assert len(c.get("/v1/videos").json()["data"]) == 1
    assert len(backend.calls) == 1


def test_the_key_with_another_body_is_a_422_naming_the_header(tmp_path):
    with make_client(ScriptedBackend(), tmp_path, kind="image") as c:
        assert c.post("/v1/images/generations", json=IMAGE, headers=_key("k")).status_code == 200
        r = c.post("/v1/images/generations", json={**IMAGE, "prompt": "a dog"}, headers=_key("k"))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == "Idempotency-Key" and error["code"] == "idempotency_key_reused"


@pytest.mark.parametrize("key", ["has space", "x" * 256])
def test_a_key_that_cannot_be_one_is_a_400_naming_the_header(tmp_path, key):
    backend = ScriptedBackend()
    with make_client(backend, tmp_path, kind="image") as c:
        r = c.post("/v1/images/generations", json=IMAGE, headers=_key(key))
        s = c.post("/v1/images/generations", json={**IMAGE, "stream": True}, headers=_key(key))
    for answer in (r, s):
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "Idempotency-Key", answer.text
    assert backend.calls == []


STREAMED = {**IMAGE, "num_inference_steps": 3, "stream": True}


def test_a_streamed_request_s_retry_gets_its_completed_event_alone_without_a_second_run(tmp_path):
    backend = ScriptedBackend()
    with make_client(backend, tmp_path, kind="image") as c:
        first = events(c, "POST", "/v1/images/generations", json=STREAMED, headers=_key("s-1"))
        with c.stream("POST", "/v1/images/generations", json=STREAMED, headers=_key("s-1")) as r:
            assert r.headers["Idempotent-Replayed"] == "true" and r.headers["content-type"].startswith("text/event")
            again = list(iter_sse(r.iter_lines()))
        assert "triptych_idempotent_replays_total 1.0" in c.get("/metrics").text
        plain = c.post("/v1/images/generations", json=IMAGE, headers=_key("s-1"))  # not the same request
    assert [e.event for e in first] == ["step", "step", "step", "completed"]
    assert [(e.event, e.data) for e in again] == [("completed", first[-1].data)]  # its id and images too
    assert len(backend.calls) == 1
    assert plain.status_code == 422 and plain.json()["error"]["code"] == "idempotency_key_reused", plain.text


def test_a_streamed_run_that_failed_is_run_again_and_one_refused_is_an_http_error(tmp_path):
    backend = ScriptedBackend()
    backend.fail = GenerationFailed("the decoder died", 503)
    with make_client(backend, tmp_path, kind="image") as c:
        failed = events(c, "POST", "/v1/images/generations", json=STREAMED, headers=_key("s-2"))
        backend.fail = None
        ok = events(c, "POST", "/v1/images/generations", json=STREAMED, headers=_key("s-2"))
        c.app.state.ctx.draining = True  # type: ignore[attr-defined]
        refused = c.post("/v1/images/generations", json=STREAMED, headers=_key("s-3"))
        assert c.get("/health").json()["admission"]["in_flight"] == 0
    assert failed[-1].event == "error" and failed[-1].data["error"]["status"] == 503
    assert [e.event for e in ok][-1] == "completed" and len(backend.calls) == 2
    assert refused.status_code == 503 and refused.headers["content-type"].startswith("application/json")


def test_streamed_retries_at_once_through_two_heads_make_one_run_and_each_ends_completed(tmp_path):
    backends = [ScriptedBackend(), ScriptedBackend()]
    for b in backends:
        b.step_delay = 0.1
    with make_client(backends[0], tmp_path, kind="image") as a, make_client(backends[1], tmp_path, kind="image") as b:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda c: events(c, "POST", "/v1/images/generations", json=STREAMED,
                                                 headers=_key("s-once")), [a, b, a, b]))  # fmt: skip
    assert len(backends[0].calls) + len(backends[1].calls) == 1
    assert {e[-1].event for e in got} == {"completed"}
    assert len({str(e[-1].data) for e in got}) == 1, "every stream ends with the one run's answer"
    assert sorted(len(e) for e in got) == [1, 1, 1, 4]  # the run's steps, and three replays


def test_a_streamed_run_whose_client_went_away_is_cancelled_and_run_again_by_the_retry(tmp_path):
    backend = ScriptedBackend()
    backend.step_delay = 0.2
    body = {**STREAMED, "num_inference_steps": 20}
    with make_client(backend, tmp_path, kind="image") as c:
        with c.stream("POST", "/v1/images/generations", json=body, headers=_key("s-4")) as r:
            first = next(iter_sse(r.iter_lines()))  # one step, then the client hangs up
        deadline = time.monotonic() + 10
        while c.get("/health").json()["admission"]["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        backend.step_delay = 0.0
        again = events(c, "POST", "/v1/images/generations", json=body, headers=_key("s-4"))
    assert first.event == "step"
    assert again[-1].event == "completed" and len(backend.calls) == 2


def test_a_run_still_going_after_the_wait_is_a_409_to_retry(tmp_path):
    backend = ScriptedBackend()
    backend.step_delay = 0.5
    with make_client(backend, tmp_path, kind="image") as c:
        c.app.state.ctx.idempotency_wait_s = 0.3  # type: ignore[attr-defined]
        body = {**IMAGE, "num_inference_steps": 4}
        first = threading.Thread(
            target=c.post, args=("/v1/images/generations",), kwargs={"json": body, "headers": _key("slow")}
        )
        first.start()
        while not backend.calls:
            threading.Event().wait(0.02)
        r = c.post("/v1/images/generations", json=body, headers=_key("slow"))
        first.join(10)
    assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_in_progress", r.text
    assert r.headers["Retry-After"] and len(backend.calls) == 1


def test_a_field_at_its_default_does_not_change_a_request_s_fingerprint():
    """A retry through a head of the next release, which added a field (output_format, say) at a
    default that means "as before": its body dumped with the new field gave another fingerprint,
    and the retry got 422 idempotency_key_reused instead of the first run's answer."""
    from triptych.contract import CONTRACT, IMAGES
    from triptych_head.api.idempotent import fingerprint
    from triptych_head.api.schemas import request_model

    dumped = request_model("Images", IMAGES).model_validate(IMAGE).model_dump()  # every field, defaults too
    before = {k: v for k, v in dumped.items() if k not in ("output_format", "output_compression")}  # older release
    assert fingerprint(IMAGES, dumped) == fingerprint(IMAGES, before) == fingerprint(IMAGES, IMAGE)
    assert CONTRACT["n"].default_for(IMAGES) == 1
    assert fingerprint(IMAGES, {**IMAGE, "n": 1}) == fingerprint(IMAGES, IMAGE)  # given as the default: the same
    assert fingerprint(IMAGES, {**IMAGE, "n": 2}) != fingerprint(IMAGES, IMAGE)
    assert fingerprint(IMAGES, {**IMAGE, "output_format": "jpeg"}) != fingerprint(IMAGES, IMAGE)
