"""--access-log: a line per HTTP request as its answer ends (head/triptych_head/api/access_log.py),
the key's and body limit's refusals included; probes only when they fail; one line whatever the path."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend
from tests.api.test_request_ids import BODY, IMAGES, MODEL
from triptych_head.api.app import create_app
from triptych_head.api.auth import APIKeys
from triptych_head.api.context import HeadContext

LINE = re.compile(
    r'(?P<client>\S+) "(?P<method>\S+) (?P<path>\S+)" (?P<status>\d+) (?P<s>[\d.]+)s '
    r"id=(?P<id>\S+) owner=(?P<owner>\S+) ref=(?P<ref>\S+)"
)


def head(tmp_path: Path, access_log: bool = True, keys: str | None = None, max_bytes: int = 1 << 20) -> TestClient:
    api_keys = None
    if keys is not None:
        (tmp_path / "keys").write_text(keys)
        api_keys = APIKeys(tmp_path / "keys")
    ctx = HeadContext(
        ScriptedBackend(), MODEL, tmp_path, CollectorRegistry(), api_keys=api_keys, access_log=access_log,
        max_request_bytes=max_bytes,
    )  # fmt: skip
    return TestClient(create_app(ctx))


def lines(caplog: pytest.LogCaptureFixture) -> list[re.Match[str]]:
    records = [r for r in caplog.records if r.name == "triptych_head.access"]
    found = [LINE.fullmatch(r.getMessage()) for r in records]
    assert all(found), [r.getMessage() for r in records]
    return [m for m in found if m is not None]


def test_each_request_is_one_line_with_its_status_seconds_and_id(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "triptych_head.access")
    with head(tmp_path) as c:
        ok = c.post(IMAGES, json=BODY, headers={"X-Request-Id": 'ingress 7f3a\t"x"'})
        bad = c.post(IMAGES, json={**BODY, "size": "big"})
        with c.stream("POST", IMAGES, json={**BODY, "stream": True}) as streamed:
            streamed.read()
        missing = c.get("/v1/no-such-route?token=secret")
        c.get("/health")
        c.get("/metrics")
    logged = lines(caplog)
    assert [(m["method"], m["path"], m["status"]) for m in logged] == [
        ("POST", IMAGES, "200"),
        ("POST", IMAGES, "400"),
        ("POST", IMAGES, "200"),
        ("GET", "/v1/no-such-route", "404"),  # the query is not logged: it may carry a signature
    ], "probes and scrapes that answered are not logged"
    assert logged[0]["id"] == ok.headers["x-request-id"] and logged[2]["id"] == streamed.headers["x-request-id"]
    assert logged[1]["id"] == "-" and bad.status_code == 400 and missing.status_code == 404
    assert all(m["owner"] == "-" and float(m["s"]) >= 0 for m in logged)
    assert logged[0]["ref"] == "ingress%207f3a%09%22x%22" and logged[1]["ref"] == "-"  # the one it came with


def test_the_key_and_body_limit_refusals_are_logged_with_the_owner_never_the_key(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "triptych_head.access")
    with head(tmp_path, keys="sk-acme-1 tenant=acme\n", max_bytes=2048) as c:
        assert c.post(IMAGES, json=BODY).status_code == 401
        key = {"Authorization": "Bearer sk-acme-1"}
        assert c.post(IMAGES, json={**BODY, "prompt": "x" * 4096}, headers=key).status_code == 413
        assert c.post(IMAGES, json=BODY, headers=key).status_code == 200
    logged = lines(caplog)
    assert [(m["status"], m["owner"]) for m in logged] == [("401", "-"), ("413", "tenant:acme"), ("200", "tenant:acme")]
    assert not any("sk-acme" in r.getMessage() for r in caplog.records)


def test_a_path_with_a_line_break_or_quote_stays_one_line(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "triptych_head.access")
    with head(tmp_path) as c:
        c.get('/v1/videos/x%0A127.0.0.1 "GET /forged" 200 0.001s id=- owner=-%22')
    (line,) = lines(caplog)
    assert "\n" not in line.string and '"' not in line["path"], line.string


def test_an_image_url_s_secret_part_is_not_logged(tmp_path: Path, caplog) -> None:
    """Its random part lets whoever holds the URL fetch the image: a log reader must not learn it."""
    caplog.set_level(logging.INFO, "triptych_head.access")
    with head(tmp_path) as c:
        url = c.post(IMAGES, json={**BODY, "response_format": "url"}).json()["data"][0]["url"]
        assert c.get(url).status_code == 200
    secret = url.rsplit("-", 1)[1].split(".")[0]
    fetched = [m for m in lines(caplog) if m["method"] == "GET"]
    assert [m["path"] for m in fetched] == [url.rsplit("-", 1)[0].removeprefix("http://testserver") + "-REDACTED.png"]
    assert not any(secret in r.getMessage() for r in caplog.records)


def test_the_lines_are_written_under_a_quieter_log_level_too(tmp_path: Path, caplog) -> None:
    root, access = logging.getLogger(), logging.getLogger("triptych_head.access")
    level = root.level
    root.setLevel(logging.WARNING)  # --log-level warning: the flag still asks for the lines
    access.setLevel(logging.NOTSET)
    try:
        with head(tmp_path) as c:
            assert c.post(IMAGES, json=BODY).status_code == 200
    finally:
        root.setLevel(level)
    assert [m["status"] for m in lines(caplog)] == ["200"]


def test_off_by_default(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "triptych_head.access")
    with head(tmp_path, access_log=False) as c:
        assert c.post(IMAGES, json=BODY).status_code == 200
    assert lines(caplog) == []


def test_a_client_s_x_request_id_never_becomes_the_line_s_request_id(tmp_path: Path, caplog) -> None:
    """--log-format json took the first argument that looked like a request's id as the line's
    `request_id`: where the head gave none (a 401, a 400, a 404), a client without a key tagged the line
    with another request's id, which a log search for that request then found."""
    from triptych.log_format import JsonFormatter

    caplog.set_level(logging.INFO, "triptych_head.access")
    victim = {"X-Request-Id": "img_" + "5f0c" * 8}
    with head(tmp_path, keys="sk-acme-1 tenant=acme\n") as c:
        assert c.post(IMAGES, json=BODY, headers=victim).status_code == 401
        key = {"Authorization": "Bearer sk-acme-1"}
        assert c.post(IMAGES, json={**BODY, "size": "big"}, headers={**victim, **key}).status_code == 400
        ok = c.post(IMAGES, json=BODY, headers={**victim, **key})
    records = [r for r in caplog.records if r.name == "triptych_head.access"]
    parsed = [json.loads(JsonFormatter("server").format(r)) for r in records]
    assert [p["http"]["status"] for p in parsed] == [401, 400, 200]
    assert all(p["http"]["ref"] == victim["X-Request-Id"] for p in parsed), parsed  # kept as the client's own
    assert "request_id" not in parsed[0] and "request_id" not in parsed[1], parsed
    assert parsed[2]["request_id"] == ok.headers["x-request-id"] != victim["X-Request-Id"], parsed[2]
