"""GET /v1/videos: a page of the video jobs the caller sees, every head's, as OpenAI lists videos
(`data`, `first_id`, `last_id`, `has_more`; `limit`, `after`, `order`; newest first by default).

Every head's jobs are in the result store they share (results.py), so a listing does not depend on
which head the load balancer picked. One listing costs the store one LIST of `videos/`; a job's JSON
is read again only when its object changed since this head last read it (its S3 ETag, or a file's
inode, mtime and size), so a listing reads what changed (mostly running jobs), not every job.
"""

from __future__ import annotations

import threading
from typing import Literal

from triptych_head.api.errors import APIError
from triptych_head.api.schemas import VideoJob, VideoList
from triptych_head.results import VIDEOS, ResultStore, StoredJob

DEFAULT_LIMIT = 20
MAX_LIMIT = 100  # OpenAI's
Order = Literal["asc", "desc"]
JSON = ".json"


class StoredJobIndex:
    """Every job in the result store, each parsed once per version of its JSON."""

    def __init__(self, store: ResultStore) -> None:
        self.store = store
        self._read: dict[str, tuple[str, StoredJob | None]] = {}  # job id -> (its object's tag, the job)
        self._lock = threading.Lock()  # listings run in threads (asyncio.to_thread): one at a time

    def jobs(self) -> list[StoredJob]:
        """The store's jobs now. Raises what the store raises (it did not answer)."""
        with self._lock:
            read: dict[str, tuple[str, StoredJob | None]] = {}
            for obj in self.store.objects.list(f"{VIDEOS}/"):
                job_id = obj.name.removeprefix(f"{VIDEOS}/").removesuffix(JSON)
                if not obj.name.endswith(JSON) or "." in job_id:  # its MP4, frames, markers
                    continue
                known = self._read.get(job_id)
                if known is None or not obj.tag or known[0] != obj.tag:  # new, changed, or no tag to tell
                    known = (obj.tag, self.store.load_job(job_id))
                read[job_id] = known
            self._read = read  # a removed job is forgotten with its object
            return [job for _, job in read.values() if job is not None]


def page(jobs: list[VideoJob], after: str | None, limit: int, order: Order) -> VideoList:
    """`limit` of `jobs` in creation order (`asc`) or newest first (`desc`), after the job `after`."""
    ordered = sorted(jobs, key=lambda job: (job.created_at, job.id), reverse=order == "desc")
    if after is not None:
        at = next((i for i, job in enumerate(ordered) if job.id == after), None)
        if at is None:
            raise APIError(
                400,
                f"after: no video job {after[:200]!r} among the ones you can list (removed since, or never one "
                "of yours); list again without `after`",
                "after",
            )
        ordered = ordered[at + 1 :]
    chosen = ordered[:limit]
    return VideoList(
        data=chosen,
        first_id=chosen[0].id if chosen else None,
        last_id=chosen[-1].id if chosen else None,
        has_more=len(ordered) > len(chosen),
    )
