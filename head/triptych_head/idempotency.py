"""Idempotency-Key: a client that retries a request with the same key gets the first run's answer,
or exactly one new run, whichever head of the pipeline it reaches.

A key's runs are records in the result store every head shares (objects.py), one per attempt:

    idempotency/<digest>.<n>.json        {"state": "running" | "done" | "failed", "fingerprint", "head",
                                          "lease_until"}; written once with `create` (one head wins
                                          attempt n), then rewritten by that head alone
    idempotency/<digest>.<n>.response    the answer of a run that is done

<digest> hashes the caller's scope (its API key) and the key, so two tenants' keys never meet.
A request whose key has

- no record, or a last attempt that failed, or one whose head stopped renewing its lease (it
  died; judged on this head's own clock, sightings.py): runs, as attempt n+1, if this head wins
  that attempt's record; a head that loses it follows the winner instead. So of any number of
  retries at once, one runs;
- a last attempt running on a live head: waits for it (polling the record), then answers what it
  answered; still running after the caller's wait: InProgress (the client retries later);
- a last attempt done: that answer, without running anything;
- a different request body (fingerprint) under the same key: KeyReused.

The records go with the results, by the same retention (results.py).

An answer is bytes, or, when large (a b64_json image answer of megabytes), the chunks of a body
streamed as it is encoded: those are written to the store's staging folder chunk by chunk and
stored as a file, and an answer stored larger than STREAM_BYTES is streamed back out of the store
(first run and replays alike), so the head never holds a large answer whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import random
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from triptych_head.objects import CHUNK_BYTES, ObjectMissing, ObjectStore, StoredObject
from triptych_head.sightings import Sightings

log = logging.getLogger(__name__)

FOLDER = "idempotency"
LEASE_S = 30.0  # a running attempt whose head has not renewed its record for this long lost its head
POLL_S = 0.2  # how often a request waiting on another head's run re-reads its record
MAX_KEY_LENGTH = 255
STREAM_BYTES = 4 << 20  # a stored answer larger than this is streamed out of the store, not read whole

Body = bytes | AsyncIterator[bytes]  # what a run answers: whole, or in chunks as it is encoded
Answer = bytes | Iterator[bytes]  # what the caller sends: whole, or streamed out of the store


class KeyReused(Exception):
    """The key was used before with a different request."""


class InProgress(Exception):
    """Another run of the key has not ended within the caller's wait."""


@dataclass
class Attempt:
    state: str  # running, done, failed
    fingerprint: str  # "": not known yet (its record is being written)
    head: str
    lease_until: float  # by its head's clock: read by heads of releases before sightings.py


def valid_key(key: str) -> bool:
    """Printable ASCII without spaces, 1-255 characters (a UUID is the usual choice)."""
    return 0 < len(key) <= MAX_KEY_LENGTH and all("!" <= c <= "~" for c in key)


