"""API keys: `Authorization: Bearer KEY` on every route but the probes and the metrics scrape.

Keys come from a file (--api-keys-file; on Kubernetes a Secret mounted into the head): one key per
line, blank lines and `#` comments ignored. A key may be followed, after whitespace, by options:
`max_priority=LEVEL` (low, normal or high): the highest `priority` its requests may ask for
(priorities.py); a key without it may ask for normal at most, so a file of bare keys means what it
did before priorities existed. `max_in_flight=N`: at most N of its generation requests at once on
this head; `max_per_minute=N`: at most N admitted per minute on this head, in bursts of up to N
(key_limits.py); `max_per_hour=N`, `max_per_day=N`, `max_per_month=N`: at most N admitted in the UTC
hour, day or month by all the pipeline's heads together (key_quotas.py);
`max_device_seconds_per_hour=N` (day, month): the same for the device-seconds its finished requests
used (their stages' seconds times the devices they ran on); a key without them is not limited.
`tenant=NAME`: whose video jobs the key's requests see (a key sees only its tenant's, or, without
the option, its own: ownership.py), and whose limits they count against: a tenant's keys share one
set (one count in flight, one bucket, one quota), so each of its lines must give the same limits;
give the old and the new key the same tenant, and the same options, when rotating. The
file is re-read when it changes (checked at most once a second, on a request), so rotating keys is
editing the file or the Secret: add the new key, move clients over, remove the old one; no
restart. A file that cannot be read or parsed any more keeps the keys last read (a failed re-read
must not open the API); one that lists no key locks everyone out.

    sk-batch-tenant                      # normal at most
    sk-interactive  max_priority=high    # may ask for high
    sk-backfill     max_priority=low     # low only
    sk-small-tenant max_in_flight=4      # 4 generation requests at once, the 5th gets 429
    sk-trial max_per_minute=10           # 10 a minute (a burst of 10, then one every 6 s)
    sk-metered max_per_day=1000          # 1000 a UTC day, counted by every head
    sk-gpu-budget max_device_seconds_per_month=360000   # 100 device-hours a month, by every head
    sk-acme-2026-12 tenant=acme max_in_flight=8   # acme's jobs and limits, shared by its keys
    sk-acme-2027-01 tenant=acme max_in_flight=8   # rotating in: 8 in flight for both keys together

A presented key is compared with every configured key with hmac.compare_digest, all of them each
time, so neither which key matched nor how much of one did shows in the timing.

/health, /ready and /metrics stay open: the kubelet's probes and Prometheus (and the chart's
metrics API server, which scrapes the head's load for the HPA) carry no API key. They tell a
caller the model id and the pools' load, never request content. So do the playground's static
files (`/`, `/static/...`): the page asks for the key and sends it with its API calls.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from triptych import priority
from triptych.config import MAX_NUMBER
from triptych_head.api.errors import error_body, send_json
from triptych_head.api.key_limits import KEY_LIMIT, RATE_OPTION, KeyLimit
from triptych_head.api.key_limits import OPTION as IN_FLIGHT_OPTION
from triptych_head.api.key_quotas import DEVICE_OPTIONS
from triptych_head.api.key_quotas import OPTIONS as QUOTA_OPTIONS
from triptych_head.api.ownership import OWNER, TENANT, check_tenant, owner_of_key

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/"})
OPEN_PREFIXES = ("/static/",)
RECHECK_S = 1.0


MAX_PRIORITY = "max_priority"
COUNTED = (IN_FLIGHT_OPTION, RATE_OPTION, *QUOTA_OPTIONS, *DEVICE_OPTIONS)  # the options that take a count N
# A count's largest value, as a number flag's (MAX_NUMBER): 400 digits overflowed the bucket's float.
MAX_COUNT = int(MAX_NUMBER)
DEFAULT_CEILING = priority.NORMAL  # a key that names no ceiling: what every request was before priorities


class APIKeyError(ValueError):
    """The keys file cannot be used at start-up; the message names the flag and the file."""


@dataclass(frozen=True)
class APIKey:
    key: str
    max_priority: str = DEFAULT_CEILING  # the highest priority its requests may ask for
    limit: KeyLimit | None = None  # max_in_flight=N, max_per_minute=N, max_per_hour=N, ...
    owner: str = ""  # whose video jobs its requests see (ownership.py): its tenant=NAME, else the key's own


def parse_entries(text: str) -> list[APIKey]:
    """The keys of a keys file and their options; ValueError naming the line for an unknown option or
    a bad value."""
    keys = []
    tenants: dict[str, tuple[int, dict[str, str]]] = {}  # tenant -> the first line naming it, and its limits
    for number, line in enumerate(text.splitlines(), 1):
        key = line.split("#", 1)[0].strip()
        options: dict[str, str] = {}
        while len(parts := key.rsplit(None, 1)) == 2 and "=" in parts[1]:  # NAME=VALUE words after the key
            key = parts[0]
            name, _, value = parts[1].partition("=")
            options[name] = _checked_option(number, name, value)
        if not key:
            continue
        tenant = options.get(TENANT)
        owner = owner_of_key(_key_id(key), tenant)
        counted = {name: int(value) for name, value in options.items() if name in COUNTED}
        if tenant is not None:
            first, limits = tenants.setdefault(tenant, (number, options))
            _check_tenant_limits(tenant, (first, limits), (number, options))
        limit = None
        if counted:  # a tenant's keys share one set of counts, under the tenant's name
            limit = KeyLimit(
                owner if tenant is not None else _key_id(key),
                counted.get(IN_FLIGHT_OPTION),
                counted.get(RATE_OPTION),
                tuple((period.name, counted[o]) for o, period in QUOTA_OPTIONS.items() if o in counted),
                tuple((period.name, counted[o]) for o, period in DEVICE_OPTIONS.items() if o in counted),
            )
        keys.append(APIKey(key, options.get(MAX_PRIORITY, DEFAULT_CEILING), limit, owner))
    return keys


def _check_tenant_limits(tenant: str, first: tuple[int, dict[str, str]], this: tuple[int, dict[str, str]]) -> None:
    """A tenant's keys share its limits (one count of requests in flight, one bucket, one quota), so each of
    its lines gives the same ones: a key rotated in without them would be a way around them."""
    (first_line, first_options), (line, options) = first, this
    theirs, mine = (" ".join(f"{n}={o[n]}" for n in COUNTED if n in o) or "none" for o in (first_options, options))
    if theirs != mine:
        raise ValueError(
            f"line {line}: {TENANT}={tenant}'s keys share the tenant's limits, so each gives the same: line "
            f"{first_line} gives {theirs}, this line {mine}"
        )


def _checked_option(number: int, name: str, value: str) -> str:
    if name == MAX_PRIORITY:
        if value not in priority.LEVELS:
            raise ValueError(f"line {number}: {MAX_PRIORITY}={value!r} is not one of {', '.join(priority.LEVELS)}")
    elif name == TENANT:
        if (problem := check_tenant(value)) is not None:
            raise ValueError(f"line {number}: {TENANT}={value[:80]!r} {problem}")
    elif name in COUNTED:
        # The length first: int() of thousands of digits raises (sys.int_info's limit) or takes long.
        digits = value.lstrip("0")
        whole = value.isascii() and value.isdigit() and len(digits) <= len(str(MAX_COUNT))
        if not whole or not 1 <= int(digits or "0") <= MAX_COUNT:
            shown = repr(value) if len(value) <= 80 else f"{value[:40]!r}... ({len(value)} characters)"
            raise ValueError(f"line {number}: {name}={shown} must be a whole number from 1 to {MAX_COUNT}")
        return digits  # 007 is 7 (int() of 5000 zeros and a 7 would raise)
    else:
        counts = ", ".join(f"{option}=N" for option in COUNTED)
        raise ValueError(
            f"line {number}: unknown option {name!r} (the options are {MAX_PRIORITY}=LEVEL, {TENANT}=NAME, {counts})"
        )
    return value


def _key_id(key: str) -> str:
    """What names a key in the head's counts: a digest (the key itself is compared, never kept twice)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def parse_keys(text: str) -> list[str]:
    return [entry.key for entry in parse_entries(text)]


