"""TriptychClient's retries (triptych/client.py): a generation POST carries an Idempotency-Key and is
sent again, with the same key, when its connection broke, when a proxy answered 502/503/504, and
after a 429/409's Retry-After; a connection refused moves on to the next URL; a request that timed
out and a 4xx without Retry-After are not sent again; a stream cut midway is, under its key. Against real HTTP servers
on loopback that answer from a script (one action per request)."""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from triptych.client import ClientError, TriptychClient

PNG = b"\x89PNG pretend"
IMAGES = {"data": [{"b64_json": base64.b64encode(PNG).decode()}]}


class Script:
    def __init__(self, actions: list[Any]) -> None:
        self.actions = list(actions)
        self.seen: list[dict[str, Any]] = []  # each request: method, path, headers


@contextmanager
def server(*actions: Any) -> Iterator[tuple[str, Script]]:
    """An HTTP server answering its i-th request with actions[i]: "drop" (close without an answer),
    "hang" (answer nothing for 2 s), (status, headers, body) or a body for 200."""
    script = Script(list(actions))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            self.rfile.read(length)
            script.seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers)})
            action = script.actions.pop(0) if script.actions else (500, {}, {"error": {"message": "script ran out"}})
            if action == "drop":
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            if action == "hang":
                threading.Event().wait(2)
                return
            status, headers, body = action if isinstance(action, tuple) else (200, {}, action)
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", script
    finally:
        httpd.shutdown()
        httpd.server_close()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once it is closed


def client(urls: Any, **kwargs: Any) -> tuple[TriptychClient, list[float]]:
    slept: list[float] = []
    return TriptychClient(urls, retries=kwargs.pop("retries", 3), sleep=slept.append, **kwargs), slept


def keys(script: Script) -> list[str | None]:
    return [seen["headers"].get("Idempotency-Key") for seen in script.seen]


def test_a_connection_broken_under_a_request_is_sent_again_with_the_same_key() -> None:
    with server("drop", IMAGES) as (url, script):
        c, slept = client(url)
        assert c.generate_images({"prompt": "x"}) == [PNG]
    assert len(script.seen) == 2 and keys(script)[0] is not None and keys(script)[0] == keys(script)[1]
    assert slept == [0.5]  # one URL: the same one again after a backoff


def test_a_refused_connection_moves_on_to_the_next_url_at_once_and_stays_there() -> None:
    with server(IMAGES, IMAGES) as (url, script):
        c, slept = client([closed_port(), url])
        assert c.generate_images({"prompt": "x"}) == [PNG]
        assert c.url == url
        assert c.generate_images({"prompt": "y"}) == [PNG]  # straight to the URL that answered
    assert slept == [] and len(script.seen) == 2
    assert keys(script)[0] != keys(script)[1], "every call has a key of its own"


def test_a_proxy_whose_head_went_away_and_a_retry_after_are_waited_for() -> None:
    overloaded = (429, {"Retry-After": "2"}, {"error": {"message": "overloaded"}})
    in_progress = (409, {"Retry-After": "1"}, {"error": {"message": "idempotency_key_in_progress"}})
    with server((503, {}, b"no endpoints"), overloaded, in_progress, IMAGES) as (url, script):
        c, slept = client(url)
        assert c.create_video({"prompt": "x"}) == IMAGES
    assert slept == [0.5, 2.0, 1.0] and len(set(keys(script))) == 1 and len(script.seen) == 4


def test_the_caller_s_key_is_the_one_sent() -> None:
    with server("drop", IMAGES) as (url, script):
        c, _ = client(url)
        c.generate_images({"prompt": "x"}, idempotency_key="order-17")
    assert keys(script) == ["order-17", "order-17"]


@pytest.mark.parametrize(
    "answer",
    [
        (400, {}, {"error": {"message": "size: 7x7 is not a multiple of 16"}}),
        (429, {}, {"error": {"message": "no Retry-After"}}),
        (429, {"Retry-After": "3600"}, {"error": {"message": "an hour"}}),
    ],
)
def test_an_error_without_a_usable_retry_after_is_raised_at_once(answer: Any) -> None:
    with server(answer, IMAGES) as (url, script):
        c, slept = client(url)
        with pytest.raises(ClientError, match=f"^{answer[0]}: {answer[2]['error']['message']}"):
            c.generate_images({"prompt": "x"})
    assert len(script.seen) == 1 and slept == []


def test_retries_are_bounded_and_the_error_names_every_attempt() -> None:
    with server("drop", "drop", "drop", IMAGES) as (url, script):
        c, slept = client([url, closed_port()], retries=2)
        with pytest.raises(ClientError, match=r"^cannot reach .*Connect.* \(3 attempts\)$") as error:
            c.generate_images({"prompt": "x"})
    assert len(script.seen) == 2 and slept == [0.5]
    assert url in str(error.value)


