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
import time

from triptych.config import PIPELINE_ENV
from triptych_head.objects import ObjectMissing, ObjectStore, StoreError

ENV = PIPELINE_ENV
MARKER = "triptych-store.json"
SETTLE_S = 2.0  # a marker another head is writing right now (created empty, then filled) is read again


def claim_store(objects: ObjectStore, pipeline: str) -> None:
    """Mark the store as `pipeline`'s, or check that it is: StoreError, saying what to do, when it is another's."""
    if objects.create(MARKER, json.dumps({"pipeline": pipeline}).encode(), "application/json"):
        return
    deadline = time.monotonic() + SETTLE_S
    while True:
        try:
            owner = json.loads(objects.get_bytes(MARKER))["pipeline"]
            break
        except (ObjectMissing, ValueError, KeyError, TypeError) as exc:
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"{objects.description}: its {MARKER} (which pipeline the store's results belong to) cannot "
                    f"be read ({exc}); if no other pipeline uses this store, delete {MARKER} and start again"
                ) from None
            time.sleep(0.1)
    if owner != pipeline:
        raise StoreError(
            f"{objects.description} holds the results of pipeline {owner!r} ({MARKER}), not of {pipeline!r}: "
            "two pipelines sharing a store would run each other's video jobs, send each other's webhook "
            "events and remove each other's results; give this pipeline a store of its own (another folder, "
            f"claim or bucket prefix), or, if {owner!r} is gone for good, delete {MARKER} there"
        )
