"""A client of a Triptych head's HTTP API (what `triptych generate / video / status` use).

    client = TriptychClient("http://head:30000", api_key="...")
    pngs = client.generate_images({"prompt": "a lighthouse", "size": "512x512", "seed": 1})
    pngs = client.edit_images({"prompt": "at night", "seed": 1}, Reference.of("photo.png"))
    job = client.create_video({"prompt": "waves", "num_frames": 33})
    for event in client.video_events(job["id"]): ...

It speaks HTTP only (no ZMQ, no access to workers), so it works against any head it can reach:
one URL (a Service or an Ingress in front of several heads) or several heads' URLs, tried in turn.

Retries (`retries`, 3 by default; 0: none): a head can die or restart under a request. Every
generation POST, streamed or not, carries an `Idempotency-Key` (a new UUID per call, or the
caller's `idempotency_key`), so the head side runs it once however often it is sent
(docs/results.md), and the client sends it again when the connection broke or could not be made,
when a proxy answered 502, 503 or 504 (its head went away), and on 429 or 409 with a Retry-After
(overloaded, a key's limit, the first attempt still running) after waiting that long, at most
MAX_RETRY_AFTER_S. A connection failure moves on to the next URL at once; the other retries wait
a growing backoff. GETs retry the same way (they change nothing). A stream cut before its last
event is sent again too: a job's events from the start, a streamed image request under its key
(its progress again from the run that takes it over, or only its `completed` event when it had
finished), and a streamed request whose `error` event says its head stopped under it (at most
`retries` times). `retries` counts failures in a row: a reconnection that brings an event not seen
before starts the count again. A read that timed out is never retried (`timeout` is the caller's bound).
"""

from __future__ import annotations

import base64
import json
import mimetypes
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from triptych.protocol.messages import HEAD_SHUT_DOWN


class ClientError(Exception):
    """The head answered with an error (its message), or could not be reached."""


@dataclass(frozen=True)
class Event:
    """One Server-Sent Event of a request's progress (head/triptych_head/api/progress.py)."""

    event: str
    data: dict[str, Any]


def iter_sse(lines: Iterable[str]) -> Iterator[Event]:
    """Parse `event:` / `data:` blocks separated by blank lines; comments (keep-alives) are skipped."""
    name, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield Event(name, json.loads("\n".join(data)))
            name, data = "message", list[str]()
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def naming(message: str, request_id: str | None) -> str:
    """An error's words and the request they are about, where the head gave it an id (its logs name
    the failure so): an HTTP error's X-Request-Id, or a stream's error event's id."""
    return f"{message} (request {request_id})" if request_id else message


def _error_text(response: httpx.Response) -> str:
    """The error's message, naming the request (X-Request-Id, at most 100 characters of it)."""
    request_id = response.headers.get("x-request-id")
    request_id = request_id[:100] if request_id else None
    try:
        return naming(str(response.json()["error"]["message"]), request_id)
    except (ValueError, KeyError, TypeError):
        return naming(response.text[:500] or response.reason_phrase, request_id)


@dataclass(frozen=True)
class Reference:
    """An edit's reference image: a file's bytes (uploaded) or an http(s) URL (the server fetches it)."""

    data: bytes | None = None
    url: str | None = None
    name: str = "image.png"

    @classmethod
    def of(cls, image: str) -> Reference:
        """`image` as a user gives it: an http(s) URL, else a path to an image file."""
        if image.startswith(("http://", "https://")):
            return cls(url=image)
        try:
            return cls(data=Path(image).read_bytes(), name=Path(image).name)
        except OSError as exc:
            raise ClientError(f"image: cannot read {image}: {exc.strerror or exc}") from None

    def form(self, body: dict[str, Any]) -> dict[str, Any]:
        """httpx keyword arguments for a POST /v1/images/edits of `body` with this reference."""
        fields = {k: _form_text(v) for k, v in body.items()}
        if self.url is not None:
            return {"data": {**fields, "image": self.url}}
        mime = mimetypes.guess_type(self.name)[0] or "application/octet-stream"
        return {"data": fields, "files": {"image": (self.name, self.data, mime)}}


def _form_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool | list | dict) else str(value)


def _image_files(response: httpx.Response) -> list[bytes]:
    return [base64.b64decode(item["b64_json"]) for item in response.json()["data"]]