class Idempotency:
    def __init__(
        self,
        objects: ObjectStore,
        head_id: str,
        lease_s: float = LEASE_S,
        poll_s: float = POLL_S,
        sightings: Sightings | None = None,
    ) -> None:
        self.objects = objects
        self.head_id = head_id
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.sightings = sightings or Sightings()  # how long other heads' records stood unchanged
        self._tidying: set[asyncio.Future[None]] = set()  # earlier attempts being removed (held: not collected)

    @staticmethod
    def digest(scope: str, key: str) -> str:
        return hashlib.sha256(f"{scope}\0{key}".encode()).hexdigest()

    @staticmethod
    def _record(digest: str, n: int) -> str:
        return f"{FOLDER}/{digest}.{n}.json"

    @staticmethod
    def _response(digest: str, n: int) -> str:
        return f"{FOLDER}/{digest}.{n}.response"

    async def once(
        self, scope: str, key: str, fingerprint: str, run: Callable[[], Awaitable[Body]], wait_s: float
    ) -> tuple[Answer, bool]:
        """(the answer, whether it is a replay of an earlier run). `run` is awaited at most once, and
        only when this head won the key's next attempt; its exception (the run failed) propagates
        and a later retry runs again."""
        digest = self.digest(scope, key)
        deadline = time.monotonic() + wait_s
        while True:
            n, attempt, live = await asyncio.to_thread(self._latest, digest)
            if attempt is not None and attempt.fingerprint and attempt.fingerprint != fingerprint:
                raise KeyReused(key)
            if attempt is not None and attempt.state == "done":
                try:
                    return await asyncio.to_thread(self._read, self._response(digest, n)), True
                except ObjectMissing:  # removed by retention between the two reads: run it again
                    attempt = None
            if attempt is not None and live:
                if time.monotonic() >= deadline:
                    raise InProgress(key)
                await asyncio.sleep(self.poll_s)
                continue
            nxt = 0 if n < 0 else n + 1
            mine = Attempt("running", fingerprint, self.head_id, time.time() + self.lease_s)
            record = self._record(digest, nxt)
            if await asyncio.to_thread(self.objects.create, record, _encode(mine), "application/json"):
                if await asyncio.to_thread(self._superseded, digest, nxt):
                    continue  # its number was free again only because a later attempt removed it
                return await self._hold(digest, nxt, mine, run), False
            await asyncio.sleep(random.uniform(0.5, 1.5) * self.poll_s)  # another head won it (or we both withdrew)

    def _superseded(self, digest: str, n: int) -> bool:
        """Whether the key has an attempt after n, the one this head just won: the number n was free
        again because that later attempt removed the ones before it (_forget_before), so n is not the
        key's next attempt. Its record is withdrawn, and the head follows the later one."""
        if self._latest(digest)[0] <= n:
            return False
        self.objects.delete(self._record(digest, n))
        return True

    def _forget_before(self, digest: str, n: int) -> None:
        """Remove the key's attempts before n, which ended (failed, or their heads died): only the last
        is ever read, and a client retrying a failing request for days would otherwise keep them all
        (retention ages a key by its newest record)."""
        try:
            for number, _, obj in list(self._attempts(digest)):
                if number < n:
                    self.objects.delete(obj.name)
        except Exception as exc:  # tidying only: the run goes on
            log.warning("could not remove the earlier attempts of idempotency record %s: %s", digest, exc)

    async def _hold(self, digest: str, n: int, mine: Attempt, run: Callable[[], Awaitable[Body]]) -> Answer:
        """Run attempt n, renewing its lease, then record its answer (or its failure)."""
        ended = asyncio.Event()
        renewal = asyncio.create_task(self._renew(digest, n, mine, ended))
        if n:  # beside the run, its lease renewed meanwhile: many old attempts take many round trips
            tidying = asyncio.ensure_future(asyncio.to_thread(self._forget_before, digest, n))
            self._tidying.add(tidying)
            tidying.add_done_callback(self._tidying.discard)
        try:
            answer = await run()
            # A streamed body goes to a file first: an encoder failing mid-way fails the run.
            payload = answer if isinstance(answer, bytes) else await self._spool(answer)
        except BaseException:
            ended.set()
            await asyncio.shield(renewal)  # its write in flight lands before ours, never after
            mine.state = "failed"
            await self._save(digest, n, mine)
            raise
        ended.set()
        await renewal
        name = self._response(digest, n)
        try:
            if isinstance(payload, bytes):
                await asyncio.to_thread(self.objects.put_bytes, name, payload, "application/json")
            else:
                await asyncio.to_thread(self.objects.put_file, name, payload, "application/json")  # consumes it
        except Exception:  # the run happened: its answer still goes to its client; a retry may run it again
            log.exception("could not save the answer of idempotency record %s.%d", digest, n)
            mine.state = "failed"
            await self._save(digest, n, mine)
            return payload if isinstance(payload, bytes) else _consumed(payload)
        mine.state = "done"  # after the answer: a head that reads `done` finds it
        await self._save(digest, n, mine)
        return payload if isinstance(payload, bytes) else await asyncio.to_thread(self._read, name)

    async def _spool(self, chunks: AsyncIterator[bytes]) -> Path:
        """The chunks, written one at a time to a file in the store's staging folder (for put_file)."""
        self.objects.staging.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="answer-", dir=self.objects.staging)
        path = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in chunks:
                    await asyncio.to_thread(f.write, chunk)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path

    def _read(self, name: str) -> Answer:
        """A stored answer: whole when small, else streamed out of the store (its first chunk read
        here, so that an answer removed meanwhile raises ObjectMissing now, not mid-response)."""
        stored = self.objects.stat(name)
        if stored is None:
            raise ObjectMissing(name)
        if stored.size <= STREAM_BYTES:
            return self.objects.get_bytes(name)
        chunks = self.objects.stream(name)
        first = next(chunks, b"")
        return itertools.chain([first], chunks)

    async def _renew(self, digest: str, n: int, mine: Attempt, ended: asyncio.Event) -> None:
        """Rewrite the record every third of a lease until the run ends. Not cancelled: a write cut
        off mid-way would still land (it runs in a thread), possibly after the final one."""
        while True:
            try:
                await asyncio.wait_for(ended.wait(), self.lease_s / 3)
                return
            except TimeoutError:
                mine.lease_until = time.time() + self.lease_s
                await self._save(digest, n, mine)

    async def _save(self, digest: str, n: int, attempt: Attempt) -> None:
        try:
            record, data = self._record(digest, n), _encode(attempt)
            await asyncio.to_thread(self.objects.put_bytes, record, data, "application/json")
        except Exception:  # the run's own answer still goes to its client; a retry may run it again
            log.exception("could not save idempotency record %s.%d", digest, n)

    def _attempts(self, digest: str) -> Iterator[tuple[int, str, StoredObject]]:
        """The key's attempts' objects: (attempt number, suffix: json or response, the object)."""
        for obj in self.objects.list(f"{FOLDER}/{digest}."):
            number, _, suffix = obj.name.rsplit("/", 1)[-1].removeprefix(f"{digest}.").partition(".")
            if number.isdigit():
                yield int(number), suffix, obj

    def _latest(self, digest: str) -> tuple[int, Attempt | None, bool]:
        """The key's last attempt: (n, its record, whether it runs on a live head), or (-1, None, False)
        when it has none. A running attempt's head is gone once its record stood unchanged for a lease
        (sightings.py). A record that cannot be read, until it stood so for a lease, is one being
        written (a store without hard links creates it empty, its content just after): a running
        attempt, whose request is not known yet."""
        written = {number: obj for number, suffix, obj in self._attempts(digest) if suffix == "json"}
        if not written:
            return -1, None, False
        n = max(written)
        name = self._record(digest, n)
        try:
            raw = self.objects.get_bytes(name)
            data = json.loads(raw)
            attempt = Attempt(**{k: data[k] for k in ("state", "fingerprint", "head", "lease_until")})
            lease_until = float(attempt.lease_until)
        except (ObjectMissing, ValueError, KeyError, TypeError) as exc:
            obj = written[n]
            if not self.sightings.lapsed(name, (obj.mtime, obj.size, obj.tag), self.lease_s, obj.mtime + self.lease_s):
                return n, Attempt("running", "", "", obj.mtime + self.lease_s), True
            log.warning("skipping unreadable idempotency record %s.%d: %s", digest, n, exc)
            return n, None, False  # its attempt number is taken all the same: the next run is n+1
        live = attempt.state == "running" and not self.sightings.lapsed(name, raw, self.lease_s, lease_until)
        return n, attempt, live


def _encode(attempt: Attempt) -> bytes:
    return json.dumps(asdict(attempt)).encode()


def _consumed(path: Path) -> Iterator[bytes]:
    """A spooled answer's bytes, a chunk at a time, its file removed after (as put_file would have)."""
    try:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                yield chunk
    finally:
        path.unlink(missing_ok=True)
