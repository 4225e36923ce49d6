"""Head rollouts on a local deployment, under a steady load through an emulated Service.

`ServiceLoad` sends one request (an image, or a video job) every `interval` seconds to the heads
in its endpoint list, round-robin (as a Service spreads connections over its ready endpoints; one
endpoint: a real Service's address), and records each answer.
`roll_heads` replaces replicated heads one at a time as a Deployment with `maxUnavailable: 0`
does (the head leaves the endpoints, its preStop pause, SIGTERM and drain, its replacement joins
once it sees the workers); `recreate_head` replaces a single head as `Recreate` does (SIGTERM,
drain, exit, then the new head starts). Used by the replicated-heads tests and bench/rollout_bench.py.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from triptych.roles import Role
from triptych_dev.localdeploy import LocalDeployment

PRESTOP_S = 1.0  # the operator's preStop pause on head pods: SIGTERM comes after the Service stopped routing


@dataclass
class Answer:
    sent: float  # time.monotonic() when sent
    url: str
    status: int  # 0: no HTTP answer (refused, reset, timed out)
    detail: str


@dataclass
class ServiceLoad:
    endpoints: list[str]
    body: dict[str, Any]
    interval: float = 0.1
    path: str = "/v1/images/generations"  # or /v1/videos: each answer's `id` is kept (Answer.detail)
    max_requests: int = 2000  # bounded whatever happens
    answers: list[Answer] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> ServiceLoad:
        self._thread = threading.Thread(target=self._load, name="service-load")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(120)

    def remove(self, url: str) -> None:
        with self.lock:
            self.endpoints.remove(url)

    def add(self, url: str) -> None:
        with self.lock:
            self.endpoints.append(url)

    def _load(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for seed in range(self.max_requests):
                if self._stop.is_set():
                    break
                with self.lock:
                    url = self.endpoints[seed % len(self.endpoints)] if self.endpoints else None
                if url is not None:
                    pool.submit(self._one, url, seed)
                time.sleep(self.interval)

    def _one(self, url: str, seed: int) -> None:
        sent = time.monotonic()
        try:
            r = httpx.post(f"{url}{self.path}", json={**self.body, "seed": seed}, timeout=60, trust_env=False)
            answer = Answer(sent, url, r.status_code, r.text[:300] if r.status_code != 200 else r.json().get("id", ""))
        except httpx.HTTPError as exc:
            answer = Answer(sent, url, 0, repr(exc))
        with self.lock:
            self.answers.append(answer)

    def failed(self) -> list[Answer]:
        return [a for a in self.answers if a.status != 200]

    def unavailable_s(self) -> float:
        """The longest span in which every request sent failed (0 when none failed)."""
        longest, start = 0.0, None
        for a in sorted(self.answers, key=lambda a: a.sent):
            if a.status != 200:
                start = a.sent if start is None else start
                longest = max(longest, a.sent - start + self.interval)
            else:
                start = None
        return longest


def ready_with_workers(url: str, n_workers: int) -> bool:
    """The head answers /ready and sees every worker: what a Service routes to."""
    try:
        if httpx.get(f"{url}/ready", timeout=2).status_code != 200:
            return False
        health = httpx.get(f"{url}/health", timeout=2).json()
        return sum(w["alive"] for ws in health["workers"].values() for w in ws) == n_workers
    except (httpx.HTTPError, KeyError, ValueError):
        return False


def _wait_ready(dep: LocalDeployment, url: str, timeout: float) -> None:
    n_workers = sum(p.role is not Role.SERVER for p in dep.procs)
    deadline = time.monotonic() + timeout
    while not ready_with_workers(url, n_workers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the new head at {url} did not see the workers in {timeout:g}s\n{dep.logs()}")
        time.sleep(0.2)


def roll_heads(dep: LocalDeployment, load: ServiceLoad, prestop_s: float = PRESTOP_S, timeout: float = 60) -> None:
    """Replace every head in turn, one unavailable at a time, the others serving."""
    for i, url in enumerate(dep.head_urls):
        load.remove(url)
        time.sleep(prestop_s)
        dep.replace_head(i, timeout)
        _wait_ready(dep, url, timeout)
        load.add(url)


def recreate_head(dep: LocalDeployment, timeout: float = 60) -> None:
    """Replace the one head as `Recreate` does: the Service keeps its address, nothing answers between."""
    dep.replace_head(0, timeout)
    _wait_ready(dep, dep.head_urls[0], timeout)
