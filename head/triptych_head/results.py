"""Finished results in the store every head shares (objects.py), and for how long they are kept.

    images/<request id>-<i>-<random>.png           images served by URL (response_format url; .jpg, .webp)
    videos/<job id>.json                           a video job's status, rewritten when it changes
    videos/<job id>.mp4, <job id>.frames.npy       its content
    idempotency/<digest>.<n>.json, .response       an Idempotency-Key's runs (idempotency.py)
    webhooks/<event id>.json                       a webhook event not delivered yet (webhook_outbox.py)

Objects whose names agree up to the first dot are one result: retention removes them together,
oldest first, once they are older than --results-max-age or the total passes --results-max-bytes.
A running job's files are never removed: the head running it holds a lease on it (`lease_until`
in its JSON, renewed every JOB_LEASE_RENEW_S), and `videos/<job id>.running` lists it while it
runs. A job still running whose lease has run out lost its head: another head takes it over and
runs it again from the start (api/video_jobs.py), or marks it failed when it cannot. Every head serves
every result: a job another head made is read from its JSON, as that head last wrote it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triptych.config import DEFAULT_RESULTS_MAX_AGE_S, DEFAULT_RESULTS_MAX_BYTES
from triptych_head import idempotency
from triptych_head.api.schemas import VideoJob
from triptych_head.objects import DirectoryObjects, ObjectMissing, ObjectStore
from triptych_head.sightings import CLOCK_SKEW_S

log = logging.getLogger(__name__)

IMAGES = "images"
VIDEOS = "videos"
SWEEP_INTERVAL_MAX_S = 60.0  # retention runs at least this often, and ten times per max age when that is shorter
JOB_LEASE_S = 30.0  # a running job whose head has not renewed its lease for this long lost its head
JOB_LEASE_RENEW_S = JOB_LEASE_S / 3
TERMINAL = ("completed", "failed", "cancelled")
LEFTOVER_AGE_S = 3600.0  # a staging or temporary file not written to for this long belongs to no write now


@dataclass(frozen=True)
class Retention:
    max_age_s: float = DEFAULT_RESULTS_MAX_AGE_S
    max_bytes: int = DEFAULT_RESULTS_MAX_BYTES

    @property
    def sweep_interval_s(self) -> float:
        return min(SWEEP_INTERVAL_MAX_S, max(self.max_age_s / 10, 0.5))


@dataclass(frozen=True)
class StoredJob:
    """A video job as its JSON says, with the lease of the head running it (None once it ended) and
    what another head needs to run it again (`run`: its GenerationParams, preview_every, priority level and
    the id of its API key when that key has limits), and `owner`: whose requests see it (api/ownership.py)."""

    job: VideoJob
    lease_until: float | None = None
    run: dict[str, Any] | None = None
    owner: str | None = None

    def orphaned(self, now: float) -> bool:
        """Still running, but no head holds it: its head died (or it was saved without a lease)."""
        return self.job.status not in TERMINAL and (self.lease_until is None or self.lease_until < now)


@dataclass
class _Result:
    key: str
    folder: str
    names: list[str] = field(default_factory=list)
    mtime: float = 0.0
    nbytes: int = 0

    def running_key(self, now: float) -> bool:
        """An Idempotency-Key whose run may still go on: its head renews its record well within a lease
        (its mtime, by the store's or the writer's clock, read with room for the clocks to differ)."""
        return self.folder == idempotency.FOLDER and now - self.mtime < idempotency.LEASE_S + CLOCK_SKEW_S


class ResultStore:
    def __init__(self, objects: ObjectStore | Path, retention: Retention | None = None, presign_s: int = 0):
        """`presign_s` > 0: content is handed out as URLs of the object store valid that long (S3 only)."""
        self.objects: ObjectStore = DirectoryObjects(objects) if isinstance(objects, Path) else objects
        self.retention = retention or Retention()
        self.presign_s = presign_s

    @staticmethod
    def image_name(name: str) -> str:
        return f"{IMAGES}/{name}"

    @staticmethod
    def video_name(job_id: str) -> str:
        return f"{VIDEOS}/{job_id}.mp4"

    @staticmethod
    def frames_name(job_id: str) -> str:
        return f"{VIDEOS}/{job_id}.frames.npy"

    @staticmethod
    def thumbnail_name(job_id: str) -> str:
        return f"{VIDEOS}/{job_id}.thumbnail.webp"

    @staticmethod
    def job_name(job_id: str) -> str:
        return f"{VIDEOS}/{job_id}.json"

    @staticmethod
    def running_name(job_id: str) -> str:
        return f"{VIDEOS}/{job_id}.running"

    def save_job(
        self,
        job: VideoJob,
        lease_until: float | None = None,
        run: dict[str, Any] | None = None,
        owner: str | None = None,
    ) -> None:
        """Write the job's status atomically (a crash leaves the old or the new object, never half of one).
        `lease_until`: the job runs on this head until then at least (renewed while it runs). `run`:
        what another head needs to run it again should this one die. `owner`: whose requests see it."""
        self.stamp_expiry(job)
        data = job.model_dump(mode="json")
        if owner is not None:
            data["owner"] = owner
        if lease_until is not None and job.status not in TERMINAL:
            data["lease_until"] = lease_until
        if run is not None and job.status not in TERMINAL:
            data["run"] = run
        self.objects.put_bytes(self.job_name(job.id), json.dumps(data).encode(), "application/json")
        if job.status in TERMINAL:
            self.objects.delete(self.running_name(job.id))

    def stamp_expiry(self, job: VideoJob) -> None:
        """An ended job's `expires_at`: when retention removes it, its content with it, by age (a sweep
        after a result's last write, which is its end); sooner when --results-max-bytes needs the room."""
        if job.status in TERMINAL and job.completed_at is not None and job.expires_at is None:
            job.expires_at = job.completed_at + int(self.retention.max_age_s)

    def mark_running(self, job_id: str) -> None:
        """List the job among those some head must run (heads look for orphans among them)."""
        self.objects.put_bytes(self.running_name(job_id), b"", "application/octet-stream")

    def running_jobs(self) -> list[str]:
        """The jobs listed as running: one LIST, whatever the number of finished jobs."""
        suffix = ".running"
        names = (obj.name for obj in self.objects.list(f"{VIDEOS}/"))
        return [n.removeprefix(f"{VIDEOS}/").removesuffix(suffix) for n in names if n.endswith(suffix)]

    def load_job(self, job_id: str) -> StoredJob | None:
        """The job as last saved by any head; None when there is none (or it cannot be read)."""
        try:
            raw = self.objects.get_bytes(self.job_name(job_id))
        except ObjectMissing:
            return None
        return self._parse(job_id, raw)

    def _parse(self, job_id: str, raw: bytes) -> StoredJob | None:
        try:
            data = json.loads(raw)
            lease = data.pop("lease_until", None)
            run = data.pop("run", None)
            owner = data.pop("owner", None)
            job = VideoJob.model_validate(data)
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("skipping unreadable video job %s: %s", job_id, exc)
            return None
        if job.id != job_id:  # its id names its files: never follow one elsewhere
            log.warning("skipping video job %s: it names itself %r", job_id, job.id)
            return None
        if owner is not None and not isinstance(owner, str):
            log.warning("skipping video job %s: its owner is not a string", job_id)
            return None  # never shown to everyone for want of a readable owner
        return StoredJob(
            job, float(lease) if isinstance(lease, int | float) else None, run if isinstance(run, dict) else None, owner
        )

    def has(self, name: str) -> bool:
        return self.objects.stat(name) is not None

    def delete(self, key: str) -> None:
        """Remove every object of one result (a video job's JSON, MP4 and frames; a URL image)."""
        for folder in (IMAGES, VIDEOS):
            for obj in list(self.objects.list(f"{folder}/")):
                if _key_of(obj.name) == key:
                    self.objects.delete(obj.name)

    def sweep(self, now: float | None = None, keep: Collection[str] = ()) -> list[str]:
        """Apply retention: remove results older than the max age, then the oldest until the total
        fits the max bytes. Results named in `keep`, and jobs some head still runs, stay; so do the
        files of writes under way, while what writes cut short left behind goes after LEFTOVER_AGE_S.
        Returns the removed keys."""
        now = time.time() if now is None else now
        try:
            leftovers = self.objects.remove_leftovers(now - LEFTOVER_AGE_S)
        except Exception:  # never in the way of the results' retention
            log.exception("looking for files that writes cut short left behind")
        else:
            if leftovers:
                log.info("retention removed %d bytes that writes cut short had left behind", leftovers)
        everything = self._results()
        total = sum(r.nbytes for r in everything)  # kept results take room too, they only cannot go
        removed = []
        for result in sorted(everything, key=lambda r: r.mtime):
            if now - result.mtime <= self.retention.max_age_s and total <= self.retention.max_bytes:
                break  # oldest first: everything after this one is younger and fits
            if result.key in keep or self._running_elsewhere(result, now) or result.running_key(now):
                continue
            for name in result.names:
                self.objects.delete(name)
            total -= result.nbytes
            removed.append(result.key)
        if removed:
            log.info("retention removed %d results (%d bytes kept)", len(removed), total)
        return removed

    def _running_elsewhere(self, result: _Result, now: float) -> bool:
        """A job another head runs (its lease is live): the store is shared, so its own list is not enough."""
        json_name = self.job_name(result.key)
        if json_name not in result.names:
            return False
        stored = self.load_job(result.key)
        # Its lease read against this head's clock, with room for the heads' clocks to differ: a job is
        # removed only once no head's clock could still be within its lease (sightings.py).
        return stored is not None and stored.job.status not in TERMINAL and not stored.orphaned(now - CLOCK_SKEW_S)

    def _results(self) -> list[_Result]:
        by_key: dict[tuple[str, str], _Result] = {}
        for folder in (IMAGES, VIDEOS, idempotency.FOLDER):
            for obj in self.objects.list(f"{folder}/"):
                key = _key_of(obj.name)
                result = by_key.setdefault((folder, key), _Result(key, folder))
                result.names.append(obj.name)
                result.mtime = max(result.mtime, obj.mtime)
                result.nbytes += obj.size
        return list(by_key.values())


def _key_of(name: str) -> str:
    """The result an object belongs to: its file name up to the first dot."""
    return name.rsplit("/", 1)[-1].split(".", 1)[0]
