"""Finished results on disk, under --output-path: what survives a head restart, and for how long.

    images/<request id>-<i>.png                    images served by URL (response_format url)
    videos/<job id>.json                           a video job's status, rewritten when it changes
    videos/<job id>.mp4, <job id>.frames.npy       its content

Files whose names agree up to the first dot are one result: retention removes them together,
oldest first, once they are older than --results-max-age or the total passes --results-max-bytes.
Mount a persistent volume there (the operator's `head.results`) for results to outlive the pod.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from triptych.config import DEFAULT_RESULTS_MAX_AGE_S, DEFAULT_RESULTS_MAX_BYTES
from triptych_head.api.schemas import VideoJob

log = logging.getLogger(__name__)

IMAGES = "images"
VIDEOS = "videos"
SWEEP_INTERVAL_MAX_S = 60.0  # retention runs at least this often, and ten times per max age when that is shorter


@dataclass(frozen=True)
class Retention:
    max_age_s: float = DEFAULT_RESULTS_MAX_AGE_S
    max_bytes: int = DEFAULT_RESULTS_MAX_BYTES

    @property
    def sweep_interval_s(self) -> float:
        return min(SWEEP_INTERVAL_MAX_S, max(self.max_age_s / 10, 0.5))


@dataclass
class _Result:
    key: str
    files: list[Path]
    mtime: float
    nbytes: int


class ResultStore:
    def __init__(self, root: Path, retention: Retention | None = None):
        self.root = root
        self.retention = retention or Retention()

    def image_path(self, name: str) -> Path:
        return self.root / IMAGES / name

    def video_path(self, job_id: str) -> Path:
        return self.root / VIDEOS / f"{job_id}.mp4"

    def job_path(self, job_id: str) -> Path:
        return self.root / VIDEOS / f"{job_id}.json"

    def save_job(self, job: VideoJob) -> None:
        """Write the job's status atomically (a crash leaves the old or the new file, never half of one)."""
        path = self.job_path(job.id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(job.model_dump_json())
        os.replace(tmp, path)

    def load_jobs(self) -> list[VideoJob]:
        """Every saved job, oldest first; unreadable files are skipped with a warning."""
        jobs = []
        for path in sorted((self.root / VIDEOS).glob("*.json")):
            try:
                job = VideoJob.model_validate_json(path.read_bytes())
            except (OSError, ValueError) as exc:
                log.warning("skipping unreadable video job %s: %s", path, exc)
                continue
            if job.id != path.stem:  # its id names its files: never follow one elsewhere
                log.warning("skipping video job %s: it names itself %r", path, job.id)
                continue
            jobs.append(job)
        return sorted(jobs, key=lambda j: j.created_at)

    def delete(self, key: str) -> None:
        for folder in (IMAGES, VIDEOS):
            for path in (self.root / folder).glob(f"{key}.*"):
                path.unlink(missing_ok=True)

    def sweep(self, now: float | None = None, keep: Collection[str] = ()) -> list[str]:
        """Apply retention: remove results older than the max age, then the oldest until the total
        fits the max bytes. Results named in `keep` (running jobs) stay. Returns the removed keys."""
        now = time.time() if now is None else now
        everything = self._results()
        total = sum(r.nbytes for r in everything)  # kept results take room too, they only cannot go
        results = [r for r in everything if r.key not in keep]
        removed = []
        for result in sorted(results, key=lambda r: r.mtime):
            if now - result.mtime <= self.retention.max_age_s and total <= self.retention.max_bytes:
                break  # oldest first: everything after this one is younger and fits
            for path in result.files:
                path.unlink(missing_ok=True)
            total -= result.nbytes
            removed.append(result.key)
        if removed:
            log.info("retention removed %d results (%d bytes kept)", len(removed), total)
        return removed

    def _results(self) -> list[_Result]:
        by_key: dict[tuple[str, str], _Result] = {}
        for folder in (IMAGES, VIDEOS):
            directory = self.root / folder
            if not directory.is_dir():
                continue
            for path in directory.iterdir():
                try:
                    stat = path.stat()
                except OSError:  # removed meanwhile
                    continue
                key = path.name.lstrip(".").split(".", 1)[0]
                result = by_key.setdefault((folder, key), _Result(key, [], 0.0, 0))
                result.files.append(path)
                result.mtime = max(result.mtime, stat.st_mtime)
                result.nbytes += stat.st_size
        return list(by_key.values())
