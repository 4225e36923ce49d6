"""--log-format (triptych/log_format.py): a JSON object per line with the record's fields; text as before."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from triptych.log_format import FIELDS, JsonFormatter


def record(message: str, *args: object, exc: bool = False, **extra: object) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("no such adapter")
        except ValueError:
            exc_info = sys.exc_info()
    made = logging.LogRecord("triptych_head.core", logging.WARNING, __file__, 1, message, args, exc_info)
    made.__dict__.update(extra)
    made.created, made.msecs = 1796571612.279, 279.0
    return made


def test_a_record_is_one_json_object_on_one_line() -> None:
    line = JsonFormatter("server").format(record("request %s failed:\nsecond line", "img_1"))
    assert "\n" not in line
    assert json.loads(line) == {
        "time": "2026-12-06T15:40:12.279Z",
        "level": "WARNING",
        "process": "server",
        "logger": "triptych_head.core",
        "message": "request img_1 failed:\nsecond line",
    }


def test_an_exception_is_one_field_and_structured_fields_sit_beside_the_record_s_own() -> None:
    fields = {FIELDS: {"http": {"status": 500, "path": "/v1/x"}, "message": "not this", "level": "not this"}}
    parsed = json.loads(JsonFormatter("denoiser rank 1").format(record("boom", exc=True, **fields)))
    assert parsed["exception"].startswith("Traceback") and "ValueError: no such adapter" in parsed["exception"]
    assert parsed["http"] == {"status": 500, "path": "/v1/x"}
    assert (parsed["message"], parsed["level"], parsed["process"]) == ("boom", "WARNING", "denoiser rank 1")


def test_a_value_json_cannot_write_is_written_as_its_text() -> None:
    parsed = json.loads(JsonFormatter("encoder").format(record("x", **{FIELDS: {"where": Path("/models/flux")}})))
    assert parsed["where"] == "/models/flux"


def test_a_line_about_one_request_names_it_as_a_field() -> None:
    from triptych_head.api.context import new_request_id

    ids = [new_request_id(prefix) for prefix in ("img", "video", "req")]
    for request_id in ids:  # what the head makes is what the formatter recognizes
        parsed = json.loads(JsonFormatter("server").format(record("request %s %s: %s", request_id, "FAILED", "boom")))
        assert parsed["request_id"] == request_id and parsed["message"] == f"request {request_id} FAILED: boom"
    for args in (("img_nothex",), ("an img_" + "a" * 32 + " inside a string",), (7,)):
        assert "request_id" not in json.loads(JsonFormatter("server").format(record("x %s", *args)))


def test_a_line_logged_while_serving_a_request_names_it_though_its_arguments_do_not() -> None:
    import asyncio
    import threading

    from triptych.log_format import about

    request_id = "img_" + "a" * 32
    formatted = lambda: json.loads(JsonFormatter("server").format(record("stage failed")))  # noqa: E731
    with about(request_id):
        assert formatted()["request_id"] == request_id
        with about(None):  # a batch of several: no one request's
            assert "request_id" not in formatted()
        other: list[dict[str, object]] = []
        thread = threading.Thread(target=lambda: other.append(formatted()))  # another thread serves another
        thread.start()
        thread.join()
        assert "request_id" not in other[0]
    assert "request_id" not in formatted()

    async def two_requests() -> list[object]:
        async def serve(rid: str) -> object:
            with about(rid):
                await asyncio.sleep(0.01)  # the other task runs meanwhile
                return formatted()["request_id"]

        return list(await asyncio.gather(serve("video_" + "b" * 32), serve("video_" + "c" * 32)))

    assert asyncio.run(two_requests()) == ["video_" + "b" * 32, "video_" + "c" * 32]


def test_a_line_that_names_its_request_is_about_that_one_and_no_argument_of_it() -> None:
    """The access log names the head's id (or none) itself: an argument that looks like an id (a
    client's X-Request-Id) and the request being served are not read in its stead."""
    from triptych.log_format import NAMED, about

    client_said, served, head_gave = ("img_" + c * 32 for c in "abc")
    with about(served):
        unnamed = json.loads(JsonFormatter("server").format(record("ref=%s", client_said, **{NAMED: None})))
        named = json.loads(JsonFormatter("server").format(record("ref=%s", client_said, **{NAMED: head_gave})))
    assert "request_id" not in unnamed, unnamed
    assert named["request_id"] == head_gave, named
