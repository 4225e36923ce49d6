"""An API key's `max_in_flight=N` and `max_per_minute=N` (head/triptych_head/api/key_limits.py): at
most N of its generation requests at once on the head, the next a 429 `key_concurrency_limit`; at
most N admitted a minute (a burst of N, then one every 60/N s), the next a 429 `key_rate_limit`;
each with Retry-After, never reaching the pipeline; other keys unaffected. In-process over HTTP
with a scripted backend whose video jobs stay in flight while they run."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend
from triptych.families import ModelInfo
from triptych_head.api.app import create_app
from triptych_head.api.auth import APIKeyError, APIKeys, parse_entries
from triptych_head.api.context import HeadContext
from triptych_head.api.errors import APIError
from triptych_head.api.key_limits import KeyLimit, KeyLimits

KEYS = "sk-small max_in_flight=2\nsk-big max_priority=high max_in_flight=50\nsk-open\n"
VIDEO = {"prompt": "x", "size": "32x32", "num_inference_steps": 4, "num_frames": 1}
IMAGE = {"prompt": "x", "size": "32x32", "num_inference_steps": 1}


def test_a_keys_file_line_may_limit_its_key_in_flight() -> None:
    small, big, bare = parse_entries(KEYS)
    assert small.limit is not None and small.limit.max_in_flight == 2
    assert big.max_priority == "high" and big.limit is not None and big.limit.max_in_flight == 50
    assert bare.limit is None  # a bare key is not limited
    assert "sk-small" not in small.limit.key_id and small.limit.key_id != big.limit.key_id  # a digest names it


def test_a_keys_file_line_may_limit_its_key_per_minute() -> None:
    trial, both, counted = parse_entries(
        "sk-trial max_per_minute=10\nsk-both max_in_flight=3 max_per_minute=60\nsk-c max_in_flight=1"
    )
    assert trial.limit is not None and (trial.limit.max_in_flight, trial.limit.max_per_minute) == (None, 10)
    assert both.limit is not None and (both.limit.max_in_flight, both.limit.max_per_minute) == (3, 60)
    assert counted.limit is not None and counted.limit.max_per_minute is None


@pytest.mark.parametrize("option", ["max_in_flight", "max_per_minute", "max_per_hour", "max_per_day", "max_per_month"])
@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "", "²"])
def test_a_limit_that_is_not_a_whole_number_stops_the_head_naming_the_line(
    tmp_path: Path, option: str, value: str
) -> None:
    refused_keys(
        tmp_path, f"sk-a\nsk-b {option}={value}\n", rf"--api-keys-file .*line 2: {option}='{value}' must be a whole"
    )


@pytest.mark.parametrize("option", ["max_in_flight", "max_per_minute", "max_per_day", "max_device_seconds_per_hour"])
def test_a_limit_beyond_the_largest_count_stops_the_head_naming_the_line(tmp_path: Path, option: str) -> None:
    """400 digits passed as a whole number >= 1, then float() of it raised OverflowError: a traceback at
    start-up, and after a live edit a 500 for the key's requests and its GET /v1/usage."""
    huge = "1" + "0" * 399
    shown = re.escape(f"{option}='{huge[:40]}'... (400 characters) must be a whole number from 1 to 1000000000")
    refused_keys(tmp_path, f"sk-a\nsk-b {option}={huge}\n", rf"^--api-keys-file .*, line 2: {shown}$")
    refused_keys(
        tmp_path, f"sk-b {option}=1000000001\n", rf"line 1: {option}='1000000001' must be a whole number from 1"
    )
    (big,) = parse_entries(f"sk-b {option}=1000000000\n")  # the largest is taken
    limit = big.limit
    assert limit is not None
    counts = (
        limit.max_in_flight,
        limit.max_per_minute,
        *dict(limit.quotas).values(),
        *dict(limit.device_quotas).values(),
    )
    assert 1_000_000_000 in counts


def test_a_live_edit_to_a_limit_beyond_the_largest_count_keeps_the_keys_read_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("triptych_head.api.auth.RECHECK_S", 0.0)
    backend = ScriptedBackend()
    path = tmp_path / "keys"
    path.write_text("sk-trial max_per_minute=2\n")
    model = ModelInfo("tiny", "WanPipeline", "video", 4, 3.5)
    ctx = HeadContext(backend, model, tmp_path, CollectorRegistry(), api_keys=APIKeys(path))
    from fastapi.testclient import TestClient

    with TestClient(create_app(ctx)) as client:
        edited = tmp_path / "keys.new"
        edited.write_text("sk-trial max_per_minute=" + "9" * 400 + "\n")
        os.replace(edited, path)  # as a Secret update swaps the file
        auth = {"Authorization": "Bearer sk-trial"}
        answers = [client.post("/v1/images/generations", json=IMAGE, headers=auth) for _ in range(3)]
        assert [r.status_code for r in answers] == [200, 200, 429], [r.text for r in answers]  # still 2 a minute
        usage = client.get("/v1/usage", headers=auth)
        assert usage.status_code == 200 and usage.json()["per_minute"]["limit"] == 2, usage.text
    assert "cannot re-read --api-keys-file" in caplog.text and "must be a whole number from 1 to" in caplog.text