def test_a_request_that_timed_out_is_not_sent_again() -> None:
    with server("hang", IMAGES) as (url, script):
        c, _ = client(url, timeout=0.5)
        with pytest.raises(ClientError, match="cannot reach"):
            c.generate_images({"prompt": "x"})
    assert len(script.seen) == 1


def test_no_retries_means_no_key_and_one_try() -> None:
    with server("drop", IMAGES) as (url, script):
        c, _ = client(url, retries=0)
        with pytest.raises(ClientError):
            c.generate_images({"prompt": "x"})
    assert keys(script) == [None]


SSE = {"Content-Type": "text/event-stream"}
STEP = b'event: step\ndata: {"step": 1, "total_steps": 2}\n\n'
COMPLETED = b'event: completed\ndata: {"data": []}\n\n'


def test_a_streamed_request_cut_midway_is_sent_again_under_its_key_to_the_next_head() -> None:
    with server((200, SSE, STEP)) as (first, cut), server((200, SSE, STEP + COMPLETED)) as (second, script):
        c, slept = client([first, second])
        events = [e.event for e in c.stream_images({"prompt": "x"})]
    assert events == ["step", "step", "completed"]  # the progress again, from the run that took it over
    assert keys(cut)[0] is not None and keys(cut) == keys(script), "the same key on both heads"
    assert slept == [] and script.seen[0]["path"] == "/v1/images/generations"


def test_a_streamed_request_whose_run_still_goes_waits_its_retry_after_and_asks_the_same_head() -> None:
    in_progress = (409, {"Retry-After": "3"}, {"error": {"message": "still running"}})
    with server(in_progress, (200, SSE, COMPLETED)) as (url, script):
        c, slept = client([url, closed_port()])
        assert [e.event for e in c.stream_images({"prompt": "x"}, idempotency_key="k-9")] == ["completed"]
    assert slept == [3.0] and keys(script) == ["k-9", "k-9"]


def test_without_retries_a_stream_has_no_key_and_one_try() -> None:
    with server("drop") as (url, script):
        c, _ = client([url, closed_port()], retries=0)
        with pytest.raises(ClientError, match="lost the connection"):
            list(c.stream_images({"prompt": "x"}))
    assert keys(script) == [None]


def test_a_job_s_events_cut_midway_are_followed_again_from_another_head() -> None:
    step = b'event: step\ndata: {"step": 1, "total_steps": 2}\n\n'
    done = b'event: completed\ndata: {"id": "vid_1"}\n\n'
    with server((200, {"Content-Type": "text/event-stream"}, step)) as (first, _):
        with server((200, {"Content-Type": "text/event-stream"}, step + done)) as (second, script):
            c, _ = client([first, second])
            events = [e.event for e in c.video_events("vid_1")]
    assert events == ["step", "step", "completed"]  # the first stream ended without the job's end
    assert script.seen[0]["path"] == "/v1/videos/vid_1/events"


def step(n: int, total: int = 10) -> bytes:
    return (
        f'event: step\ndata: {{"id": "vid_1", "state": "denoising", "step": {n}, "total_steps": {total}}}\n\n'.encode()
    )


def test_a_long_job_followed_across_more_cuts_than_retries_is_followed_to_its_end() -> None:
    """Each connection brings new steps, then is cut (a rolling update draining head after head): the
    retries bound failures in a row, not the cuts of a job's whole life."""
    cuts = [(200, SSE, b"".join(step(n) for n in range(1, k + 1))) for k in (2, 4, 6, 8)]
    last = (200, SSE, b"".join(step(n) for n in range(1, 11)) + COMPLETED)
    with server(*cuts, last) as (url, script):
        c, _ = client([url], retries=3)
        events = list(c.video_events("vid_1"))
    assert events[-1].event == "completed" and len(script.seen) == 5
    assert max(e.data.get("step") or 0 for e in events) == 10


def test_a_job_whose_streams_bring_nothing_new_is_given_up_on_with_every_failure_named() -> None:
    """A connection that replays what was seen, then is cut, is a failure; out of retries the caller
    gets a ClientError naming them, not an iterator that just ends."""
    replay = (200, SSE, step(1) + step(2))
    with server(replay, replay, replay, replay, replay) as (url, script):
        c, _ = client([url], retries=3)
        seen = []
        with pytest.raises(
            ClientError, match=r"the progress stream ended without a result: .*ended before its result.*"
        ):
            for event in c.video_events("vid_1"):
                seen.append(event)
    assert len(script.seen) == 4  # the first try and 3 retries: the replays brought nothing new
    assert [e.data["step"] for e in seen][:2] == [1, 2]


