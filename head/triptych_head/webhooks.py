"""Webhooks: a video job's end (completed, failed or cancelled) POSTed to the deployment's endpoint
(--webhook-url), signed as the Standard Webhooks specification signs (--webhook-secret-file), so that
a client learns of it without polling GET /v1/videos/{id}.

    POST <--webhook-url>
    content-type: application/json
    webhook-id: evt_<32 hex>                 the same on every attempt: a receiver drops repeats by it
    webhook-timestamp: <unix seconds>        of this attempt
    webhook-signature: v1,<base64 of HMAC-SHA256(key, "<webhook-id>.<webhook-timestamp>.<body>")>

    {"id": "evt_...", "object": "event", "type": "video.completed", "created_at": 1765000000,
     "data": <the job as GET /v1/videos/{id} answers it; "content_url" when it completed>}

The key is the secret file's `whsec_<base64>` (the specification's form), decoded. The head that ended
the job delivers it, off every request's path: a 2xx answer delivers it; no answer (a connection
refused, DELIVERY_TIMEOUT_S without one), a 408, 429 or 5xx is tried again after each of RETRY_AFTER_S
in turn (a 429's or 503's Retry-After when longer, up to MAX_WAIT_S); any other answer is the
receiver's refusal, not tried again. Redirects are not followed. Each event waits in the store every
head shares until it is delivered, refused or given up (webhook_outbox.py): a head that stops waits up
to the shutdown's grace for deliveries under way and hands the rest over, and another head delivers
the events of a head that died, with the same id.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import http.client
import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from triptych.urls import shown_url
from triptych.watched_file import WatchedFile
from triptych_head.webhook_outbox import LEASE_S, Outbox, Pending

log = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
MIN_KEY_BYTES = 24  # the specification's secrets are 24 to 64 random bytes
RETRY_AFTER_S = (1.0, 5.0, 30.0, 120.0)  # the waits before attempts 2..5
MAX_WAIT_S = 300.0  # the longest Retry-After honoured
DELIVERY_TIMEOUT_S = 10.0  # one attempt's connect + answer
RETRIED = frozenset({408, 429})  # besides 5xx: the receiver asks to be tried again
EVENT_TYPES = {"completed": "video.completed", "failed": "video.failed", "cancelled": "video.cancelled"}


class WebhookConfigError(ValueError):
    """A --webhook-secret-file that cannot be used; the message names the flag."""


@dataclass(frozen=True)
class WebhookTarget:
    """Where events go and the key that signs them: `key`, or, from --webhook-secret-file, the file's
    key as it is now (a rotated Secret is read again: triptych.watched_file)."""

    url: str
    key: bytes = b""
    secret: WatchedFile[bytes] | None = None

    @classmethod
    def from_flags(cls, url: str, secret_file: str) -> WebhookTarget:
        what = f"--webhook-secret-file {secret_file}"
        try:
            secret = WatchedFile(secret_file, lambda text: parse_secret(text.strip(), secret_file), what)
        except (OSError, UnicodeDecodeError) as exc:
            raise WebhookConfigError(f"{what}: cannot read it ({exc})") from None
        return cls(url, secret=secret)

    def signing_key(self) -> bytes:
        return self.secret.get() if self.secret is not None else self.key


def parse_secret(text: str, source: str) -> bytes:
    """The key of a `whsec_<base64>` secret."""
    how = f'write one as: echo "{SECRET_PREFIX}$(openssl rand -base64 32)" > FILE'
    if not text.startswith(SECRET_PREFIX):
        raise WebhookConfigError(f"--webhook-secret-file {source}: not a {SECRET_PREFIX}<base64> secret; {how}")
    try:
        key = base64.b64decode(text.removeprefix(SECRET_PREFIX), validate=True)
    except (binascii.Error, ValueError):
        message = f"--webhook-secret-file {source}: what follows {SECRET_PREFIX} is not base64; {how}"
        raise WebhookConfigError(message) from None
    if len(key) < MIN_KEY_BYTES:
        raise WebhookConfigError(
            f"--webhook-secret-file {source}: its key is {len(key)} bytes, under {MIN_KEY_BYTES}; {how}"
        )
    return key


def signature(key: bytes, event_id: str, timestamp: int, body: bytes) -> str:
    """The webhook-signature header's value for one attempt."""
    signed = f"{event_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def event_of(job: dict[str, Any]) -> dict[str, Any] | None:
    """The event of a job that ended (None for one that has not): `job` as GET /v1/videos/{id} answers."""
    kind = EVENT_TYPES.get(job.get("status", ""))
    if kind is None:
        return None
    data = {**job, "content_url": f"/v1/videos/{job['id']}/content"} if kind == "video.completed" else job
    return {"id": f"evt_{uuid.uuid4().hex}", "object": "event", "type": kind, "created_at": int(time.time()),
            "data": data}  # fmt: skip


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:  # a 3xx is the receiver's answer
        return None