IDEMPOTENCY_HEADER = "Idempotency-Key"
RETRY_STATUSES = frozenset({502, 503, 504})  # a proxy whose head went away (or is restarting)
WAIT_STATUSES = frozenset({409, 429})  # retried only with a Retry-After: in progress, overloaded, a key's limit
MAX_RETRY_AFTER_S = 60.0  # a longer Retry-After is the caller's decision: the error is raised instead
BACKOFF_S = (0.5, 1.0, 2.0, 4.0)  # before the 1st, 2nd, ... retry of the same URL (then the last)


class TriptychClient:
    def __init__(
        self,
        url: str | Sequence[str],
        api_key: str | None = None,
        timeout: float = 600.0,
        retries: int = 3,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        urls = [u.strip().rstrip("/") for u in ([url] if isinstance(url, str) else url) for u in u.split(",")]
        self.urls = [u for u in urls if u]
        if not self.urls:
            raise ClientError("url: give the head's HTTP URL (several, comma-separated, are tried in turn)")
        hint = "give the head's http:// or https:// URL, e.g. http://127.0.0.1:30000 or http://[::1]:30000"
        for u in self.urls:
            try:
                parsed = httpx.URL(u)
            except httpx.InvalidURL as exc:
                raise ClientError(f"url {u!r}: {exc}; {hint}") from None
            port_ok = parsed.port is None or 0 < parsed.port <= 65535
            if parsed.scheme not in ("http", "https") or not parsed.host or not port_ok:
                raise ClientError(f"url {u!r}: {hint}")
        if retries < 0:
            raise ClientError(f"retries: {retries} must be >= 0")
        if api_key and not (api_key.isascii() and api_key.isprintable()):  # no line break in the header
            raise ClientError(
                "api key: an API key is ASCII text without line breaks or other control characters (an HTTP header "
                "carries it); check the key given"
            )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.retries = retries
        self.http = httpx.Client(headers=headers, timeout=timeout)
        self._next = 0  # the URL the next request goes to first (the last one that answered)
        self._sleep = sleep

    @property
    def url(self) -> str:
        """The URL requests go to now."""
        return self.urls[self._next]

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, idempotent: bool = True, **kwargs: Any) -> httpx.Response:
        """One API call, retried as the module docstring says; `idempotent=False`: a POST that may
        only be sent again when no head took it."""
        failures: list[str] = []
        for attempt in range(self.retries + 1):
            url = self.url
            try:
                response = self.http.request(method, url + path, **kwargs)
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {exc or type(exc).__name__}")
                if not (_retryable(exc, idempotent) and attempt < self.retries):
                    raise ClientError(_unreached(failures)) from None
                self._failover(attempt)
                continue
            if response.status_code < 400:
                return response
            wait = _wait_for(response) if attempt < self.retries else None
            if wait is None:
                raise ClientError(f"{response.status_code}: {_error_text(response)}")
            failures.append(f"{url}: {response.status_code} {_error_text(response)}")
            if response.status_code in RETRY_STATUSES:
                self._failover(attempt, wait)
            else:
                self._sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _failover(self, attempt: int, wait: float | None = None) -> None:
        """On to the next URL: at once the first time round the list, after a backoff after that."""
        self._next = (self._next + 1) % len(self.urls)
        round_trip = (attempt + 1) // len(self.urls)
        if wait or round_trip:
            self._sleep(wait or BACKOFF_S[min(round_trip, len(BACKOFF_S)) - 1])

    def _keyed(self, idempotency_key: str | None, kwargs: dict[str, Any]) -> bool:
        """Give a generation POST its Idempotency-Key when it may be sent again (or the caller named
        one); whether it has one."""
        if not (self.retries or idempotency_key):
            return False
        key = idempotency_key or str(uuid.uuid4())
        kwargs["headers"] = {**kwargs.get("headers", {}), IDEMPOTENCY_HEADER: key}
        return True

    def _generation(self, path: str, idempotency_key: str | None, **kwargs: Any) -> httpx.Response:
        """A generation POST, with an Idempotency-Key when it may be retried."""
        return self._request("POST", path, idempotent=self._keyed(idempotency_key, kwargs), **kwargs)

    def _streamed_generation(self, path: str, idempotency_key: str | None, **kwargs: Any) -> Iterator[Event]:
        """A generation POST with stream: true; with a key, a cut stream is sent again (under it)."""
        return self._events("POST", path, resumable=self._keyed(idempotency_key, kwargs), **kwargs)

    def _events(self, method: str, path: str, resumable: bool = False, **kwargs: Any) -> Iterator[Event]:
        """The Server-Sent Events of `path`; `resumable` (a GET of a job's events, which any head
        serves from the start, or a streamed POST under an Idempotency-Key): a connection lost
        midway is opened again, on the next URL, as are a proxy's 502-504 and a 409/429 with a
        Retry-After. `retries` bounds those failures in a row: a connection that brought an event
        not seen before (a new state or step) starts the count again, so a long job followed across
        several head restarts is not given up on; out of them, a resumable stream raises ClientError
        naming every failure (one that is not resumable just ends: the caller sees it end without a
        result). An `error` event saying the head stopped under the request (_head_gone: the key's
        next attempt runs it on another head) is sent again too, at most `retries` times in all; any
        other error event is the request's end, as is that one past them."""
        failures: list[str] = []
        seen: set[tuple[Any, ...]] = set()  # what the connections so far brought (_progress_mark)
        attempt = 0
        runs_lost = 0  # runs the head stopped under (their error events), never forgiven
        while True:
            url = self.url
            wait: float | None = None
            try:
                with self.http.stream(method, url + path, **kwargs) as response:
                    if response.status_code >= 400:
                        response.read()
                        wait = _wait_for(response) if resumable and attempt < self.retries else None
                        if wait is None:
                            raise ClientError(f"{response.status_code}: {_error_text(response)}")
                        failures.append(f"{url}: {response.status_code} {_error_text(response)}")
                    else:
                        for event in iter_sse(response.iter_lines()):
                            mark = _progress_mark(event)
                            if mark not in seen:
                                seen.add(mark)
                                attempt = 0  # this connection brought news: a fresh count of failures
                                failures.clear()
                            if resumable and _head_gone(event) and runs_lost < self.retries:
                                runs_lost += 1
                                failures.append(f"{url}: {_event_error_text(event)}")
                                break
                            yield event
                            if event.event in ("completed", "error"):
                                return
                        else:
                            if not resumable:
                                return  # the caller sees the stream end without a result
                            failures.append(f"{url}: the stream ended before its result (its head stopped?)")
                            if attempt >= self.retries:
                                raise ClientError(_unreached(failures, "the progress stream ended without a result:"))
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never connected: nothing was lost
                failures.append(f"{url}: {exc or type(exc).__name__}")
                if attempt >= self.retries:
                    raise ClientError(_unreached(failures)) from None
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {exc or type(exc).__name__}")
                if not resumable or isinstance(exc, httpx.ReadTimeout) or attempt >= self.retries:
                    raise ClientError(f"lost the connection to {url}: {exc}") from None
            if wait is not None and response.status_code in WAIT_STATUSES:
                self._sleep(wait)  # the same head may answer: it is overloaded, or the run still goes
            else:
                self._failover(attempt, wait)
            attempt += 1

    def generate_images(self, body: dict[str, Any], idempotency_key: str | None = None) -> list[bytes]:
        """The images of POST /v1/images/generations: PNGs, or the body's output_format."""
        return _image_files(
            self._generation("/v1/images/generations", idempotency_key, json={**body, "response_format": "b64_json"})
        )

    def stream_images(self, body: dict[str, Any], idempotency_key: str | None = None) -> Iterator[Event]:
        """POST /v1/images/generations with stream: its progress events, the last `completed` or `error`."""
        return self._streamed_generation("/v1/images/generations", idempotency_key, json={**body, "stream": True})

    def edit_images(self, body: dict[str, Any], image: Reference, idempotency_key: str | None = None) -> list[bytes]:
        """The images of POST /v1/images/edits (PNGs, or the body's output_format): `body` (prompt, size,
        seed, ...) applied to `image`."""
        return _image_files(
            self._generation("/v1/images/edits", idempotency_key, **image.form({**body, "response_format": "b64_json"}))
        )

    def stream_edits(
        self, body: dict[str, Any], image: Reference, idempotency_key: str | None = None
    ) -> Iterator[Event]:
        """POST /v1/images/edits with stream: its progress events, the last `completed` or `error`."""
        return self._streamed_generation("/v1/images/edits", idempotency_key, **image.form({**body, "stream": True}))

    def create_video(self, body: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        """POST /v1/videos: the job (a retry of it gets the same job id)."""
        return dict(self._generation("/v1/videos", idempotency_key, json=body).json())

    def video(self, video_id: str) -> dict[str, Any]:
        return dict(self._request("GET", f"/v1/videos/{video_id}").json())

    def videos(self, order: str = "desc", page_size: int = 100) -> Iterator[dict[str, Any]]:
        """Every video job this key sees, every head's, newest first (`order="asc"`: oldest first):
        GET /v1/videos page by page, each page after the one before's last job."""
        after: str | None = None
        while True:
            query = {"limit": page_size, "order": order, **({"after": after} if after else {})}
            page = self._request("GET", "/v1/videos", params=query).json()
            yield from page["data"]
            if not page["has_more"] or not page["data"]:
                return
            after = page["last_id"]

    def video_events(self, video_id: str) -> Iterator[Event]:
        """The job's progress events until it ends; a lost connection is opened again (from any head)."""
        return self._events("GET", f"/v1/videos/{video_id}/events", resumable=True)

    def cancel_video(self, video_id: str) -> dict[str, Any]:
        return dict(self._request("DELETE", f"/v1/videos/{video_id}").json())

    def save_video(self, video_id: str, path: Path) -> int:
        """Write the job's MP4 to `path` (whole or not at all); returns its size in bytes. A head that
        presigns content (--results-presign) redirects to the bucket: followed (httpx sends the API key
        to the head's origin only)."""
        content = self._request("GET", f"/v1/videos/{video_id}/content", follow_redirects=True).content
        partial = path.with_name(f".{path.name}.partial")
        partial.write_bytes(content)
        partial.replace(path)
        return len(content)

    def pipeline(self) -> dict[str, Any]:
        return dict(self._request("GET", "/v1/pipeline").json())


def _retryable(exc: httpx.HTTPError, idempotent: bool) -> bool:
    """Whether a request that failed with `exc` may be sent again: it never reached a head, or it
    carries an Idempotency-Key (or changes nothing) and did not merely run past the caller's timeout."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return True
    return idempotent and isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException)


def _wait_for(response: httpx.Response) -> float | None:
    """How long to wait before sending `response`'s request again; None: do not send it again."""
    if response.status_code in RETRY_STATUSES:
        return _retry_after(response) or 0.0
    if response.status_code in WAIT_STATUSES:
        return _retry_after(response)
    return None


def _retry_after(response: httpx.Response) -> float | None:
    """The response's Retry-After in seconds (a number), if it has one of at most MAX_RETRY_AFTER_S."""
    try:
        seconds = float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None
    return seconds if 0 <= seconds <= MAX_RETRY_AFTER_S else None


def _unreached(failures: list[str], what: str = "cannot reach") -> str:
    """One line for the failed attempts: each distinct failure once, in order, and how many there were."""
    distinct = list(dict.fromkeys(failures))
    tried = f" ({len(failures)} attempts)" if len(failures) > 1 else ""
    return f"{what} {'; '.join(distinct)}{tried}"


def _progress_mark(event: Event) -> tuple[Any, ...]:
    """Where an event says the request is: its kind, state, role and step (not its request id, which
    a rerun under the same key changes, nor its preview). A connection whose events are all marks seen
    before (a replay from the start, a rerun that got no further) brought no news."""
    data = event.data
    return (event.event, data.get("state"), data.get("role"), data.get("step"))


HEAD_GONE_CODES = frozenset({HEAD_SHUT_DOWN, "shutting_down", "rejected"})


def _head_gone(event: Event) -> bool:
    """An error event that says the head stopped under the request (or, draining, would not take
    it): a 503 whose code is one of HEAD_GONE_CODES. Not a failure the head decided (a deadline
    passed, no instance of a role, retries used up), which another run would repeat."""
    error = event.data.get("error") or {}
    return event.event == "error" and error.get("status") == 503 and error.get("code") in HEAD_GONE_CODES


def _event_error_text(event: Event) -> str:
    """An error event's message, naming its request as an error answer does."""
    error = event.data.get("error") or {}
    return naming(str(error.get("message") or "error"), event.data.get("id"))
