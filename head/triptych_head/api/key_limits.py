"""Per-API-key limits: a tenant's share of the pipeline.

A key of --api-keys-file may carry (auth.py):
- `max_in_flight=N`: at most N of its generation requests run at once, counted as a head's
  admission counts them (context.py: a synchronous or streamed image from its POST to its
  answer, a video job from its POST until it ends). One more gets 429 `key_concurrency_limit`,
  naming the key's limit, with Retry-After.
- `max_per_minute=N`: at most N generation requests admitted per minute, as a token bucket of N
  refilled at N/60 per second (a burst of N, then one every 60/N s). One more gets 429
  `key_rate_limit` with the seconds until the next token as Retry-After. A request the head refuses
  for another reason (the key's in-flight limit, overload, a deadline it would miss) takes no token.

- `max_per_hour=N`, `max_per_day=N`, `max_per_month=N`: at most N admitted in the UTC hour, day or
  calendar month, counted by every head together in the shared result store (key_quotas.py). One
  more gets 429 `key_quota_exceeded` with the seconds until the period ends as Retry-After.
- `max_device_seconds_per_hour=N` (day, month): the same for the device-seconds the key's finished
  requests used (`charge`, as each ends), so the request that crosses the quota finishes and the
  next one gets the 429.

A key with `tenant=NAME` counts against its tenant (`key_id` `tenant:NAME`): the tenant's keys share
one set of limits (auth.py refuses a file whose lines of one tenant give different ones), so
rotating keys does not double a tenant's share, and a refusal names the tenant.

Either way the refusal comes before any worker sees the request, so one tenant's burst queues at
its own door instead of in front of every other tenant's requests. A key without the options, and
an open API (no --api-keys-file), is not counted.

Every limit is the pipeline's, held by all its heads together: each head counts its own requests
and learns the others' through the result store they share, every couple of seconds (in flight and
per minute: key_sharing.py; the quotas: key_quotas.py). A burst reaching several heads within one
such exchange can pass a limit by what the other heads admitted meanwhile.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter

from triptych_head.api.errors import APIError
from triptych_head.api.key_quotas import PERIODS, QuotaExceeded, QuotaLedger
from triptych_head.api.key_sharing import HeadCounts, LiveCounts, PeerCounts
from triptych_head.api.ownership import TENANT_OWNER

KEY_LIMIT = "key_limit"  # request.state: the KeyLimit of the key the request carries (auth.py sets it)
OPTION = "max_in_flight"
RATE_OPTION = "max_per_minute"


@dataclass(frozen=True)
class KeyLimit:
    """A key's limits (None: not limited that way); `key_id` names what is counted: the key (a digest, never
    the key itself), or its tenant (`tenant:NAME`), whose keys share one set of limits."""

    key_id: str
    max_in_flight: int | None = None
    max_per_minute: int | None = None
    quotas: tuple[tuple[str, int], ...] = ()  # (period name, N): max_per_hour=N, ... (key_quotas.py)
    device_quotas: tuple[tuple[str, int], ...] = ()  # (period name, N): max_device_seconds_per_hour=N, ...


def key_limit(request: Request) -> KeyLimit | None:
    """The limit of the key `request` carries; None without one."""
    return getattr(request.state, KEY_LIMIT, None)


class KeyLimits:
    """Each limited key's requests in flight and request tokens on this head, and what the other heads
    hold of them as last heard (`live`); used from the API's event loop only."""

    def __init__(
        self,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
        quotas: QuotaLedger | None = None,
        live: LiveCounts | None = None,
        device_quotas: QuotaLedger | None = None,
    ) -> None:
        self.quotas = quotas  # where the quotas are counted; None: a key's quotas are not applied (tests of the rest)
        self.device_quotas = device_quotas  # where device-seconds are counted (the DEVICE_TIME meter)
        self._metered: dict[str, tuple[str, tuple[str, ...]]] = {}  # request id -> (key id, device quota periods)
        self.live = live  # how the heads share the rest; None: this head's own counts alone (tests of the rest)
        self._in_flight: dict[str, int] = {}  # key id -> its requests counted now (this head's)
        self._peers = PeerCounts()  # the other heads' requests in flight, as last heard
        self._admitted: dict[str, int] = {}  # key id -> the requests this head admitted with a token, since it started
        self._owner: dict[str, str] = {}  # request id -> the key id it counts against
        self._tokens: dict[str, tuple[float, float]] = {}  # key id -> (tokens, when counted); absent: full
        self._took: dict[str, str] = {}  # request id -> the key id whose token it took (until it is admitted)
        self._clock = clock
        self.rejected = Counter(
            "triptych_rejected_key_limit_requests",
            f"Requests refused with 429 because their API key had {OPTION} requests in flight",
            registry=registry,
        )
        self.rejected_rate = Counter(
            "triptych_rejected_key_rate_requests",
            f"Requests refused with 429 because their API key had used its {RATE_OPTION} requests",
            registry=registry,
        )

    def admit(self, request_id: str, limit: KeyLimit | None, retry_after_s: int) -> None:
        """Count `request_id` against its key, or refuse it (APIError 429) at one of the key's limits.
        `retry_after_s`: the Retry-After of a refusal for requests in flight."""
        if limit is None:
            return
        own = self._in_flight.get(limit.key_id, 0)
        count = own + self._peers.in_flight.get(limit.key_id, 0)
        if limit.max_in_flight is not None and count >= limit.max_in_flight:
            self.rejected.inc()
            raise _refusal(
                limit,
                f"{count} requests in flight, the limit ({OPTION}={limit.max_in_flight} in --api-keys-file); "
                "retry when one of them has ended",
                "key_concurrency_limit",
                retry_after_s,
            )
        ledger = self.quotas if limit.quotas else None
        device = self.device_quotas if limit.device_quotas else None
        try:
            if ledger is not None:
                ledger.check(limit.key_id, limit.quotas)
            if device is not None:
                device.check(limit.key_id, limit.device_quotas)
        except QuotaExceeded as exc:
            raise _refusal(limit, str(exc), "key_quota_exceeded", exc.retry_after_s) from None
        if limit.max_per_minute is not None:
            self._take_token(request_id, limit)
        if ledger is not None:
            ledger.take(request_id, limit.key_id, limit.quotas)
        self._count(request_id, limit)

    def adopt(self, request_id: str, limit: KeyLimit | None) -> None:
        """Count `request_id`, a request its key was admitted for once already (a video job taken over
        from a head that died), against its key without checking the key's limits: in flight until it
        ends, and its device-seconds charged when it finishes (its quotas of requests counted it once)."""
        if limit is not None:
            self._count(request_id, limit)

    def _count(self, request_id: str, limit: KeyLimit) -> None:
        self._in_flight[limit.key_id] = self._in_flight.get(limit.key_id, 0) + 1
        self._owner[request_id] = limit.key_id
        if limit.device_quotas and self.device_quotas is not None:
            self._metered[request_id] = (limit.key_id, tuple(name for name, _ in limit.device_quotas))

    def charge(self, request_id: str, device_seconds: float) -> None:
        """`request_id` finished having used `device_seconds`: its key's device-second quotas count them."""
        metered = self._metered.get(request_id)
        if metered is not None and self.device_quotas is not None:
            key_id, periods = metered
            self.device_quotas.add(key_id, periods, round(device_seconds * self.device_quotas.meter.scale))

    def admitted(self, request_id: str) -> None:
        """The head admitted `request_id` further: its token and its quotas' counts are spent for good."""
        key_id = self._took.pop(request_id, None)
        if key_id is not None:
            self._admitted[key_id] = self._admitted.get(key_id, 0) + 1
        if self.quotas is not None:
            self.quotas.spent(request_id)

    def release(self, request_id: str) -> None:
        """`request_id` ended (or was never admitted further, then its token is given back): it no
        longer counts against its key."""
        key_id = self._took.pop(request_id, None)
        if key_id is not None and key_id in self._tokens:
            tokens, at = self._tokens[key_id]
            self._tokens[key_id] = (tokens + 1, at)  # refused after the key's check: not the key's doing
        if self.quotas is not None:
            self.quotas.give_back(request_id)  # likewise its quotas' counts (nothing once admitted)
        self._metered.pop(request_id, None)
        key_id = self._owner.pop(request_id, None)
        if key_id is None:
            return
        left = self._in_flight[key_id] - 1
        if left:
            self._in_flight[key_id] = left
        else:
            del self._in_flight[key_id]

    def in_flight(self, key_id: str) -> int:
        """The key's requests in flight on every head: this one's, and the others' as last heard."""
        return self._in_flight.get(key_id, 0) + self._peers.in_flight.get(key_id, 0)

    def counts(self, per_minute: dict[str, int]) -> HeadCounts:
        """What this head shares with the others (key_sharing.py): its requests in flight per key, the
        requests it admitted with a token per key since it started, and its buckets that are not full
        (`per_minute`: key id -> its max_per_minute)."""
        now = self._clock()
        levels = {key_id: self._refilled(key_id, rate, now) for key_id, rate in per_minute.items()}
        tokens = {key_id: x for key_id, x in levels.items() if x < per_minute[key_id]}
        return HeadCounts(dict(self._in_flight), dict(self._admitted), tokens)

    def heard(self, peers: PeerCounts, per_minute: dict[str, int]) -> None:
        """The other heads' counts, just read: their requests in flight count from now on, and what
        they admitted since the last exchange is taken from this head's bucket of each key
        (`per_minute`: key id -> its max_per_minute), down to at most a minute's worth owed. At this
        head's first exchange its buckets start no fuller than the emptiest of the others'."""
        self._peers = peers
        now = self._clock()
        for key_id, levels in peers.tokens.items():
            rate = per_minute.get(key_id)
            if rate:
                theirs = min(x + age * rate / 60.0 for x, age in levels)
                if theirs < self._refilled(key_id, rate, now):
                    self._tokens[key_id] = (max(-float(rate), theirs), now)
        for key_id, n in peers.admitted.items():
            rate = per_minute.get(key_id)
            if rate:
                self._tokens[key_id] = (max(-float(rate), self._refilled(key_id, rate, now) - n), now)

    def usage(self, limit: KeyLimit | None) -> dict[str, Any]:
        """What the key may still do (GET /v1/usage): each of its limits with what it used, over every
        head as this one last heard from the others."""
        if limit is None:
            return {"object": "usage", "limited": False}
        out: dict[str, Any] = {"object": "usage", "limited": True}
        if limit.max_in_flight is not None:
            out["in_flight"] = {"limit": limit.max_in_flight, "used": self.in_flight(limit.key_id)}
        if limit.max_per_minute is not None:
            tokens = self._refilled(limit.key_id, limit.max_per_minute, self._clock())
            out["per_minute"] = {"limit": limit.max_per_minute, "remaining": max(0, int(tokens))}
        if limit.quotas and self.quotas is not None:
            out["quotas"] = [self.quotas.usage(PERIODS[name], limit.key_id, quota) for name, quota in limit.quotas]
        if limit.device_quotas and self.device_quotas is not None:
            device = self.device_quotas
            out["device_seconds"] = [device.usage(PERIODS[n], limit.key_id, quota) for n, quota in limit.device_quotas]
        return out

    def _refilled(self, key_id: str, per_minute: int, now: float) -> float:
        """The key's tokens at `now`: its bucket refilled at per_minute/60 a second, up to per_minute."""
        tokens, at = self._tokens.get(key_id, (float(per_minute), now))
        return min(float(per_minute), tokens + (now - at) * per_minute / 60.0)

    def _take_token(self, request_id: str, limit: KeyLimit) -> None:
        key_id, per_minute = limit.key_id, limit.max_per_minute
        assert per_minute is not None
        now = self._clock()
        tokens = self._refilled(key_id, per_minute, now)
        if tokens < 1.0:
            self._tokens[key_id] = (tokens, now)
            self.rejected_rate.inc()
            wait_s = max(1, math.ceil((1.0 - tokens) * 60.0 / per_minute - 1e-9))  # not 2 for 1.0000000001
            raise _refusal(
                limit,
                f"used {per_minute} requests per minute ({RATE_OPTION}={per_minute} in --api-keys-file); "
                f"retry in {wait_s} s",
                "key_rate_limit",
                wait_s,
            )
        self._tokens[key_id] = (tokens - 1.0, now)
        self._took[request_id] = key_id


def _refusal(limit: KeyLimit, what: str, code: str, retry_after_s: int) -> APIError:
    """A 429 for a key (or its tenant) at one of its limits: `what` it has done, `code` which limit."""
    holder = f"this API key's tenant {limit.key_id.removeprefix(TENANT_OWNER)!r} (its keys together)" if (
        limit.key_id.startswith(TENANT_OWNER)) else "this API key"  # fmt: skip
    return APIError(
        429,
        f"{holder} has {what}, or ask for a key allowed more",
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )
