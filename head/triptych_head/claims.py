"""Who takes over an orphan's next attempt (a video job or a webhook event whose head is gone): the
one head that creates its marker, `<base>` (`videos/<id>.adopt-<n>`, `webhooks/<id>.adopt-<n>`).

The winner then saves the orphan's record as its own (the attempt counted), and every other head
sees it is taken. A winner that dies before that save, or whose next read of the store fails, would
leave the marker standing for ever, and the orphan with it: nobody else could win attempt n. So a
marker older than STALE_S, while the record still shows the attempt untaken, is superseded: the
next claim is `<base>.r2`, then `.r3` (a marker's age is judged on this head's own clock, as it saw
the marker: sightings.py), each won by one head alone (ObjectStore.create). A stale
winner may be alive, only cut off from the store: the k-th claim's winner counts its attempt k - 1
further (a video job's `restarts`), so that the earlier one, reading the record, finds itself
fenced off (video_jobs.VideoJobs._still_ours) rather than running the same attempt alongside.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from triptych_head.objects import ObjectStore
from triptych_head.sightings import Sightings

STALE_S = 60.0  # a winner saves its record at once; this long without it, it died first (or is cut off)


class Claim(NamedTuple):
    name: str  # the marker won
    ordinal: int  # 1 for `base`, k for `base.rk`: how many claims of this attempt there were


def claim(objects: ObjectStore, base: str, data: bytes, seen: Sightings, now: float | None = None) -> Claim | None:
    """The claim this head won for the attempt `base` names, or None (another head holds a live
    claim, or won the race for the next one). Call it only while the record shows the attempt untaken.
    `seen`: this head's sightings; `now`: its wall clock (for markers older than the heads' clocks differ)."""
    pattern = re.compile(re.escape(base) + r"(?:\.r(\d+))?")
    taken = [
        (int(m.group(1) or 1), obj.mtime)
        for obj in objects.list(base)
        if (m := pattern.fullmatch(obj.name)) is not None
    ]
    if not taken:
        return Claim(base, 1) if objects.create(base, data, "text/plain") else None
    latest, written = max(taken)
    name = base if latest == 1 else f"{base}.r{latest}"
    if not seen.lapsed(name, written, STALE_S, written + STALE_S, now):
        return None  # its winner is saving the record now
    marker = f"{base}.r{latest + 1}"
    return Claim(marker, latest + 1) if objects.create(marker, data, "text/plain") else None
