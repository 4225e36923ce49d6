"""The webhook events not delivered yet, kept in the store every head shares (objects.py), so that an
event whose head dies before delivering it is delivered by another (webhooks.py):

    webhooks/<event id>.json           the event, its attempts so far, and the lease of the head delivering it
    webhooks/<event id>.adopt-<n>      created once: the head that won the event's n-th adoption
                                       (.r2, .r3, ...: a later claim of it, the winner having died first; claims.py)

A head writes an event's record before its first attempt and renews the lease every third of LEASE_S
until it ends (through each wait for the next attempt, whose length the lease covers too); it removes
the record once the event is delivered, refused or given up. A head that stops hands its events over
(their leases end at once); one that dies leaves them until their leases run out: the record stood
unchanged for LEASE_S as the adopting head saw it (sightings.py), and its `lease_until` passed by that
head's clock (a head of an older release renews only before each wait). Every head
looks for such orphans every OUTBOX_SCAN_S and adopts each it wins (the `.adopt-<n>` object,
created once, decides), going on from the attempts already made, with the same event id: a
receiver may see the event twice (the dead head's attempt may have landed), never a different one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from triptych_head import claims
from triptych_head.objects import ObjectMissing, ObjectStore
from triptych_head.sightings import Sightings

log = logging.getLogger(__name__)

FOLDER = "webhooks"
LEASE_S = 30.0  # an event whose head has not renewed its lease for this long lost its head
SCAN_S = LEASE_S / 3  # how often a head looks for events to adopt


@dataclass
class Pending:
    """An event on its way: what is sent, how many attempts it had, and whose it is until when."""

    event: dict[str, Any]
    attempts: int = 0
    adoptions: int = 0
    lease_until: float = 0.0  # by its head's clock (0: handed over)
    head: str = ""
    made: float = field(default_factory=time.time)

    @property
    def event_id(self) -> str:
        return str(self.event["id"])

    @classmethod
    def read(cls, raw: bytes) -> Pending:
        """A record as stored, keys it does not know left out (a record of another release: a rolling
        upgrade or a rollback); ValueError or TypeError when it is not a record."""
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        return cls(**{f.name: body[f.name] for f in dataclasses.fields(cls) if f.name in body})


class Outbox:
    def __init__(self, objects: ObjectStore, head_id: str, sightings: Sightings | None = None) -> None:
        self.objects = objects
        self.head_id = head_id
        self.sightings = sightings or Sightings()  # how long other heads' records stood unchanged

    @staticmethod
    def name(event_id: str) -> str:
        return f"{FOLDER}/{event_id}.json"

    def save(self, pending: Pending, lease_s: float = LEASE_S) -> None:
        """Write the record, this head's for `lease_s` from now (0: handed over, adoptable at once)."""
        pending.head = self.head_id
        pending.lease_until = time.time() + lease_s if lease_s else 0.0
        self.objects.put_bytes(self.name(pending.event_id), json.dumps(asdict(pending)).encode(), "application/json")

    def remove(self, event_id: str) -> None:
        """The record, then its adoption markers (a head that wins a marker after this finds no record)."""
        self.objects.delete(self.name(event_id))
        for obj in list(self.objects.list(f"{FOLDER}/{event_id}.")):
            self.objects.delete(obj.name)

    def orphans(self, now: float) -> list[Pending]:
        """The events whose head stopped renewing their leases (or handed them over). `now`: this head's
        wall clock. Both must say so: the record unchanged for LEASE_S as this head saw it (a head whose
        clock runs ahead takes no event its head renews) and its lease past by this clock (a head of an
        older release leaves the record unchanged through a wait its lease covers)."""
        found = []
        for obj in list(self.objects.list(f"{FOLDER}/")):
            if not obj.name.endswith(".json"):
                continue
            try:
                raw = self.objects.get_bytes(obj.name)
                pending = Pending.read(raw)
                lease_until = float(pending.lease_until)
            except ObjectMissing:  # delivered meanwhile
                continue
            except (ValueError, TypeError):
                log.warning("webhook outbox: %s is not a record this head reads; left as it is", obj.name)
                continue
            if self.sightings.lapsed(obj.name, raw, LEASE_S, lease_until, now) and lease_until < now:
                found.append(pending)
        return found

    def claim(self, pending: Pending) -> bool:
        """Whether this head won the event's next adoption (at most one head does)."""
        base = f"{FOLDER}/{pending.event_id}.adopt-{pending.adoptions + 1}"
        won = claims.claim(self.objects, base, self.head_id.encode(), self.sightings)
        if won is None:
            return False
        # What this head read may be old: another head may have adopted the event since, delivered it
        # and removed it with its markers, so that this marker could be made again. Only the record
        # as it still is now, unadopted since, is this head's to deliver.
        try:
            now = Pending.read(self.objects.get_bytes(self.name(pending.event_id)))
        except (ObjectMissing, ValueError, TypeError):
            now = None
        if now is None or now.adoptions != pending.adoptions:
            self.objects.delete(won.name)
            return False
        pending.adoptions += won.ordinal  # past a superseded claim's (claims.py)
        return True