class APIKeys:
    """The keys of --api-keys-file, re-read when the file changes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._checked = 0.0
        try:
            self._stamp = self._stat()
            self._keys = self._read()
        except OSError as exc:
            raise APIKeyError(f"--api-keys-file {self.path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise APIKeyError(f"--api-keys-file {self.path}, {exc}") from None
        if not self._keys:
            raise APIKeyError(f"--api-keys-file {self.path} lists no key (one per line; # starts a comment)")

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)  # follows the symlinks a mounted Secret swaps on update
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _read(self) -> list[tuple[bytes, APIKey]]:
        return [(k.key.encode(), k) for k in parse_entries(self.path.read_text(encoding="utf-8", errors="replace"))]

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return
        with self._lock:
            self._checked = now
            try:
                stamp = self._stat()
                if stamp == self._stamp:
                    return
                keys = self._read()
            except (OSError, ValueError) as exc:
                log.error("cannot re-read --api-keys-file %s (%s); keeping the keys read before", self.path, exc)
                return
            self._stamp, self._keys = stamp, keys
            log.info("--api-keys-file %s changed: %d keys", self.path, len(keys))
            if not keys:
                log.warning("--api-keys-file %s lists no key: every API request is refused", self.path)

    def quota_periods(self) -> frozenset[str]:
        """The periods (hour, day, month) some key's quotas of requests count in: those the heads keep in sync."""
        self._refresh()
        return frozenset(name for _, entry in self._keys if entry.limit for name, _ in entry.limit.quotas)

    def device_quota_periods(self) -> frozenset[str]:
        """The periods some key's quotas of device-seconds count in."""
        self._refresh()
        return frozenset(name for _, entry in self._keys if entry.limit for name, _ in entry.limit.device_quotas)

    def rates(self) -> dict[str, int]:
        """Key id -> max_per_minute, of the keys limited per minute."""
        self._refresh()
        return {e.limit.key_id: e.limit.max_per_minute for _, e in self._keys if e.limit and e.limit.max_per_minute}

    def limit_of(self, key_id: str) -> KeyLimit | None:
        """The limits the key named `key_id` has now; None when it has none, or is no longer listed."""
        self._refresh()
        return next((e.limit for _, e in self._keys if e.limit and e.limit.key_id == key_id), None)

    def shared_limits(self) -> bool:
        """Whether some key has a limit in flight or per minute: those the heads share every sync."""
        self._refresh()
        return any(e.limit and (e.limit.max_in_flight or e.limit.max_per_minute) for _, e in self._keys)

    def valid(self, presented: bytes) -> bool:
        """Whether `presented` is one of the keys (constant time in which key and how much matched)."""
        return self.match(presented) is not None

    def match(self, presented: bytes) -> APIKey | None:
        """The key `presented` is, with its options, or None; every key is compared, all the way."""
        self._refresh()
        found = None
        for key, entry in self._keys:
            equal = hmac.compare_digest(presented, key)
            found = entry if equal else found
        return found


def bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def _has_authorization(scope: Scope) -> bool:
    return any(name == b"authorization" for name, _ in scope.get("headers", ()))


class APIKeyMiddleware:
    """401 (OpenAI-style body, `WWW-Authenticate: Bearer`) unless the request carries a valid key."""

    def __init__(self, app: ASGIApp, keys: APIKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        entry = self.keys.match(token) if token is not None else None
        if entry is not None:
            state = scope.setdefault("state", {})
            state[MAX_PRIORITY] = entry.max_priority  # request.state.max_priority
            state[OWNER] = entry.owner  # request.state.owner (ownership.py)
            if entry.limit is not None:
                state[KEY_LIMIT] = entry.limit  # request.state.key_limit (key_limits.py)
            await self.app(scope, receive, send)
            return
        if token is not None:
            message = "incorrect API key provided"
        elif _has_authorization(scope):  # a tab, another scheme, no key: telling it to add one would mislead
            message = "malformed Authorization header: it must be 'Bearer YOUR_KEY' (one space between)"
        else:
            message = "missing API key: send 'Authorization: Bearer YOUR_KEY'"
        body = error_body(401, message, code="invalid_api_key")
        # Closed after the answer: a body the client still sends is not read on (as a 413's is not).
        await send_json(send, 401, body, {"www-authenticate": "Bearer", "connection": "close"})