def test_an_unknown_option_is_named_with_the_options_there_are(tmp_path: Path) -> None:
    options = r"max_in_flight=N, max_per_minute=N, max_per_hour=N, max_per_day=N, max_per_month=N"
    refused_keys(tmp_path, "sk-a max_per_week=5\n", rf"line 1: unknown option 'max_per_week'.*{options}")


def refused_keys(tmp_path: Path, text: str, match: str) -> Path:
    """A keys file holding `text`, which the head refuses at start-up with a message matching `match`."""
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(APIKeyError, match=match):
        APIKeys(path)
    return path


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_s_tokens_come_in_a_burst_then_refill_at_its_rate_and_a_refused_request_takes_none() -> None:
    clock = Clock()
    limits = KeyLimits(CollectorRegistry(), clock)
    limit, other = KeyLimit("k", max_per_minute=3), KeyLimit("o", max_per_minute=3)
    for i in range(3):  # the burst
        limits.admit(f"r{i}", limit, 5)
        limits.admitted(f"r{i}")
    with pytest.raises(APIError) as refused:
        limits.admit("r3", limit, 5)
    assert refused.value.status_code == 429 and refused.value.code == "key_rate_limit"
    assert refused.value.headers == {"Retry-After": "20"}  # one token every 20 s
    assert "max_per_minute=3" in refused.value.message
    limits.admit("o0", other, 5)  # another key has its own tokens
    clock.now += 19.0
    with pytest.raises(APIError) as still:
        limits.admit("r3", limit, 5)
    assert still.value.headers == {"Retry-After": "1"}
    clock.now += 1.0
    limits.admit("r3", limit, 5)  # one token came back
    limits.release("r3")  # refused further on (overload, a deadline): its token is given back
    limits.admit("r4", limit, 5)
    limits.admitted("r4")
    limits.release("r4")  # answered: the token stays spent
    with pytest.raises(APIError):
        limits.admit("r5", limit, 5)
    clock.now += 3600  # a long idle time refills to the burst, no more
    for i in range(3):
        limits.admit(f"s{i}", limit, 5)
        limits.admitted(f"s{i}")
    with pytest.raises(APIError):
        limits.admit("s3", limit, 5)
    assert limits.rejected_rate._value.get() == 4


def client_for(tmp_path: Path, backend: ScriptedBackend) -> Any:
    from fastapi.testclient import TestClient

    (tmp_path / "keys").write_text(KEYS)
    model = ModelInfo("tiny", "WanPipeline", "video", 4, 3.5)
    ctx = HeadContext(backend, model, tmp_path, CollectorRegistry(), api_keys=APIKeys(tmp_path / "keys"))
    return TestClient(create_app(ctx)), ctx


def test_a_key_at_its_limit_gets_a_429_until_one_of_its_requests_ends(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    backend.step_delay = 0.25  # a job stays in flight ~1 s
    client, ctx = client_for(tmp_path, backend)
    with client:

        def post(key: str, path: str = "/v1/videos", body: dict[str, Any] = VIDEO) -> Any:
            return client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})

        first, second = post("sk-small"), post("sk-small")
        assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
        refused = post("sk-small")
        image = post("sk-small", "/v1/images/generations", IMAGE)  # one count for every generation endpoint
        for r in (refused, image):
            assert r.status_code == 429, r.text
            error = r.json()["error"]
            assert error["code"] == "key_concurrency_limit" and "max_in_flight=2" in error["message"], error
            assert int(r.headers["Retry-After"]) >= 1
        assert len(backend.calls) == 2, "a refused request never reaches the pipeline"
        assert post("sk-open").status_code == 200 and post("sk-big").status_code == 200  # other keys go on
        limit = parse_entries(KEYS)[0].limit
        assert isinstance(limit, KeyLimit) and ctx.key_limits.in_flight(limit.key_id) == 2

        deadline = time.monotonic() + 20
        while client.get(f"/v1/videos/{first.json()['id']}", headers={"Authorization": "Bearer sk-small"}).json()[
            "status"
        ] not in ("completed", "failed"):
            assert time.monotonic() < deadline, "the first job never ended"
            time.sleep(0.05)
        again = post("sk-small")
        assert again.status_code == 200, again.text  # the ended job's place is free
        metrics = client.get("/metrics").text
    assert "triptych_rejected_key_limit_requests_total 2.0" in metrics


