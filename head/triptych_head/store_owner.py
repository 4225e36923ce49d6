"""Which pipeline a result store belongs to: the heads of one pipeline share its store, and nothing
in the store says whose a record is. Two pipelines given the same folder, claim or bucket prefix (a
copied DiffusionPipeline, one claim named twice) would take over each other's video jobs and run
them on the wrong model, deliver each other's webhook events to the wrong receiver, and remove each
other's results by their own retention.

So a head told its pipeline (TRIPTYCH_PIPELINE, which the operator sets to `<namespace>/<name>`)
marks the store as that pipeline's (`triptych-store.json`, created once: ObjectStore.create) when it
is no one's yet, and refuses to start on a store marked as another's. A head not told (run by hand)
checks nothing: several such heads of one model may share a folder on purpose.
"""

from __future__ import annotations

import json
import random
import time

from triptych.config import PIPELINE_ENV
from triptych_head.objects import CLAIM_STALE_S, ObjectMissing, ObjectStore, StoreError

ENV = PIPELINE_ENV
MARKER = "triptych-store.json"
CLAIM_WAIT_S = CLAIM_STALE_S + 15.0  # contenders that withdraw try again; a dead one's claim is stale by then
SETTLE_S = 2.0  # a marker another head is writing right now (created empty, then filled) is read again this long


def claim_store(objects: ObjectStore, pipeline: str, wait_s: float = CLAIM_WAIT_S) -> None:
    """Mark the store as `pipeline`'s, or check that it is: StoreError, saying what to do, when it is another's.
    Heads starting together contend for the marker (ObjectStore.create: on S3, two that meet both
    withdraw): each tries again, a little apart, until one wrote it or `wait_s` passed."""
    deadline = time.monotonic() + wait_s
    settled = time.monotonic() + min(SETTLE_S, wait_s)
    data = json.dumps({"pipeline": pipeline}).encode()
    while True:
        if objects.create(MARKER, data, "application/json"):
            return
        try:
            raw = objects.get_bytes(MARKER)
        except ObjectMissing:  # contenders withdrew (or one is writing it): try again
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"{objects.description}: could not write {MARKER} (which pipeline the store's results "
                    f"belong to) in {wait_s:.0f} s of trying beside other heads; check the store, then start again"
                ) from None
            time.sleep(random.uniform(0.2, 1.0))
            continue
        owner = _owner(raw)
        if owner is None and time.monotonic() < settled and not raw:  # created empty, filled next (a folder)
            time.sleep(0.1)
            continue
        break
    if owner is None:
        raise StoreError(
            f"{objects.description}: its {MARKER} (which pipeline the store's results belong to) is not one "
            f"this head reads; if no other pipeline uses this store, delete {MARKER} and start again"
        )
    if owner != pipeline:
        raise StoreError(
            f"{objects.description} holds the results of pipeline {owner!r} ({MARKER}), not of {pipeline!r}: "
            "two pipelines sharing a store would run each other's video jobs, send each other's webhook "
            "events and remove each other's results; give this pipeline a store of its own (another folder, "
            f"claim or bucket prefix), or, if it is this pipeline renamed, set {ENV}={owner} in its head's "
            f"env (spec.head.env); if {owner!r} is gone for good, delete {MARKER} there"
        )


def _owner(raw: bytes) -> str | None:
    try:
        owner = json.loads(raw)["pipeline"]
    except (ValueError, KeyError, TypeError):
        return None
    return owner if isinstance(owner, str) else None