def error_event(status: int, code: str, message: str) -> bytes:
    error = json.dumps({"id": "img_1", "error": {"message": message, "status": status, "code": code}})
    return f"event: error\ndata: {error}\n\n".encode()


def test_a_streamed_request_whose_head_stopped_under_it_is_sent_again_under_its_key() -> None:
    """An error event saying the head shut down under the run (503 head_shut_down: the key's failed
    attempt runs again elsewhere) is retried like the same answer without streaming, on the next
    head; an error event of another status is the request's end."""
    stopped = error_event(503, "head_shut_down", "the head shut down before this request finished; retry it")
    with server((200, SSE, STEP + stopped)) as (first, cut), server((200, SSE, STEP + COMPLETED)) as (second, again):
        c, _ = client([first, second])
        events = [e.event for e in c.stream_images({"prompt": "x"})]
    assert events == ["step", "step", "completed"]  # the 503 is not the caller's: it was retried
    assert keys(cut)[0] is not None and keys(cut) == keys(again)

    refused = error_event(400, "failed", "loras: no such adapter")
    with server((200, SSE, refused)) as (url, script):
        c, _ = client([url, closed_port()])
        events = list(c.stream_images({"prompt": "x"}))
    assert [e.event for e in events] == ["error"] and len(script.seen) == 1


def test_a_failure_the_head_decided_is_not_run_again_and_lost_runs_are_bounded_by_retries() -> None:
    """A deadline that passed (504 timed_out) or a role without an instance (503 failed) would fail the
    same way again: the caller gets it at once. Runs the head stopped under are sent again at most
    `retries` times in all, however far each got (new steps forgive cut streams, not lost runs)."""
    for status, code in ((504, "timed_out"), (503, "failed")):
        with server((200, SSE, STEP + error_event(status, code, "no"))) as (url, script):
            c, _ = client([url], retries=3)
            events = list(c.stream_images({"prompt": "x"}))
        assert [e.event for e in events][-1] == "error" and len(script.seen) == 1, (status, code)

    stopped = error_event(503, "head_shut_down", "the head shut down; retry it")
    runs = [(200, SSE, b"".join(step(n) for n in range(1, k + 1)) + stopped) for k in range(1, 10)]
    with server(*runs) as (url, script):
        c, _ = client([url], retries=3)
        events = list(c.stream_images({"prompt": "x"}))
    assert events[-1].event == "error" and len(script.seen) == 4  # the first run and 3 retries, not 9


def test_bad_settings_are_named() -> None:
    with pytest.raises(ClientError, match="url: give the head's HTTP URL"):
        TriptychClient(" , ")
    with pytest.raises(ClientError, match="retries: -1 must be >= 0"):
        TriptychClient("http://127.0.0.1:1", retries=-1)


def test_a_video_whose_content_redirects_to_the_bucket_is_saved_from_there_and_whole(tmp_path) -> None:
    """A head that presigns content (--results-presign) answers 307 to the bucket: the client follows
    it (the API key stays with the head's origin) and writes the MP4, never the redirect's empty body."""
    mp4 = b"\x00\x00\x00\x18ftypisom pretend"
    with server(mp4) as (bucket, at_bucket):
        moved = (307, {"Location": f"{bucket}/videos/video_x.mp4?X-Amz-Signature=abc"}, b"")
        with server(moved) as (head, _):
            client = TriptychClient(head, api_key="sk-secret")
            out = tmp_path / "out.mp4"
            assert client.save_video("video_x", out) == len(mp4)
            client.close()
    assert out.read_bytes() == mp4 and not list(tmp_path.glob(".*partial"))
    (fetched,) = at_bucket.seen
    assert fetched["path"] == "/videos/video_x.mp4?X-Amz-Signature=abc"
    assert "Authorization" not in fetched["headers"]  # another origin: the key is not sent there


def test_a_failed_download_leaves_no_file_under_the_name_asked(tmp_path) -> None:
    with server((404, {}, {"error": {"message": "the frames were removed"}})) as (head, _):
        client = TriptychClient(head)
        with pytest.raises(ClientError, match="404"):
            client.save_video("video_x", tmp_path / "out.mp4")
        client.close()
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_a_head_has_not_answered_is_one_line_and_exit_130(tmp_path) -> None:
    import signal
    import subprocess
    import sys
    import time

    with server("hang", "hang", "hang") as (head, script):
        proc = subprocess.Popen(
            [sys.executable, "-m", "triptych", "generate", "a fox", "-o", str(tmp_path / "fox.png"), "--url", head],
            stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not script.seen and time.monotonic() < deadline:  # the request is with the "head"
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()  # nothing once it has exited
            proc.wait(timeout=30)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err, err
