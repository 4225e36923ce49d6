"""Webhooks (--webhook-url): a video job's end reaches a real HTTP receiver, signed so that the
specification's check passes; no answer, a 5xx or a 429 is tried again, another 4xx is not; a head
that stops waits a little for deliveries under way; a secret or URL that cannot be used stops the
head naming the flag."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from tests.api.test_direct_routes import WAN
from tests.api.test_http_api import ScriptedBackend, wait_for
from tests.webhook_receiver import verified, webhook_receiver
from triptych.cli import build_parser
from triptych.config import ConfigError, ServeArgs
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext
from triptych_head.backend import GenerationFailed
from triptych_head.objects import DirectoryObjects
from triptych_head.sightings import CLOCK_SKEW_S
from triptych_head.webhook_outbox import Outbox
from triptych_head.webhooks import WebhookConfigError, Webhooks, WebhookTarget, parse_secret, shown_url

KEY = bytes(range(32))
SECRET = "whsec_" + base64.b64encode(KEY).decode()
VIDEO = {"prompt": "sea", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
FAST = (0.05, 0.05, 0.05)  # the waits between attempts, shortened


def head(tmp_path: Path, url: str, backend: ScriptedBackend | None = None) -> tuple[TestClient, HeadContext]:
    ctx = HeadContext(backend or ScriptedBackend(), WAN, tmp_path, CollectorRegistry(), webhook=WebhookTarget(url, KEY))
    assert ctx.webhooks is not None
    ctx.webhooks.retry_after_s = FAST
    return TestClient(create_app(ctx)), ctx


def sample(ctx: HeadContext, name: str, **labels: str) -> float | None:
    return ctx.registry.get_sample_value(name, labels)


def test_a_completed_job_is_posted_signed_with_the_job_as_the_api_shows_it(tmp_path: Path) -> None:
    with webhook_receiver() as hooks:
        client, ctx = head(tmp_path, hooks.url)
        with client as c:
            job = c.post("/v1/videos", json=VIDEO).json()
            shown = wait_for(c, job["id"], "completed")
            (delivery,) = hooks.wait(1)
    assert verified(delivery, KEY), delivery.headers
    assert not verified(delivery, bytes(32)), "another key does not verify it"
    event = delivery.event
    assert event["type"] == "video.completed" and event["object"] == "event"
    assert event["id"] == delivery.headers["webhook-id"] and event["id"].startswith("evt_")
    assert event["data"] == {**shown, "content_url": f"/v1/videos/{job['id']}/content"}
    assert delivery.headers["content-type"] == "application/json"
    assert sample(ctx, "triptych_webhook_deliveries_total", type="video.completed", outcome="delivered") == 1


def test_a_cancelled_and_a_failed_job_are_posted_too(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    backend.step_delay = 0.2
    with webhook_receiver() as hooks:
        client, _ = head(tmp_path, hooks.url, backend)
        with client as c:
            slow = c.post("/v1/videos", json={**VIDEO, "num_inference_steps": 50}).json()
            assert c.delete(f"/v1/videos/{slow['id']}").json()["status"] == "cancelled"
            hooks.wait(1)
            backend.step_delay = 0
            backend.fail = GenerationFailed("denoiser tcp://127.0.0.1:7 stopped responding", 503)
            failed = c.post("/v1/videos", json=VIDEO).json()
            wait_for(c, failed["id"], "failed")
            events = [d.event for d in hooks.wait(2)]
    assert [(e["type"], e["data"]["id"]) for e in events] == [
        ("video.cancelled", slow["id"]),
        ("video.failed", failed["id"]),
    ]
    assert "stopped responding" in events[1]["data"]["error"]["message"]


def test_no_answer_a_5xx_and_a_429_are_tried_again_with_the_same_id_and_fresh_signatures(tmp_path: Path) -> None:
    with webhook_receiver(answers=[503, 429, 500]) as hooks:
        client, ctx = head(tmp_path, hooks.url)
        with client as c:
            job = c.post("/v1/videos", json=VIDEO).json()
            wait_for(c, job["id"], "completed")
            deliveries = hooks.wait(4)
    assert len({d.headers["webhook-id"] for d in deliveries}) == 1  # one event: a receiver drops the repeats
    assert all(verified(d, KEY) for d in deliveries)
    assert sample(ctx, "triptych_webhook_attempts_total") == 4
    assert sample(ctx, "triptych_webhook_deliveries_total", type="video.completed", outcome="delivered") == 1


def test_a_receiver_s_refusal_is_not_sent_again(tmp_path: Path) -> None:
    with webhook_receiver(answers=[400]) as hooks:
        client, ctx = head(tmp_path, hooks.url)
        with client as c:
            job = c.post("/v1/videos", json=VIDEO).json()
            wait_for(c, job["id"], "completed")
            hooks.wait(1)
            for _ in range(50):  # the outcome is counted once the attempt's answer is read
                if sample(ctx, "triptych_webhook_deliveries_total", type="video.completed", outcome="refused"):
                    break
                time.sleep(0.02)
    assert len(hooks.received) == 1
    assert sample(ctx, "triptych_webhook_deliveries_total", type="video.completed", outcome="refused") == 1


def test_a_receiver_that_never_answers_is_given_up_after_every_attempt_and_at_shutdown(tmp_path: Path) -> None:
    """Nothing listens at the URL: every attempt fails; the last one counts it undelivered. A head
    that stops while a delivery waits for its next attempt stops it (counted undelivered too)."""
    with webhook_receiver() as hooks:
        gone = hooks.url  # the receiver stops at the end of this block: nothing listens there after
    registries = [CollectorRegistry(), CollectorRegistry()]
    webhooks = Webhooks(WebhookTarget(gone, KEY), registries[0], retry_after_s=(0.01, 0.01))
    slow = Webhooks(WebhookTarget(gone, KEY), registries[1], retry_after_s=(30.0,))
    job = {"id": "video_1", "status": "failed", "error": {"message": "x", "code": "y"}}

    async def run() -> None:
        webhooks.job_ended(job)
        slow.job_ended(job)
        await asyncio.sleep(0.5)
        await webhooks.close(5)
        await slow.close(0.1)  # its next attempt is 30 s away: stopped

    asyncio.run(run())
    undelivered = {"type": "video.failed", "outcome": "undelivered"}
    for registry in registries:
        assert registry.get_sample_value("triptych_webhook_deliveries_total", undelivered) == 1
        assert registry.get_sample_value("triptych_webhooks_pending") == 0
    assert registries[0].get_sample_value("triptych_webhook_attempts_total") == 3
    assert registries[1].get_sample_value("triptych_webhook_attempts_total") == 1


def test_a_job_that_has_not_ended_sends_nothing() -> None:
    registry = CollectorRegistry()
    Webhooks(WebhookTarget("http://127.0.0.1:9/", KEY), registry).job_ended({"id": "video_1", "status": "in_progress"})
    assert registry.get_sample_value("triptych_webhooks_pending") == 0
    assert registry.get_sample_value("triptych_webhook_attempts_total") == 0


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("hunter2", "not a whsec_<base64> secret"),
        ("whsec_not base64!", "not base64"),
        ("whsec_" + base64.b64encode(b"short").decode(), "5 bytes, under 24"),
    ],
)
def test_a_secret_that_cannot_sign_is_refused_naming_the_flag(text: str, says: str) -> None:
    with pytest.raises(WebhookConfigError, match="--webhook-secret-file") as caught:
        parse_secret(text, "/etc/hook")
    assert says in str(caught.value) and "openssl rand" in str(caught.value)


def test_a_secret_file_is_read_whole_and_a_missing_one_is_named(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text(SECRET + "\n")
    assert WebhookTarget.from_flags("https://h.example/x", str(tmp_path / "secret")).signing_key() == KEY
    with pytest.raises(WebhookConfigError, match=r"--webhook-secret-file .*missing: cannot read it"):
        WebhookTarget.from_flags("https://h.example/x", str(tmp_path / "missing"))


def _mount(folder: Path, secret: str, version: int) -> None:
    """What the kubelet does with a Secret mounted as files: its data in a new folder, then the
    `..data` symlink swapped to it at once (the file `secret` links through `..data`)."""
    data = folder / f"..{version}"
    data.mkdir()
    (data / "secret").write_text(secret + "\n")
    (folder / "..data_tmp").symlink_to(data.name)
    (folder / "..data_tmp").rename(folder / "..data")
    if not (folder / "secret").is_symlink():
        (folder / "secret").symlink_to("..data/secret")


def test_a_rotated_secret_signs_the_next_attempts_and_a_bad_update_keeps_the_key_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The secret was read once at start: after a rotation the head signed with the old key for ever,
    the receiver refused every event (401), and each was dropped as refused."""
    new_key = bytes(range(1, 33))
    _mount(tmp_path, SECRET, 1)
    target = WebhookTarget.from_flags("https://h.example/x", str(tmp_path / "secret"))
    assert target.signing_key() == KEY
    _mount(tmp_path, "whsec_" + base64.b64encode(new_key).decode(), 2)
    deadline = time.monotonic() + 10
    while target.signing_key() != new_key:
        assert time.monotonic() < deadline, "the rotated secret was never read"
        time.sleep(0.1)
    with caplog.at_level(logging.ERROR):
        _mount(tmp_path, "not a secret", 3)
        time.sleep(1.2)  # past a recheck
        assert target.signing_key() == new_key and target.signing_key() == new_key
    [logged] = [r.message for r in caplog.records if "cannot re-read --webhook-secret-file" in r.message]
    assert "keeping what was read before" in logged and "whsec_" in logged and "not a secret" not in logged


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--webhook-url", "https://h.example/x"], "--webhook-url needs --webhook-secret-file too"),
        (["--webhook-secret-file", "/s"], "--webhook-secret-file needs --webhook-url too"),
        (["--webhook-url", "ftp://h.example/x", "--webhook-secret-file", "/s"], "is not an http(s) URL"),
        (["--webhook-url", "https:///x", "--webhook-secret-file", "/s"], "is not an http(s) URL"),
        (["--webhook-url", "http://[::1", "--webhook-secret-file", "/s"], "is not an http(s) URL"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--webhook-url", "https://h.example/x",
          "--webhook-secret-file", "/s"], "--webhook-url is for the head (server or monolithic), not denoiser"),
    ],
)  # fmt: skip
def test_webhook_flags_that_do_not_go_together_stop_the_head(flags: list[str], says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ServeArgs.from_namespace(build_parser().parse_args(["serve", "--model-path", "m", *flags]))
    assert says in str(caught.value)


# ---------------------------------------------------------------- the outbox: events outlive their head


Head = tuple[Webhooks, CollectorRegistry]


def heads(tmp_path: Path, url: str, retry_after_s: tuple[float, ...] = FAST) -> list[Head]:
    """Two heads' webhooks on one shared store (a folder, as a ReadWriteMany volume gives them)."""
    objects = DirectoryObjects(tmp_path / "store")
    made = []
    for head_id in ("head-a", "head-b"):
        registry = CollectorRegistry()
        made.append((Webhooks(WebhookTarget(url, KEY), registry, Outbox(objects, head_id), retry_after_s), registry))
    return made


def outbox_files(tmp_path: Path) -> list[str]:
    folder = tmp_path / "store" / "webhooks"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


JOB = {"id": "video_7", "status": "completed", "state": "DONE"}


def test_an_event_waiting_for_its_next_attempt_keeps_its_lease_renewed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its head wrote the lease once for the whole wait: a head whose clock ran ahead by more than
    what was left of it adopted an event its head was still to send (sightings.py sees no renewal)."""
    import triptych_head.webhooks as webhooks

    monkeypatch.setattr(webhooks, "LEASE_S", 0.3)  # renewed every 0.1 s
    with webhook_receiver(answers=[503]) as hooks:
        [(a, _), _] = heads(tmp_path, hooks.url, retry_after_s=(1.5,))

        async def run() -> list[float]:
            a.job_ended(JOB)
            await asyncio.to_thread(hooks.wait, 1)
            leases: list[float] = []
            while len(hooks.received) < 2 and len(leases) < 400:  # the wait: 1.5 s
                [record] = [n for n in outbox_files(tmp_path) if n.endswith(".json")] or [None]
                if record is not None:
                    lease = json.loads((tmp_path / "store" / "webhooks" / record).read_text())["lease_until"]
                    if not leases or leases[-1] != lease:
                        leases.append(lease)
                await asyncio.sleep(0.02)
            await a.close(5)
            return leases

        leases = asyncio.run(run())
    assert len(hooks.received) == 2
    assert len(leases) >= 8, f"the lease was written {len(leases)} times during a 1.5 s wait"


class SlowRenewals(DirectoryObjects):
    """A store whose writes of a live lease are slow (an S3 PUT, an NFS write), or fail when `failing`."""

    failing = False

    def put_bytes(self, name: str, data: bytes, content_type: str) -> None:
        if self.failing:
            raise OSError("the store does not answer")
        if json.loads(data).get("lease_until"):
            time.sleep(0.5)
        super().put_bytes(name, data, content_type)


def _waiting_event(store: DirectoryObjects, while_waiting: Callable[[], Awaitable[None]]) -> None:
    """One head's event refused once (503), then `while_waiting` during its 60 s wait, then the head stops."""
    with webhook_receiver(answers=[503]) as hooks:
        hooked = Webhooks(WebhookTarget(hooks.url, KEY), CollectorRegistry(), Outbox(store, "head-a"), (60.0,))

        async def run() -> None:
            hooked.job_ended(JOB)
            await asyncio.to_thread(hooks.wait, 1)
            await while_waiting()
            await hooked.close(0)

        asyncio.run(run())


def test_a_head_that_stops_while_a_renewal_is_written_hands_the_event_over_all_the_same(tmp_path: Path) -> None:
    """The renewal's write, in a thread the head's stop could not cancel, landed after the hand-over
    and left the event leased to a head that had gone: no other head took it for minutes."""
    _waiting_event(SlowRenewals(tmp_path / "store"), lambda: asyncio.sleep(0.15))  # a renewal being written
    [record] = [n for n in outbox_files(tmp_path) if n.endswith(".json")]
    assert json.loads((tmp_path / "store" / "webhooks" / record).read_text())["lease_until"] == 0.0


class SlowRemovals(DirectoryObjects):
    def delete(self, name: str) -> None:
        time.sleep(0.5)
        super().delete(name)


def test_a_head_that_stops_while_a_delivered_event_s_record_is_removed_hands_nothing_over(tmp_path: Path) -> None:
    """The stop cancelled the removal's wait; the hand-over then wrote the record back, and another
    head delivered the event a second time."""
    store = SlowRemovals(tmp_path / "store")
    with webhook_receiver() as hooks:
        hooked = Webhooks(WebhookTarget(hooks.url, KEY), CollectorRegistry(), Outbox(store, "head-a"), FAST)

        async def run() -> None:
            hooked.job_ended(JOB)
            await asyncio.to_thread(hooks.wait, 1)
            await asyncio.sleep(0.2)  # delivered: its record is being removed
            await hooked.close(0)

        asyncio.run(run())
    assert len(hooks.received) == 1 and outbox_files(tmp_path) == []


def test_a_store_that_fails_the_renewals_is_logged_once_until_a_write_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import triptych_head.webhooks as webhooks

    monkeypatch.setattr(webhooks, "LEASE_S", 0.3)  # renewed every 0.1 s
    store = SlowRenewals(tmp_path / "store")

    async def outage() -> None:
        store.failing = True
        with caplog.at_level(logging.INFO, logger="triptych_head.webhooks"):
            await asyncio.sleep(1.0)  # renewals fail
            store.failing = False
            await asyncio.sleep(1.0)

    _waiting_event(store, outage)
    said = [r.message for r in caplog.records if "webhook outbox" in r.message]
    assert len([m for m in said if "failed" in m]) == 1 and "logged once" in said[0], said
    assert any("works again" in m for m in said), said


def test_a_delivered_event_leaves_nothing_in_the_store(tmp_path: Path) -> None:
    with webhook_receiver() as hooks:
        [(a, registry), _] = heads(tmp_path, hooks.url)

        async def run() -> None:
            a.job_ended(JOB)
            await a.close(10)

        asyncio.run(run())
    assert len(hooks.received) == 1 and outbox_files(tmp_path) == []
    assert registry.get_sample_value("triptych_webhook_deliveries_total", DELIVERED) == 1


DELIVERED = {"type": "video.completed", "outcome": "delivered"}


def test_a_head_that_stops_hands_its_events_to_another_which_sends_the_same_event(tmp_path: Path) -> None:
    with webhook_receiver(answers=[503]) as hooks:
        [(a, registry_a), (b, registry_b)] = heads(tmp_path, hooks.url, retry_after_s=(30.0,))

        async def run() -> None:
            a.job_ended(JOB)
            await asyncio.to_thread(hooks.wait, 1)  # refused once: head A waits 30 s to send it again
            await a.close(0.1)  # stops: the event is handed over, its lease ended
            await b.adopt_orphans()
            await b.close(10)

        asyncio.run(run())
    first, second = hooks.received
    assert first.headers["webhook-id"] == second.headers["webhook-id"] and verified(second, KEY)
    handed_over = {**DELIVERED, "outcome": "handed_over"}
    assert registry_a.get_sample_value("triptych_webhook_deliveries_total", handed_over) == 1
    assert registry_b.get_sample_value("triptych_webhook_deliveries_total", DELIVERED) == 1
    assert registry_b.get_sample_value("triptych_webhook_adoptions_total") == 1
    assert outbox_files(tmp_path) == []


def test_an_event_whose_head_died_is_sent_by_one_other_head_once_its_lease_ran_out(tmp_path: Path) -> None:
    """Head A dies between attempts (its tasks end, nothing is handed over): its record keeps its lease,
    which no head takes before it runs out; then of two heads looking at once, one sends it."""
    with webhook_receiver(answers=[503]) as hooks:
        [(a, _), (b, registry_b)] = heads(tmp_path, hooks.url, retry_after_s=(30.0,))
        objects = DirectoryObjects(tmp_path / "store")
        c = Webhooks(WebhookTarget(hooks.url, KEY), CollectorRegistry(), Outbox(objects, "head-c"), FAST)

        async def run() -> None:
            a.job_ended(JOB)
            await asyncio.to_thread(hooks.wait, 1)
            for task in list(a._tasks):  # head A dies: no hand-over
                task.cancel()
            await asyncio.sleep(0.05)
            await b.adopt_orphans()
            assert registry_b.get_sample_value("triptych_webhooks_pending") == 0, "its lease is live: not taken"
            [record] = [n for n in outbox_files(tmp_path) if n.endswith(".json")]
            path = tmp_path / "store" / "webhooks" / record
            ended = time.time() - 2 * CLOCK_SKEW_S  # its lease ran out long ago (by any head's clock)
            path.write_text(json.dumps({**json.loads(path.read_text()), "lease_until": ended}))
            await asyncio.gather(b.adopt_orphans(), c.adopt_orphans())
            await asyncio.gather(b.close(10), c.close(10))

        asyncio.run(run())
    first, second = hooks.received
    assert first.headers["webhook-id"] == second.headers["webhook-id"] and verified(second, KEY)
    assert json.loads(second.body) == json.loads(first.body)  # the same event: only the attempt's signature differs
    assert outbox_files(tmp_path) == []


def test_a_record_the_head_cannot_read_is_left_and_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "store" / "webhooks").mkdir(parents=True)
    (tmp_path / "store" / "webhooks" / "evt_x.json").write_text("{not json")
    [(a, _), _] = heads(tmp_path, "http://127.0.0.1:9/")
    asyncio.run(a.adopt_orphans())
    assert "webhooks/evt_x.json is not a record this head reads" in caplog.text
    assert outbox_files(tmp_path) == ["evt_x.json"]