def test_a_key_over_its_rate_gets_a_429_with_retry_after_and_other_keys_go_on(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    (tmp_path / "keys").write_text("sk-trial max_per_minute=2\nsk-open\n")
    model = ModelInfo("tiny", "WanPipeline", "video", 4, 3.5)
    ctx = HeadContext(backend, model, tmp_path, CollectorRegistry(), api_keys=APIKeys(tmp_path / "keys"))
    from fastapi.testclient import TestClient

    with TestClient(create_app(ctx)) as client:

        def post(key: str) -> Any:
            return client.post("/v1/images/generations", json=IMAGE, headers={"Authorization": f"Bearer {key}"})

        assert [post("sk-trial").status_code for _ in range(2)] == [200, 200]  # answered: not in flight any more
        refused = post("sk-trial")
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "key_rate_limit" and "max_per_minute=2" in error["message"], error
        assert 1 <= int(refused.headers["Retry-After"]) <= 30
        assert len(backend.calls) == 2, "a refused request never reaches the pipeline"
        assert post("sk-open").status_code == 200
        metrics = client.get("/metrics").text
    assert "triptych_rejected_key_rate_requests_total 1.0" in metrics


TENANT_KEYS = (
    "sk-acme-old tenant=acme max_in_flight=1 max_per_minute=5  # rotating: both of acme's keys\n"
    "sk-acme-new max_per_minute=5 max_in_flight=1 tenant=acme\n"
    "sk-solo max_in_flight=1\n"
)


def test_a_tenant_s_keys_share_one_set_of_limits_under_its_name() -> None:
    old, new, solo = parse_entries(TENANT_KEYS)
    assert old.limit == new.limit and old.limit is not None and old.limit.key_id == "tenant:acme"
    assert (
        solo.limit is not None
        and solo.limit.key_id not in ("tenant:acme", "key:")
        and "sk-solo" not in solo.limit.key_id
    )


@pytest.mark.parametrize(
    ("second", "says"),
    [
        ("sk-b tenant=acme", "line 1 gives max_in_flight=2, this line none"),  # a rotated key without them
        ("sk-b tenant=acme max_in_flight=3", "line 1 gives max_in_flight=2, this line max_in_flight=3"),
        ("sk-b tenant=acme max_in_flight=2 max_per_day=9", "this line max_in_flight=2 max_per_day=9"),
    ],
)
def test_keys_of_one_tenant_that_give_different_limits_stop_the_head_naming_the_lines(
    tmp_path: Path, second: str, says: str
) -> None:
    """A key rotated in without its tenant's limits would be a way around them; two different ones, a guess."""
    text = f"sk-a tenant=acme max_in_flight=2\n{second}\n"
    path = refused_keys(tmp_path, text, rf"line 2: tenant=acme's keys share the tenant's limits.*{says}")
    path.write_text(f"sk-a tenant=acme max_in_flight=2\nsk-b tenant=other\n{second.replace('acme', 'third')}\n")
    APIKeys(path)  # other tenants, and a tenant's one key, give what they like


def test_a_tenant_at_its_limit_is_refused_whichever_of_its_keys_asks(tmp_path: Path) -> None:
    """Limits were counted per key, so a tenant holding two keys while it rotates had twice its share."""
    backend = ScriptedBackend()
    backend.step_delay = 0.25  # a job stays in flight ~1 s
    (tmp_path / "keys").write_text(TENANT_KEYS)
    model = ModelInfo("tiny", "WanPipeline", "video", 4, 3.5)
    ctx = HeadContext(backend, model, tmp_path, CollectorRegistry(), api_keys=APIKeys(tmp_path / "keys"))
    from fastapi.testclient import TestClient

    with TestClient(create_app(ctx)) as client:

        def post(key: str) -> Any:
            return client.post("/v1/videos", json=VIDEO, headers={"Authorization": f"Bearer {key}"})

        assert post("sk-acme-old").status_code == 200
        refused = post("sk-acme-new")
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "key_concurrency_limit", error
        assert error["message"].startswith("this API key's tenant 'acme' (its keys together) has 1 requests in flight")
        assert post("sk-solo").status_code == 200  # another key's count is its own
        usage = client.get("/v1/usage", headers={"Authorization": "Bearer sk-acme-new"}).json()
        assert usage["in_flight"] == {"limit": 1, "used": 1}, usage  # the tenant's, seen from either key
    assert len(backend.calls) == 2