class Webhooks:
    """Delivers the events of the jobs this head ends, and of those it adopts from heads that died
    (webhook_outbox.py), each in a task of its own on the head's loop."""

    def __init__(
        self,
        target: WebhookTarget,
        registry: CollectorRegistry | None = None,
        outbox: Outbox | None = None,
        retry_after_s: tuple[float, ...] = RETRY_AFTER_S,
    ) -> None:
        self.target = target
        self.shown = shown_url(target.url)  # in logs: a URL's query or user part may hold a token
        self.outbox = outbox  # None: events live in this head's memory only
        self.retry_after_s = retry_after_s
        self._opener = urllib.request.build_opener(_NoRedirects)
        self._tasks: dict[asyncio.Task[None], Pending] = {}
        # Outbox writes under way: a thread's write goes on when its task is cancelled, and must land
        # before a hand-over's, which it would otherwise overwrite with a live lease.
        self._writes: set[asyncio.Future[None]] = set()
        self._failing: set[str] = set()  # names of outbox writes failing now (logged once until one lands)
        self._settled: set[str] = set()  # events whose delivery ended, their records being removed
        self.deliveries = Counter(
            "triptych_webhook_deliveries",
            "Webhook events by how they ended on this head: delivered (a 2xx), refused (another 4xx or a "
            "redirect), undelivered (no 2xx after every attempt), handed_over (the head stopped first: "
            "another head delivers it)",
            ["type", "outcome"],
            registry=registry,
        )
        self.attempts = Counter(
            "triptych_webhook_attempts", "Webhook POSTs made, first attempts and retries", registry=registry
        )
        self.adopted = Counter(
            "triptych_webhook_adoptions", "Webhook events this head took over from a head that died", registry=registry
        )
        self.pending = Gauge("triptych_webhooks_pending", "Webhook events not delivered yet", registry=registry)
        log.info("webhooks: the ends of video jobs go to %s", self.shown)

    def job_ended(self, job: dict[str, Any]) -> None:
        """Deliver the event of a job that ended, in the background (on the running loop)."""
        event = event_of(job)
        if event is not None:
            self._start(Pending(event))

    def _start(self, pending: Pending) -> None:
        task = asyncio.ensure_future(self._deliver(pending))
        self._tasks[task] = pending
        self.pending.inc()
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        self.pending.dec()

    async def _deliver(self, pending: Pending) -> None:
        kind = pending.event["type"]
        try:
            outcome = await self._attempts(pending)
        except asyncio.CancelledError:  # the head stops: close() hands the event over
            self.deliveries.labels(kind, "handed_over" if self.outbox is not None else "undelivered").inc()
            raise
        except Exception:  # a bug: the event ends here, counted, rather than being adopted and sent for ever
            log.exception("webhook %s: delivering it failed", pending.event_id)
            outcome = "undelivered"
        self.deliveries.labels(kind, outcome).inc()
        if self.outbox is not None:
            self._settled.add(pending.event_id)  # a stop while it is removed hands nothing over
            await self._in_store(self.outbox.remove, pending.event_id)
            self._settled.discard(pending.event_id)

    async def _attempts(self, pending: Pending) -> str:
        """Send until delivered, refused or out of attempts: which of the three."""
        body = json.dumps(pending.event, separators=(",", ":")).encode()
        what = f"webhook {pending.event_id} ({pending.event['type']} of {pending.event['data']['id']})"
        await self._keep(pending, LEASE_S)  # in the store before the first attempt: a head that dies, another sends it
        while True:
            status, retry_after = await asyncio.to_thread(self._post, pending.event_id, body)
            pending.attempts += 1
            if status is not None and 200 <= status < 300:
                return "delivered"
            if status is not None and status < 500 and status not in RETRIED:
                log.warning("%s: %s answered %d; not sent again", what, self.shown, status)
                return "refused"
            if pending.attempts > len(self.retry_after_s):
                log.warning("%s: %s did not take it after %d attempts", what, self.shown, pending.attempts)
                return "undelivered"
            wait = max(self.retry_after_s[pending.attempts - 1], min(retry_after or 0.0, MAX_WAIT_S))
            answer = "no answer" if status is None else f"{status}"
            log.info("%s: %s from %s; sending again in %.0f s", what, answer, self.shown, wait)
            await self._wait_keeping(pending, wait)

    async def _wait_keeping(self, pending: Pending, wait: float) -> None:
        """Sleep `wait`, renewing the event's lease every third of LEASE_S meanwhile: other heads see
        its record change (sightings.py), so none takes it for an orphan, whatever their clocks."""
        end = time.monotonic() + wait
        while (left := end - time.monotonic()) > 0:
            await self._keep(pending, left + LEASE_S)
            await asyncio.sleep(min(left, LEASE_S / 3))

    async def _keep(self, pending: Pending, lease_s: float) -> None:
        if self.outbox is not None:
            await self._in_store(self.outbox.save, pending, lease_s)

    async def _in_store(self, fn: Callable[..., None], *args: Any) -> bool:
        """A write to the outbox; a store that fails costs the event its hand-over, not its delivery.
        Failures are logged once per kind of write until one lands (lease renewals every 10 s per
        waiting event would flood the log through a store outage). Whether it landed."""
        name = getattr(fn, "__name__", str(fn))
        write = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._writes.add(write)
        write.add_done_callback(self._written)
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if name not in self._failing:
                self._failing.add(name)
                log.warning("webhook outbox: %s failed (%s); retried with the next write, logged once", name, exc)
            return False
        if name in self._failing:
            self._failing.discard(name)
            log.info("webhook outbox: %s works again", name)
        return True

    def _written(self, write: asyncio.Future[None]) -> None:
        self._writes.discard(write)
        if not write.cancelled():
            write.exception()  # seen here too: a write whose task was cancelled is awaited by no one else

    def _post(self, event_id: str, body: bytes) -> tuple[int | None, float | None]:
        """One attempt: the answer's status and Retry-After (None, None: no answer)."""
        self.attempts.inc()
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "user-agent": "triptych-webhooks",
            "webhook-id": event_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(self.target.signing_key(), event_id, timestamp, body),
        }
        request = urllib.request.Request(self.target.url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=DELIVERY_TIMEOUT_S) as answer:
                try:
                    answer.read(1 << 16)
                except (OSError, ValueError, http.client.HTTPException) as exc:  # its status was said: it counts
                    log.debug("webhook %s: the answer's body broke off: %s", event_id, exc)
                return answer.status, None
        except urllib.error.HTTPError as exc:
            return exc.code, _seconds(exc.headers.get("retry-after"))
        # refused, reset, timed out, a name that does not resolve; an answer that is not HTTP (a TLS port
        # asked in the clear), a header line too long
        except (OSError, ValueError, http.client.HTTPException) as exc:
            log.debug("webhook %s: %s", event_id, exc)
            return None, None

    async def adopt_orphans(self) -> None:
        """Deliver the events of heads that died or handed them over (webhook_outbox.py)."""
        if self.outbox is None:
            return
        mine = {p.event_id for p in self._tasks.values()}
        for pending in await asyncio.to_thread(self.outbox.orphans, time.time()):
            if pending.event_id in mine or not await asyncio.to_thread(self.outbox.claim, pending):
                continue
            log.warning("webhook %s: its head stopped before delivering it; delivering it here", pending.event_id)
            self.adopted.inc()
            self._start(pending)

    async def close(self, grace_s: float) -> None:
        """Wait up to `grace_s` for deliveries under way, then stop the rest: handed over to the other
        heads through the outbox (their leases end now), or, without one, lost (logged)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        left = dict(self._tasks)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        await asyncio.gather(*self._writes, return_exceptions=True)  # renewals under way land first
        handed = 0
        for pending in left.values():
            if pending.event_id in self._settled:
                continue  # ended: its record's removal landed (awaited above), nothing to hand over
            if self.outbox is None:
                log.warning("webhook %s: not delivered, the head stopped", pending.event_id)
            elif await self._in_store(self.outbox.save, pending, 0.0):
                handed += 1
            else:
                log.warning("webhook %s: not handed over (the store did not take it); lost", pending.event_id)
        if handed:
            log.warning("handed %d webhook events not yet delivered to the other heads", handed)


def _seconds(value: str | None) -> float | None:
    """A Retry-After in seconds (its date form is not taken)."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
