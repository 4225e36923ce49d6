"""The records behind Idempotency-Key (head/triptych_head/idempotency.py), without HTTP: a run's
lease is renewed while it runs, so another head waits for it rather than running it again; its
last record says `done` (no renewal lands after it); a run whose head died is run again once."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from triptych_head.idempotency import FOLDER, Idempotency
from triptych_head.objects import DirectoryObjects


def _records(store: DirectoryObjects) -> dict[str, dict]:
    return {o.name: json.loads(store.get_bytes(o.name)) for o in store.list(f"{FOLDER}/") if o.name.endswith(".json")}


def test_a_long_run_keeps_its_lease_so_another_head_waits_for_its_answer(tmp_path):
    a = Idempotency(DirectoryObjects(tmp_path), "head-a", lease_s=0.3, poll_s=0.05)
    b = Idempotency(DirectoryObjects(tmp_path), "head-b", lease_s=0.3, poll_s=0.05)
    runs: list[str] = []

    async def slow(who: str) -> bytes:
        runs.append(who)
        await asyncio.sleep(1.2)  # four leases long: only renewals keep it live
        return b'{"answer": 1}'

    async def both() -> list[tuple[bytes, bool]]:
        first = asyncio.create_task(a.once("tenant", "k", "fp", lambda: slow("a"), wait_s=10))
        await asyncio.sleep(0.1)
        second = await b.once("tenant", "k", "fp", lambda: slow("b"), wait_s=10)
        return [await first, second]

    (answer_a, replay_a), (answer_b, replay_b) = asyncio.run(both())
    assert runs == ["a"] and answer_a == answer_b == b'{"answer": 1}' and (replay_a, replay_b) == (False, True)
    time.sleep(0.5)  # a renewal still in flight would land now
    (record,) = _records(DirectoryObjects(tmp_path)).values()
    assert record["state"] == "done" and record["head"] == "head-a"


def test_a_run_whose_head_died_is_run_again_as_the_next_attempt(tmp_path):
    store = DirectoryObjects(tmp_path)
    dead = Idempotency(store, "dead", lease_s=0.2)
    digest = dead.digest("tenant", "k")
    record = {"state": "running", "fingerprint": "fp", "head": "dead", "lease_until": time.time() - 1}
    assert store.create(f"{FOLDER}/{digest}.0.json", json.dumps(record).encode(), "application/json")

    async def run() -> bytes:
        return b"again"

    alive = Idempotency(DirectoryObjects(tmp_path), "alive", lease_s=0.2)
    assert asyncio.run(alive.once("tenant", "k", "fp", run, wait_s=5)) == (b"again", False)
    assert sorted(_records(store)) == [f"{FOLDER}/{digest}.1.json"]  # the dead head's attempt 0 is gone
    assert asyncio.run(alive.once("tenant", "k", "fp", run, wait_s=5)) == (b"again", True)


def test_a_key_retried_through_failure_after_failure_keeps_only_its_last_attempt(tmp_path):
    """Only the last attempt is ever read: a client retrying a failing request for days kept one record
    per try, all of them, as retention ages a key by its newest record."""
    store = DirectoryObjects(tmp_path)
    heads = Idempotency(store, "head-a")

    async def fails() -> bytes:
        raise RuntimeError("the request failed")

    for _ in range(5):
        with pytest.raises(RuntimeError):
            asyncio.run(heads.once("tenant", "k", "fp", fails, wait_s=5))
    digest = heads.digest("tenant", "k")
    assert [o.name for o in store.list(f"{FOLDER}/")] == [f"{FOLDER}/{digest}.4.json"]
    assert _records(store)[f"{FOLDER}/{digest}.4.json"]["state"] == "failed"


def test_on_a_store_without_hard_links_a_record_being_written_is_waited_for_not_run_again(tmp_path, monkeypatch):
    """SMB shares (Azure Files) have no hard links: `create` makes the record empty, then writes it. A
    head that reads it in between waits for it as a running attempt; it used to run the key again as
    the next attempt, and its replays answered that second run."""
    import errno
    import os

    real_fdopen = os.fdopen

    def no_link(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.EPERM, "Operation not permitted")

    def slow_fdopen(fd, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.3)  # the write after the create: another round trip to the file server
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(os, "fdopen", slow_fdopen)
    runs: list[str] = []

    async def run_as(who: str) -> bytes:
        runs.append(who)
        await asyncio.sleep(0.5)
        return f'{{"by":"{who}"}}'.encode()

    a = Idempotency(DirectoryObjects(tmp_path), "head-a", poll_s=0.05)
    b = Idempotency(DirectoryObjects(tmp_path), "head-b", poll_s=0.05)

    async def both() -> tuple[tuple[bytes, bool], tuple[bytes, bool]]:
        first = asyncio.create_task(a.once("tenant", "k", "fp", lambda: run_as("a"), wait_s=10))
        await asyncio.sleep(0.1)  # the retry reaches head b while head a creates attempt 0
        second = await b.once("tenant", "k", "fp", lambda: run_as("b"), wait_s=10)
        return await first, second

    (answer_a, replay_a), (answer_b, replay_b) = asyncio.run(both())
    assert runs == ["a"] and answer_a == answer_b == b'{"by":"a"}' and (replay_a, replay_b) == (False, True)


def test_a_large_answer_the_store_cannot_keep_still_reaches_its_client(tmp_path, monkeypatch):
    """A streamed answer is spooled to a file and stored with put_file; a store that fails then kept the
    file's bytes away from the client too (put_file removed it): the run's answer was lost."""

    async def chunks():  # type: ignore[no-untyped-def]
        for i in range(3):
            yield bytes([i]) * (1 << 20)

    async def run():  # type: ignore[no-untyped-def]
        return chunks()

    def failing_replace(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(5, "Input/output error")

    store = DirectoryObjects(tmp_path)
    monkeypatch.setattr("triptych_head.objects.os.replace", failing_replace)
    answer, replayed = asyncio.run(Idempotency(store, "head-a").once("tenant", "k", "fp", run, wait_s=5))
    assert not replayed and b"".join(answer) == b"".join(bytes([i]) * (1 << 20) for i in range(3))
    assert not list(store.staging.iterdir()), "the spooled file goes once sent"


def test_an_attempt_number_freed_by_a_later_attempt_s_tidying_is_not_run_again(tmp_path):
    """Head C reads the key's last attempt (0, failed) and goes to create attempt 1; meanwhile B wins 1,
    which fails, and A wins 2, removes 0 and 1, and answers. C's create of 1 then succeeds (its name is
    free again): C must see attempt 2 and replay it, not run the request a second time."""
    import threading

    gate, at_create = threading.Event(), threading.Event()

    class SlowCreate(DirectoryObjects):  # C's store: its create is slow (a round trip, a busy thread pool)
        def create(self, name: str, data: bytes, content_type: str) -> bool:
            at_create.set()
            gate.wait(10)
            return super().create(name, data, content_type)

    store = DirectoryObjects(tmp_path)
    a, b = Idempotency(store, "A", lease_s=5, poll_s=0.05), Idempotency(store, "B", lease_s=5, poll_s=0.05)
    c = Idempotency(SlowCreate(tmp_path), "C", lease_s=5, poll_s=0.05)
    digest = a.digest("tenant", "k")
    failed = {"state": "failed", "fingerprint": "fp", "head": "X", "lease_until": 0}
    assert store.create(f"{FOLDER}/{digest}.0.json", json.dumps(failed).encode(), "application/json")
    runs: list[str] = []

    def run(who: str, ok: bool = True):  # type: ignore[no-untyped-def]
        async def go() -> bytes:
            runs.append(who)
            if not ok:
                raise RuntimeError("no capacity")
            return f'{{"by":"{who}"}}'.encode()

        return go

    async def scenario() -> tuple[bytes, bool]:
        from_c = asyncio.create_task(c.once("tenant", "k", "fp", run("C"), wait_s=5))
        while not at_create.is_set():
            await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError):
            await b.once("tenant", "k", "fp", run("B", ok=False), wait_s=5)
        assert await a.once("tenant", "k", "fp", run("A"), wait_s=5) == (b'{"by":"A"}', False)
        await asyncio.sleep(0.2)  # A's tidying of attempts 0 and 1 ends
        gate.set()
        return await from_c

    assert asyncio.run(scenario()) == (b'{"by":"A"}', True)
    assert runs == ["B", "A"]