def test_logs_show_the_url_without_its_token(caplog: pytest.LogCaptureFixture) -> None:
    """A webhook URL may carry its receiver's token (in its query or user part): no log line shows it."""
    assert shown_url("https://bot:s3cret@hooks.example.com:8443/in?token=s3cret") == "https://hooks.example.com:8443/in"
    assert shown_url("http://[::1]/x?k=s3cret") == "http://[::1]/x"
    with webhook_receiver(answers=[400]) as hooks:
        webhooks = Webhooks(WebhookTarget(hooks.url + "?token=s3cret", KEY), CollectorRegistry())

        async def run() -> None:
            webhooks.job_ended(JOB)
            await webhooks.close(10)

        with caplog.at_level("INFO", logger="triptych_head.webhooks"):
            asyncio.run(run())
    assert "answered 400; not sent again" in caplog.text and hooks.url in caplog.text
    assert "s3cret" not in caplog.text


@contextmanager
def raw_receiver(answer: bytes) -> Iterator[tuple[str, list[bytes]]]:
    """A receiver on loopback that answers every request with `answer`, bytes as they are (an answer
    that is not well-formed HTTP); the requests it read."""
    got: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                    data += chunk
                got.append(data)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/hook", got
    finally:
        listener.close()


@pytest.mark.parametrize(
    ("answer", "attempts", "outcome"),
    [
        # a 2xx whose chunked body breaks off: the receiver said it took the event
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 1, "delivered"),
        (b"NOT HTTP\r\n\r\n", 1 + len(FAST), "undelivered"),  # a TLS port asked in the clear, say
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 1 + len(FAST), "undelivered"),
    ],
    ids=["broken 2xx body", "not HTTP", "header too long"],
)
def test_an_answer_that_is_not_well_formed_http_counts_as_its_status_or_as_none(
    answer: bytes, attempts: int, outcome: str, tmp_path: Path
) -> None:
    """Not an error that escapes the delivery: the event was adopted and sent again for ever, uncounted."""
    with raw_receiver(answer) as (url, got):
        [(a, registry), _] = heads(tmp_path, url)

        async def run() -> None:
            a.job_ended(JOB)
            await a.close(10)

        asyncio.run(run())
    assert len(got) == attempts and outbox_files(tmp_path) == []
    assert registry.get_sample_value("triptych_webhook_deliveries_total", {**DELIVERED, "outcome": outcome}) == 1


def test_an_event_another_head_adopted_and_delivered_since_this_head_read_it_is_not_sent_again(tmp_path: Path) -> None:
    """C's scan reads a handed-over event; B adopts it, delivers it and removes it with its markers;
    C, going on with what it read, must not win its adoption again (it did: the marker was gone)."""
    import time

    from triptych_head.webhook_outbox import Pending

    store = DirectoryObjects(tmp_path)
    a, b, c = (Outbox(DirectoryObjects(tmp_path), head) for head in ("head-a", "head-b", "head-c"))
    a.save(Pending({"id": "evt_1", "type": "video.completed", "data": {"id": "video_1"}}), 0.0)  # handed over
    read_by_c = c.orphans(time.time())
    (pending,) = b.orphans(time.time())
    assert b.claim(pending)
    b.save(pending)
    b.remove(pending.event_id)  # delivered
    assert [c.claim(p) for p in read_by_c] == [False]
    assert list(store.list("webhooks/")) == []
