"""An API key's quotas of a UTC hour, day or month (head/triptych_head/api/key_quotas.py), counted by
every head together through the store they share: the ledgers of two heads over one real folder,
with a clock the test moves. Through HTTP and over S3: tests/s3/test_shared_results.py."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from triptych_head.api.auth import APIKeys, parse_entries
from triptych_head.api.errors import APIError
from triptych_head.api.key_limits import KeyLimit, KeyLimits
from triptych_head.api.key_quotas import DEVICE_TIME, FOLDER, PERIODS, SETTLED_S, SWEEP_S, QuotaExceeded, QuotaLedger
from triptych_head.objects import DirectoryObjects, StoredObject

DAY = (("day", 3),)


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("name", "now", "period_id", "ends"),
    [
        ("hour", "2026-12-05T08:59:59", "hour-2026-12-05T08", "2026-12-05T09:00:00"),
        ("hour", "2026-12-31T23:30:00", "hour-2026-12-31T23", "2027-01-01T00:00:00"),
        ("day", "2026-12-05T00:00:00", "day-2026-12-05", "2026-12-06T00:00:00"),
        ("day", "2028-02-28T12:00:00", "day-2028-02-28", "2028-02-29T00:00:00"),  # a leap year
        ("month", "2026-12-05T08:00:00", "month-2026-12", "2027-01-01T00:00:00"),
        ("month", "2027-02-28T23:59:59", "month-2027-02", "2027-03-01T00:00:00"),
    ],
)
def test_a_period_is_the_utc_hour_day_or_calendar_month_of_now(name: str, now: str, period_id: str, ends: str) -> None:
    assert PERIODS[name].bounds(at(now)) == (period_id, at(ends))


def test_a_keys_file_line_may_give_its_key_quotas_of_an_hour_a_day_and_a_month() -> None:
    metered, mixed, bare = parse_entries(
        "sk-metered max_per_day=1000\nsk-mixed max_in_flight=2 max_per_hour=50 max_per_month=9000\nsk-bare\n"
    )
    assert metered.limit is not None and metered.limit.quotas == (("day", 1000),)
    assert metered.limit.max_in_flight is None and metered.limit.max_per_minute is None
    assert mixed.limit is not None and dict(mixed.limit.quotas) == {"hour": 50, "month": 9000}
    assert mixed.limit.max_in_flight == 2
    assert bare.limit is None


def test_the_keys_say_which_periods_the_heads_keep_in_sync(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a max_per_day=3\nsk-b max_per_hour=1 max_per_day=9\nsk-c max_per_minute=5\n")
    assert APIKeys(path).quota_periods() == {"day", "hour"}
    path.write_text("sk-c max_per_minute=5\n")
    assert APIKeys(path).quota_periods() == frozenset()  # nothing to sync: no store traffic


def ledgers(folder: Path, clock: Clock, *head_ids: str) -> list[QuotaLedger]:
    """One ledger per head, each with its own client of the one folder."""
    return [QuotaLedger(DirectoryObjects(folder), head_id, CollectorRegistry(), clock) for head_id in head_ids]


def admit(ledger: QuotaLedger, request_id: str, key_id: str = "k", quotas: tuple[tuple[str, int], ...] = DAY) -> None:
    ledger.check(key_id, quotas)
    ledger.take(request_id, key_id, quotas)
    ledger.spent(request_id)


def test_heads_count_a_key_s_quota_together_through_the_store(tmp_path: Path) -> None:
    clock = Clock(at("2026-12-05T22:00:00"))
    a, b = ledgers(tmp_path, clock, "head-a", "head-b")
    admit(a, "r1")
    admit(a, "r2")
    b.sync({"day"})
    assert b.used(PERIODS["day"], "k") == 0  # a has not written its counts yet
    a.sync({"day"})
    b.sync({"day"})
    assert b.used(PERIODS["day"], "k") == 2
    admit(b, "r3")  # the third of 3
    with pytest.raises(QuotaExceeded, match=r"used its 3 requests this day .*max_per_day=3.* retry in 7200 s") as exc:
        b.check("k", DAY)
    assert exc.value.retry_after_s == 7200  # until midnight UTC
    a.check("k", DAY)  # a has not read b's third yet: the heads together may pass by one sync's admissions
    b.sync({"day"})
    a.sync({"day"})
    with pytest.raises(QuotaExceeded):
        a.check("k", DAY)
    a.check("other", DAY)  # another key has its own count
    stored = json.loads((tmp_path / FOLDER / "day-2026-12-05.head-a.json").read_bytes())
    assert stored == {"k": 2}

    (c,) = ledgers(tmp_path, clock, "head-c")  # a head started later (or a restarted one: a new id)
    c.sync({"day"})
    assert c.used(PERIODS["day"], "k") == 3
    with pytest.raises(QuotaExceeded):
        c.check("k", DAY)

    clock.now = at("2026-12-06T00:00:01")  # the next day: a fresh quota, on every head
    for ledger in (a, b, c):
        ledger.sync({"day"})
        admit(ledger, f"next-{id(ledger)}")
    assert a.used(PERIODS["day"], "k") == 1


def test_a_request_refused_after_its_count_gives_it_back_on_every_head(tmp_path: Path) -> None:
    clock = Clock(at("2026-12-05T10:00:00"))
    a, b = ledgers(tmp_path, clock, "head-a", "head-b")
    a.take("r1", "k", DAY)
    a.take("r2", "k", DAY)
    a.sync({"day"})
    a.give_back("r2")  # refused further on (overload, a deadline)
    a.spent("r1")
    a.give_back("r1")  # admitted: nothing to give back
    a.sync({"day"})
    b.sync({"day"})
    assert a.used(PERIODS["day"], "k") == 1 and b.used(PERIODS["day"], "k") == 1


def test_key_limits_apply_a_quota_after_the_key_s_other_limits_and_name_it_in_the_429(tmp_path: Path) -> None:
    clock = Clock(at("2026-12-05T10:15:00"))
    (ledger,) = ledgers(tmp_path, clock, "head-a")
    limits = KeyLimits(CollectorRegistry(), quotas=ledger)
    limit = KeyLimit("k", max_per_minute=10, quotas=(("hour", 2),))
    for request_id in ("r1", "r2"):
        limits.admit(request_id, limit, 5)
        limits.admitted(request_id)
    with pytest.raises(APIError) as exc:
        limits.admit("r3", limit, 5)
    assert exc.value.status_code == 429 and exc.value.code == "key_quota_exceeded"
    assert "max_per_hour=2" in exc.value.message and "or ask for a key allowed more" in exc.value.message
    assert exc.value.headers == {"Retry-After": "2700"}
    assert ledger.rejected.labels("hour")._value.get() == 1
    limits.release("r1")
    limits.release("r2")  # ended: they stay counted for the hour
    with pytest.raises(APIError):
        limits.admit("r4", limit, 5)

    limits.admit("x1", KeyLimit("x", quotas=(("hour", 1),)), 5)
    limits.release("x1")  # refused further on, never admitted: the count comes back
    limits.admit("x2", KeyLimit("x", quotas=(("hour", 1),)), 5)


def test_ended_periods_are_swept_from_the_store(tmp_path: Path) -> None:
    clock = Clock(at("2026-12-05T10:00:00"))
    a, b = ledgers(tmp_path, clock, "head-a", "head-b")
    admit(a, "r1", quotas=(("hour", 5), ("day", 5)))
    a.sync({"hour", "day"})
    written = ["day-2026-12-05.head-a.json", "hour-2026-12-05T10.head-a.json"]
    assert sorted(p.name for p in (tmp_path / FOLDER).iterdir()) == written
    clock.now += SWEEP_S + 1  # 11:00: the hour of 10 has ended, the day has not
    b.sync({"hour", "day"})
    assert sorted(p.name for p in (tmp_path / FOLDER).iterdir()) == ["day-2026-12-05.head-a.json"]
    assert b.used(PERIODS["day"], "k") == 1


class FailingStore(DirectoryObjects):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.failing = True

    def put_bytes(self, name: str, data: bytes, content_type: str) -> None:
        if self.failing:
            raise OSError("the store is away")
        super().put_bytes(name, data, content_type)


def test_a_store_that_fails_leaves_the_counts_in_memory_logs_once_and_catches_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(at("2026-12-05T10:00:00"))
    store = FailingStore(tmp_path)
    a = QuotaLedger(store, "head-a", CollectorRegistry(), clock)
    (b,) = ledgers(tmp_path, clock, "head-b")
    admit(a, "r1")
    with caplog.at_level(logging.WARNING):
        a.sync({"day"})
        a.sync({"day"})
    assert [r.message for r in caplog.records].count(next(r.message for r in caplog.records)) == 1
    assert "cannot sync" in caplog.records[0].message and a.sync_errors._value.get() == 2
    assert a.used(PERIODS["day"], "k") == 1 and a.pending()  # still counted here, to be written
    store.failing = False
    a.sync({"day"})
    b.sync({"day"})
    assert not a.pending() and b.used(PERIODS["day"], "k") == 1


def test_an_object_that_is_not_counts_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(at("2026-12-05T10:00:00"))
    folder = tmp_path / FOLDER
    folder.mkdir()
    (folder / "day-2026-12-05.junk.json").write_text('{"k": "many"}')
    (folder / "day-2026-12-05.other.json").write_text('{"k": 2}')
    (a,) = ledgers(tmp_path, clock, "head-a")
    with caplog.at_level(logging.WARNING):
        a.sync({"day"})
    assert a.used(PERIODS["day"], "k") == 2 and "junk.json is not a map of counts" in caplog.text


def test_a_key_reads_its_own_limits_and_what_it_used_at_v1_usage(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from tests.api.test_http_api import ScriptedBackend
    from triptych.families import ModelInfo
    from triptych_head.api.app import create_app
    from triptych_head.api.context import HeadContext

    (tmp_path / "keys").write_text("sk-metered max_in_flight=3 max_per_minute=10 max_per_day=5\nsk-open\n")
    model = ModelInfo("tiny", "WanPipeline", "video", 4, 3.5)
    ctx = HeadContext(ScriptedBackend(), model, tmp_path, CollectorRegistry(), api_keys=APIKeys(tmp_path / "keys"))
    image = {"prompt": "x", "size": "32x32", "num_inference_steps": 1}
    with TestClient(create_app(ctx)) as client:
        metered, other = ({"Authorization": f"Bearer {key}"} for key in ("sk-metered", "sk-open"))
        for _ in range(2):
            assert client.post("/v1/images/generations", json=image, headers=metered).status_code == 200
        usage = client.get("/v1/usage", headers=metered).json()
        assert usage["limited"] and usage["in_flight"] == {"limit": 3, "used": 0}  # both answered
        assert usage["per_minute"] == {"limit": 10, "remaining": 8}
        (day,) = usage["quotas"]
        assert (day["period"], day["limit"], day["used"]) == ("day", 5, 2)
        assert 0 < day["resets_in_seconds"] <= 86400 and day["resets_at"] % 86400 == 0  # midnight UTC
        assert client.get("/v1/usage", headers=other).json() == {"object": "usage", "limited": False}
        assert client.get("/v1/usage").status_code == 401  # a key's own usage, to its holder only


class WholeSecondStore(DirectoryObjects):
    """A store that reports one whole-second mtime for every object, as S3 may for two writes in a second."""

    def __init__(self, root: Path, mtime: float) -> None:
        super().__init__(root)
        self.mtime = mtime

    def list(self, prefix: str) -> Iterator[StoredObject]:
        for obj in super().list(prefix):
            yield StoredObject(obj.name, obj.size, self.mtime)


def test_a_rewrite_with_the_same_size_and_second_is_still_read(tmp_path: Path) -> None:
    clock = Clock(at("2026-12-05T10:00:00"))
    (a,) = ledgers(tmp_path, clock, "head-a")
    b = QuotaLedger(WholeSecondStore(tmp_path, float(int(time.time()))), "head-b", CollectorRegistry(), clock)
    admit(a, "r1")
    a.sync({"day"})
    b.sync({"day"})
    assert b.used(PERIODS["day"], "k") == 1
    admit(a, "r2")  # {"k": 2}: the same size as {"k": 1}, and (here) the same mtime
    a.sync({"day"})
    b.sync({"day"})
    assert b.used(PERIODS["day"], "k") == 2


def test_a_keys_file_line_may_give_its_key_quotas_of_device_seconds(tmp_path: Path) -> None:
    (gpu,) = parse_entries("sk-gpu max_device_seconds_per_month=360000 max_device_seconds_per_hour=600\n")
    assert gpu.limit is not None and dict(gpu.limit.device_quotas) == {"month": 360000, "hour": 600}
    assert gpu.limit.quotas == ()
    with pytest.raises(ValueError, match=r"max_device_seconds_per_day='1.5' must be a whole number from 1 to"):
        parse_entries("sk-gpu max_device_seconds_per_day=1.5\n")
    (tmp_path / "keys").write_text("sk-gpu max_device_seconds_per_day=60 max_per_hour=9\n")
    keys = APIKeys(tmp_path / "keys")
    assert (keys.device_quota_periods(), keys.quota_periods()) == ({"day"}, {"hour"})


def test_heads_count_a_key_s_device_seconds_together_and_refuse_once_it_has_used_them(tmp_path: Path) -> None:
    clock = Clock(at("2026-12-05T22:00:00"))
    a, b = (QuotaLedger(DirectoryObjects(tmp_path), h, CollectorRegistry(), clock, DEVICE_TIME) for h in "ab")
    quota = (("day", 60),)
    a.add("k", ["day"], 45_000)  # 45 device-seconds, in milliseconds
    a.sync({"day"})
    b.sync({"day"})
    b.check("k", quota)  # 45 of 60
    b.add("k", ["day"], 15_500)  # the request that crosses the quota ran to its end
    with pytest.raises(QuotaExceeded, match=r"used its 60 device-seconds this day .*max_device_seconds_per_day=60"):
        b.check("k", quota)
    assert b.usage(PERIODS["day"], "k", 60)["used"] == 60.5
    b.sync({"day"})
    a.sync({"day"})
    with pytest.raises(QuotaExceeded):
        a.check("k", quota)
    assert json.loads((tmp_path / DEVICE_TIME.folder / "day-2026-12-05.b.json").read_bytes()) == {"k": 15_500}
    assert not (tmp_path / FOLDER).exists()  # the requests' ledger is apart: nothing counted there


def test_a_key_s_finished_requests_use_its_device_seconds_and_the_next_one_gets_a_429(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from tests.api.test_http_api import ScriptedBackend
    from triptych.families import ModelInfo
    from triptych_head.api.app import create_app
    from triptych_head.api.context import HeadContext
    from triptych_head.backend import GenerationFailed

    (tmp_path / "keys").write_text("sk-gpu max_device_seconds_per_day=2\nsk-other max_device_seconds_per_day=2\n")
    model = ModelInfo("tiny", "WanPipeline", "video", 4, 3.5)
    backend = ScriptedBackend()
    ctx = HeadContext(backend, model, tmp_path, CollectorRegistry(), api_keys=APIKeys(tmp_path / "keys"))
    image = {"prompt": "x", "size": "32x32", "num_inference_steps": 1}
    gpu, other = ({"Authorization": f"Bearer {key}"} for key in ("sk-gpu", "sk-other"))
    with TestClient(create_app(ctx)) as client:
        backend.device_seconds = 1.5
        for _ in range(2):  # 1.5, then 3.0 of 2: the second crosses the quota and still finishes
            assert client.post("/v1/images/generations", json=image, headers=gpu).status_code == 200
        refused = client.post("/v1/images/generations", json=image, headers=gpu)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "key_quota_exceeded"
        assert "max_device_seconds_per_day=2" in refused.json()["error"]["message"]
        assert 0 < int(refused.headers["Retry-After"]) <= 86400
        (day,) = client.get("/v1/usage", headers=gpu).json()["device_seconds"]
        assert (day["period"], day["limit"], day["used"]) == ("day", 2, 3.0)
        backend.fail = GenerationFailed("boom", 500)  # a failed request uses none of the key's
        assert client.post("/v1/images/generations", json=image, headers=other).status_code == 500
        assert client.get("/v1/usage", headers=other).json()["device_seconds"][0]["used"] == 0


class AheadOfTheStore(WholeSecondStore):
    """The same, with each object's tag (an S3 ETag; a file's inode, mtime and size), and mtimes a
    minute behind this head's clock: the store's clock, or this head's, is off."""

    def list(self, prefix: str) -> Iterator[StoredObject]:
        for obj in DirectoryObjects.list(self, prefix):
            yield StoredObject(obj.name, obj.size, self.mtime, obj.tag)


def test_a_head_whose_clock_runs_ahead_of_the_store_s_still_reads_a_rewrite_with_the_same_size(
    tmp_path: Path,
) -> None:
    """Its clock more than SETTLED_S ahead, the head took a rewrite in the same second and of the same
    size for the settled object it had read, and counted from the old counts."""
    clock = Clock(at("2026-12-05T10:00:00"))
    (a,) = ledgers(tmp_path, clock, "head-a")
    b = QuotaLedger(AheadOfTheStore(tmp_path, time.time() - 2 * SETTLED_S), "head-b", CollectorRegistry(), clock)
    admit(a, "r1")
    a.sync({"day"})
    b.sync({"day"})
    assert b.used(PERIODS["day"], "k") == 1
    admit(a, "r2")
    a.sync({"day"})
    b.sync({"day"})
    assert b.used(PERIODS["day"], "k") == 2
