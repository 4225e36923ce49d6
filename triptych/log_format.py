"""How a process writes its log lines to stderr: `--log-format text` (the default) or `json`.

text: `2026-12-06 15:20:12,279 INFO [server] triptych_head.shutdown: HTTP API on http://...`
json: one object per line, for a log pipeline (Loki, Elasticsearch, Cloud Logging) to read fields from:

    {"time": "2026-12-06T15:20:12.279Z", "level": "INFO", "process": "server",
     "logger": "triptych_head.shutdown", "message": "HTTP API on http://..."}

with `exception` (the traceback, one string) when the line carries one, `request_id` when the line
is about one request (the id the head gave it, as `X-Request-Id` says it: the one its call names
(`NAMED`, the access log's), or else named among the line's arguments, or else the request the
code that logs it serves, `about()`: the head's handling of an image request and its video job's
run, a worker's computing of one request), and the record's
structured fields beside them: a call
passes `extra={FIELDS: {...}}` (the access log's `http` object). Every line of the process is one of
these, uvicorn's included (it logs through the same handler). Mooncake's engine writes its own
lines from C++, in its own format.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Iterator
from contextvars import ContextVar

TEXT = "text"
JSON = "json"
FORMATS = (TEXT, JSON)
FIELDS = "fields"  # a record's structured fields: log.info(..., extra={FIELDS: {"http": {...}}})
# The request a line is about, named by its caller: log.info(..., extra={NAMED: id or None}). Its
# `request_id` is that one (None: none), never an argument that looks like an id: the access log's
# arguments hold a client's X-Request-Id, which may be another request's.
NAMED = "triptych_named_request"
_OWN = ("time", "level", "process", "logger", "message", "exception", "request_id")
# A request's id as the head makes it (triptych_head.api.context.new_request_id): img_, video_ or req_
# and 32 hex digits, distinct enough to be recognized among a line's arguments.
REQUEST_ID = re.compile(r"(?:img|video|req)_[0-9a-f]{32}")
# The request the running code serves: a task's own in the head (asyncio copies it into the tasks it
# starts), a thread's own in a worker.
_SERVING: ContextVar[str | None] = ContextVar("triptych_request_id", default=None)


@contextlib.contextmanager
def about(request_id: str | None) -> Iterator[None]:
    """The lines logged inside are about `request_id` (None: about no one request, a batch)."""
    token = _SERVING.set(request_id)
    try:
        yield
    finally:
        _SERVING.reset(token)


class JsonFormatter(logging.Formatter):
    """A record as one JSON object on one line (json.dumps escapes line breaks in the message)."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line: dict[str, object] = {
            "time": f"{seconds}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "process": self.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if hasattr(record, NAMED):
            request_id = getattr(record, NAMED)
        else:
            request_id = _request_id(record.args) or _SERVING.get()
        if isinstance(request_id, str):
            line["request_id"] = request_id
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):
            line.update((key, value) for key, value in fields.items() if key not in _OWN)
        return json.dumps(line, default=str, ensure_ascii=False)


def _request_id(args: object) -> str | None:
    """The first of a record's arguments that is a request's id."""
    if isinstance(args, tuple):
        return next((a for a in args if isinstance(a, str) and REQUEST_ID.fullmatch(a)), None)
    return None


def configure(level: str, log_format: str, process: str) -> None:
    """The root logger's one handler, on stderr: `process` names the process in every line ("server",
    "denoiser rank 1")."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(log_format, process))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def formatter(log_format: str, process: str) -> logging.Formatter:
    if log_format == JSON:
        return JsonFormatter(process)
    return logging.Formatter(f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s")
