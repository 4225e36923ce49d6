"""How a process writes its log lines to stderr: `--log-format text` (the default) or `json`.

text: `2026-12-06 15:20:12,279 INFO [server] triptych_head.shutdown: HTTP API on http://...`
json: one object per line, for a log pipeline (Loki, Elasticsearch, Cloud Logging) to read fields from:

    {"time": "2026-12-06T15:20:12.279Z", "level": "INFO", "process": "server",
     "logger": "triptych_head.shutdown", "message": "HTTP API on http://..."}

with `exception` (the traceback, one string) when the line carries one, and the record's structured
fields beside them: a call passes `extra={FIELDS: {...}}` (the access log's `http` object). Every
line of the process is one of these, uvicorn's included (it logs through the same handler).
Mooncake's engine writes its own lines from C++, in its own format.
"""

from __future__ import annotations

import json
import logging
import time

TEXT = "text"
JSON = "json"
FORMATS = (TEXT, JSON)
FIELDS = "fields"  # a record's structured fields: log.info(..., extra={FIELDS: {"http": {...}}})
_OWN = ("time", "level", "process", "logger", "message", "exception")


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
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):
            line.update((key, value) for key, value in fields.items() if key not in _OWN)
        return json.dumps(line, default=str, ensure_ascii=False)


def configure(level: str, log_format: str, process: str) -> None:
    """The root logger's one handler, on stderr: `process` names the process in every line ("server",
    "denoiser rank 1")."""
    handler = logging.StreamHandler()
    if log_format == JSON:
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
