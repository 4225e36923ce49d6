"""Generation requests in flight per API key: a tenant's share of the head.

A key of --api-keys-file may carry `max_in_flight=N` (auth.py): at most N of its generation requests
run on this head at once, counted as the head's admission counts them (context.py: a synchronous or
streamed image from its POST to its answer, a video job from its POST until it ends). One more gets
429 `key_concurrency_limit`, naming the key's limit, with Retry-After, before any worker sees it; so
one tenant's burst queues at its own door instead of in front of every other tenant's requests. A
key without the option, and an open API (no --api-keys-file), is not counted.

Each head counts its own requests: behind N heads (a Service spreading a key's requests), a key may
have up to N times its limit in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter

from triptych_head.api.errors import APIError

KEY_LIMIT = "key_limit"  # request.state: the KeyLimit of the key the request carries (auth.py sets it)
OPTION = "max_in_flight"


@dataclass(frozen=True)
class KeyLimit:
    """A key's limit: `key_id` names the key (a digest, never the key itself)."""

    key_id: str
    max_in_flight: int


def key_limit(request: Request) -> KeyLimit | None:
    """The limit of the key `request` carries; None without one."""
    return getattr(request.state, KEY_LIMIT, None)


class KeyLimits:
    """How many requests each limited key has in flight on this head; used from the API's event loop only."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._in_flight: dict[str, int] = {}  # key id -> its requests counted now
        self._owner: dict[str, str] = {}  # request id -> the key id it counts against
        self.rejected = Counter(
            "triptych_rejected_key_limit_requests",
            f"Requests refused with 429 because their API key had {OPTION} requests in flight",
            registry=registry,
        )

    def admit(self, request_id: str, limit: KeyLimit | None, retry_after_s: int) -> None:
        """Count `request_id` against its key, or refuse it (APIError 429) at the key's limit."""
        if limit is None:
            return
        count = self._in_flight.get(limit.key_id, 0)
        if count >= limit.max_in_flight:
            self.rejected.inc()
            raise APIError(
                429,
                f"this API key has {count} requests in flight, its limit ({OPTION}={limit.max_in_flight} in "
                f"--api-keys-file); retry when one of them has ended, or ask for a key allowed more",
                code="key_concurrency_limit",
                headers={"Retry-After": str(retry_after_s)},
            )
        self._in_flight[limit.key_id] = count + 1
        self._owner[request_id] = limit.key_id

    def release(self, request_id: str) -> None:
        """`request_id` ended (or was never admitted further): it no longer counts against its key."""
        key_id = self._owner.pop(request_id, None)
        if key_id is None:
            return
        left = self._in_flight[key_id] - 1
        if left:
            self._in_flight[key_id] = left
        else:
            del self._in_flight[key_id]

    def in_flight(self, key_id: str) -> int:
        return self._in_flight.get(key_id, 0)
