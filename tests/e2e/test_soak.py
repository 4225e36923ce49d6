"""Soak: a deployment (a head and simulated workers, real processes) goes back to its resting state
after a long mixed workload, and no process keeps what the workload took (docs/testing.md, "soak").

Images: some 600 requests, 8 at a time (and bursts of 24): images in base64 and by URL, streamed
ones read to the end or dropped after their first event, clients that hang up mid-request, requests
the API refuses (an unknown LoRA adapter, an impossible size), ones it does not admit (a deadline no
estimate meets, more than --max-queued-requests in flight), Idempotency-Key retries; and under that
traffic a denoiser frozen (SIGSTOP) past the request timeout (what it holds times out), one frozen
past the heartbeat timeout (lost, then back with SIGCONT) and one killed (SIGKILL) while it holds
requests and started again on its port at once, whose requests must be retried as soon as the new
process heartbeats. Videos (tiny Wan): jobs followed over their events, fetched (MP4 and frames) and
deleted, kept, cancelled while they denoise, their events dropped, refused.

Measured after a warm-up that runs every kind of request (and the burst: thread pools at their
working size), and again once the workload has ended and the head's views say it has settled:
- the head's views exactly at rest: nothing in flight, admitted or queued, every worker alive with
  all its slots free and holding none, its transfer pool all free but its standing slots; then
  requests one after another go through standing slots alone (no transfer_alloc: none is held);
- per process (head and each worker, /proc): file descriptors and threads at most FD_SLACK /
  THREAD_SLACK above the warm-up's, resident memory at most RSS_SLACK_KIB above it. A worker
  started during the soak is compared with its own figures once it joined.

Mooncake's TCP connections are counted apart from the descriptors (`Usage.lanes`): its transport
(0.3.13) pools up to MC_TCP_LANES_PER_PEER (4) per peer, opened as writes overlap, so their number
moves with the traffic, bounded; and it never closes those to a peer that went away (they stay in
CLOSE_WAIT in the writer: `Usage.stale`), which the test bounds by the lanes of the departed peers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import deployment
from triptych.ports import MOONCAKE_PORT_RANGE
from triptych.roles import Role
from triptych_dev.localdeploy import LocalDeployment, Proc

pytestmark = pytest.mark.slow

TIMEOUT_S = 8.0  # --disagg-timeout: a request on a frozen denoiser times out; a restarted one has time to heartbeat
FREEZE_S = TIMEOUT_S + 1.5
HEARTBEAT_S = FREEZE_S + 2.5  # --disagg-heartbeat-timeout: a FREEZE_S freeze does not lose the worker
MAX_QUEUED = 4  # --max-queued-requests: the burst goes over it
CONCURRENCY = 8
BURST = 24
INSTANT = ("--simulate-seconds", "0", "--simulate-seconds-per-unit", "0")
# Denoising 0.5 s per megapixel-step: SMALL takes ~2 ms there, SLOW ~0.5 s (long enough to hang up during).
ROLE_FLAGS = {
    Role.ENCODER: INSTANT,
    Role.DENOISER: ("--simulate-seconds", "0", "--simulate-seconds-per-unit", "0.5"),
    Role.DECODER: INSTANT,
}
HEAD_FLAGS = ("--disagg-timeout", str(TIMEOUT_S), "--disagg-heartbeat-timeout", str(HEARTBEAT_S),
              "--max-queued-requests", str(MAX_QUEUED))  # fmt: skip
SMALL = {"prompt": "a red square", "size": "64x32", "num_inference_steps": 2}
SLOW = {"prompt": "a red square", "size": "256x256", "num_inference_steps": 16}
GENERATE = "/v1/images/generations"

FD_SLACK = 2
THREAD_SLACK = 2
# Measured growth over the soak: 0-3 MiB per process (head ~75 MiB, workers 70-500 MiB). 48 MiB
# is far above that and far below what a per-request leak over ~600 requests adds.
RSS_SLACK_KIB = 48 * 1024
LANES_PER_PEER = int(os.environ.get("MC_TCP_LANES_PER_PEER", "4"))  # Mooncake's default
CLOSE_WAIT = "08"  # /proc/net/tcp's state


# --- per-process figures (/proc) ---------------------------------------------------------------


def tcp_sockets() -> dict[str, tuple[int, int, str]]:
    """socket inode -> (local port, remote port, state) of every TCP socket of this host."""
    table = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(path).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    return table


def listening_ports(table: dict[str, tuple[int, int, str]]) -> set[int]:
    return {local for local, _, state in table.values() if state == "0A"}


@dataclass(frozen=True)
class Usage:
    fds: int  # all its descriptors
    threads: int
    rss_kib: int
    lanes: int  # Mooncake's pooled connections with live peers, either way (bounded: lanes x peers)
    widest: int  # the most of them to one peer
    stale: int  # Mooncake's connections to a peer that is gone (CLOSE_WAIT; the module docstring)

    @property
    def own(self) -> int:
        """Descriptors but Mooncake's connections: what must come back to rest."""
        return self.fds - self.lanes - self.stale

    def __str__(self) -> str:
        lanes = f" + {self.lanes} Mooncake lanes" + (f" + {self.stale} stale" if self.stale else "")
        return f"fds {self.own}{lanes}, threads {self.threads}, rss {self.rss_kib // 1024} MiB"


def mooncake(port: int) -> bool:
    return MOONCAKE_PORT_RANGE[0] <= port <= MOONCAKE_PORT_RANGE[1]


def usage(pid: int, table: dict[str, tuple[int, int, str]]) -> Usage:
    listening = listening_ports(table)
    fds, lanes, stale = 0, 0, 0
    per_peer: collections.Counter[int] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        sock = table.get(target[len("socket:[") : -1]) if target.startswith("socket:[") else None
        if sock is None or sock[2] == "0A":
            continue
        local, remote, state = sock
        if mooncake(remote) and remote not in listening:
            stale += state == CLOSE_WAIT
        elif mooncake(remote):  # a lane of its own to a peer's data port
            lanes += 1
            per_peer[remote] += 1
        elif mooncake(local) and local in listening:  # a peer's lane to its data port
            lanes += 1
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    threads, rss = int(status["Threads"]), int(status["VmRSS"].split()[0])
    return Usage(fds, threads, rss, lanes, max(per_peer.values(), default=0), stale)


def name(proc: Proc) -> str:
    return f"{proc.role.value}@{proc.url.rsplit(':', 1)[1]}/{proc.popen.pid}"


def measure(dep: LocalDeployment, samples: int = 5) -> dict[str, Usage]:
    """Every live process's usage; descriptors and threads as the least of a few samples, so that a
    connection or thread that is only passing through (a heartbeat, a write) does not count."""
    seen: dict[str, list[Usage]] = collections.defaultdict(list)
    for i in range(samples):
        table = tcp_sockets()
        for proc in dep.procs:
            if proc.popen.poll() is None:
                seen[name(proc)].append(usage(proc.popen.pid, table))
        if i < samples - 1:
            time.sleep(0.2)
    return {
        key: replace(min(us, key=lambda u: u.own), threads=min(u.threads for u in us), rss_kib=us[-1].rss_kib)
        for key, us in seen.items()
    }


def compare(rest: dict[str, Usage], after: dict[str, Usage]) -> str:
    """The figures side by side, for the report."""
    return "\n".join(f"  {key:36} rest: {rest[key]}\n  {'':36} now:  {after.get(key)}" for key in sorted(rest))


def check(rest: dict[str, Usage], after: dict[str, Usage], departed: int, table: str) -> None:
    """Every process measured at rest is back where it was; `departed`: workers that went away for good."""
    workers = len(after) - 1
    for key, before in rest.items():
        now = after.get(key)
        assert now is not None, f"{key} is gone:\n{table}"
        assert now.own <= before.own + FD_SLACK, f"{key}: descriptors\n{table}"
        assert now.threads <= before.threads + THREAD_SLACK, f"{key}: threads\n{table}"
        assert now.rss_kib <= before.rss_kib + RSS_SLACK_KIB, f"{key}: resident memory\n{table}"
        # Mooncake's pool: at most its lanes to each peer and from each; to a peer that went away,
        # what it had open then.
        assert now.widest <= LANES_PER_PEER and now.lanes <= 2 * LANES_PER_PEER * workers, f"{key}: lanes\n{table}"
        assert now.stale <= LANES_PER_PEER * departed, f"{key}: Mooncake connections to departed peers\n{table}"


# --- the head's own views ----------------------------------------------------------------------


def metric(c: httpx.Client, metric_name: str, **labels: str) -> float:
    text = c.get("/metrics").text
    total = 0.0
    for m in re.finditer(rf"^{metric_name}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def not_at_rest(c: httpx.Client) -> list[str]:
    """What in the head's views is not at rest (empty: at rest)."""
    problems = []
    health, view = c.get("/health").json(), c.get("/v1/pipeline").json()
    if health["admission"]["in_flight"]:
        problems.append(f"admission in flight {health['admission']['in_flight']}")
    if view["requests"]:
        problems.append(f"requests in flight {[(r['id'], r['state'], r['instance']) for r in view['requests']]}")
    for role, r in view["roles"].items():
        if r["queued"] or r["running"]:
            problems.append(f"{role}: queued {r['queued']}, running {r['running']}")
        for i in r["instances"]:
            fields = {k: i[k] for k in ("alive", "ready", "draining", "capacity", "free_slots", "held", "others_busy")}
            pool = {k: i[k] for k in ("pool_bytes", "free_bytes", "standing_bytes")}
            if not (i["alive"] and i["ready"]) or i["draining"] or i["free_slots"] != i["capacity"]:
                problems.append(f"{role} {i['url']}: {fields}")
            elif i["held"] or i["others_busy"]:
                problems.append(f"{role} {i['url']} holds slots: {fields}")
            elif i["free_bytes"] + i["standing_bytes"] != i["pool_bytes"]:
                problems.append(f"{role} {i['url']}: transfer pool not all free: {pool}")
    for gauge in ("triptych_active_requests", "triptych_admission_in_flight_requests", "triptych_role_queued_requests",
                  "triptych_role_running_requests", "triptych_role_pending_work_seconds"):  # fmt: skip
        if value := metric(c, gauge):
            problems.append(f"{gauge} {value:g}")
    return problems


def settle(dep: LocalDeployment, timeout: float = 60) -> None:
    """Wait until the head's views are at rest (requests that time out do so after TIMEOUT_S; a
    frozen worker's heartbeats resume within seconds of SIGCONT)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=dep.http, timeout=30) as c:
        while problems := not_at_rest(c):
            if time.monotonic() > deadline:
                pytest.fail(f"not back at rest {timeout:g}s after the workload:\n" + "\n".join(problems) + dep.logs())
            time.sleep(0.25)


def alive(c: httpx.Client, role: Role) -> int:
    return sum(w["alive"] and w["ready"] for w in c.get("/health").json()["workers"][role.value])


def wait_for(what: str, condition: Callable[[], bool], timeout: float = 30) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what}: not after {timeout:g}s"
        time.sleep(0.1)
    return time.monotonic() - started


# --- the workload ------------------------------------------------------------------------------


def outcome(r: httpx.Response) -> str:
    if r.status_code == 200:
        return "200"
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return str(r.status_code)
    return f"{r.status_code}:{error.get('code') or error.get('param')}"


def image(c: httpx.Client) -> str:
    return outcome(c.post(GENERATE, json=SMALL))


def slow(c: httpx.Client) -> str:
    return outcome(c.post(GENERATE, json=SLOW))


def by_url(c: httpx.Client) -> str:
    r = c.post(GENERATE, json={**SMALL, "response_format": "url"})
    if r.status_code != 200:
        return outcome(r)
    png = c.get(r.json()["data"][0]["url"])
    return "200+png" if png.status_code == 200 and png.content.startswith(b"\x89PNG") else f"200+{png.status_code}"


def streamed(c: httpx.Client) -> str:
    with c.stream("POST", GENERATE, json={**SMALL, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return outcome(r)
        events = [line.split(":", 1)[1].strip() for line in r.iter_lines() if line.startswith("event:")]
    return f"stream:{events[-1] if events else 'none'}"


def stream_dropped(c: httpx.Client) -> str:
    with c.stream("POST", GENERATE, json={**SLOW, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return outcome(r)
        for line in r.iter_lines():
            if line.startswith("event:"):
                return "dropped"  # leaving the block closes the connection mid-stream
    return "stream ended"


def hang_up(c: httpx.Client) -> str:
    """The client goes away mid-request: the head cancels it (499 to nobody)."""
    try:
        return outcome(c.post(GENERATE, json=SLOW, timeout=httpx.Timeout(30, read=0.15)))
    except httpx.ReadTimeout:
        return "hung up"


def bad_lora(c: httpx.Client) -> str:
    return outcome(c.post(GENERATE, json={**SMALL, "loras": [{"name": "no-such-adapter"}]}))


def bad_size(c: httpx.Client) -> str:
    return outcome(c.post(GENERATE, json={**SMALL, "size": "33x32"}))


def tiny_deadline(c: httpx.Client) -> str:
    return outcome(c.post(GENERATE, json={**SMALL, "deadline_seconds": 0.001}))


def retried(c: httpx.Client) -> str:
    """The same Idempotency-Key twice: the second gets the first's answer (or runs, if the first failed)."""
    key = {"Idempotency-Key": uuid.uuid4().hex}
    first = c.post(GENERATE, json=SMALL, headers=key)
    again = c.post(GENERATE, json=SMALL, headers=key)
    replayed = "replayed" if again.headers.get("Idempotent-Replayed") == "true" else "ran"
    return f"{outcome(first)}/{outcome(again)} {replayed}"


GENERATION = {"200", "429:overloaded", "429:deadline_unachievable", "504:timed_out", "503"}
KINDS: dict[Callable[[httpx.Client], str], int] = {  # one round's mix: how many of each per 17
    image: 6, slow: 2, by_url: 1, streamed: 1, stream_dropped: 1, hang_up: 2, bad_lora: 1, bad_size: 1,
    tiny_deadline: 1, retried: 1,
}  # fmt: skip
MIX = [kind for kind, n in KINDS.items() for _ in range(n)]


def allowed(kind: str, result: str) -> bool:
    if kind == "by_url":
        return result == "200+png" or (result in GENERATION and result != "200")
    if kind == "streamed":
        return result in ("stream:completed", "stream:error") or (result in GENERATION and result != "200")
    if kind == "stream_dropped":
        return result == "dropped" or (result in GENERATION and result != "200")
    if kind == "hang_up":
        return result == "hung up" or result in GENERATION
    if kind == "bad_lora":
        return result == "400:loras"
    if kind == "bad_size":
        return result == "400:size"
    if kind == "tiny_deadline":
        return result in ("429:deadline_unachievable", "429:overloaded")
    if kind == "retried":
        first, again = result.split(" ")[0].split("/")
        return first in GENERATION and again in GENERATION
    return result in GENERATION


@contextmanager
def stopped(proc: Proc) -> Iterator[None]:
    proc.popen.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.popen.send_signal(signal.SIGCONT)


@dataclass
class Soak:
    dep: LocalDeployment
    results: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    notes: dict[str, float] = field(default_factory=dict)  # for the report

    def run(
        self, rounds: int, kinds: list[Callable[[httpx.Client], str]] = MIX, concurrency: int = CONCURRENCY
    ) -> None:
        """`rounds` x the mix, `concurrency` at a time, through one client closed afterwards (so that
        none of its connections is open when the processes are measured)."""
        work = kinds * rounds
        limits = httpx.Limits(max_connections=concurrency)
        with httpx.Client(base_url=self.dep.http, timeout=60, limits=limits) as c:
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                answers = list(pool.map(lambda kind: kind(c), work))
        with self.lock:
            self.results.update((kind.__name__, answer) for kind, answer in zip(work, answers, strict=True))

    def run_during(self, rounds: int, event: Callable[[Soak, Proc], None], proc: Proc) -> None:
        """The mix, with `event` happening to `proc` while it runs."""
        errors: list[BaseException] = []

        def happen() -> None:
            try:
                event(self, proc)
            except BaseException as exc:  # raised below, in the test's thread
                errors.append(exc)

        side = threading.Thread(target=happen)
        side.start()
        try:
            self.run(rounds)
        finally:
            side.join(120)
        if errors:
            raise errors[0]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.dep.http, timeout=30)

    def summary(self) -> str:
        return "\n".join(f"  {kind:20} {result:40} {n}" for (kind, result), n in sorted(self.results.items()))


def freeze(soak: Soak, proc: Proc) -> None:
    """Past the request timeout, within the heartbeat timeout: what it holds times out."""
    time.sleep(0.3)
    with stopped(proc):
        time.sleep(FREEZE_S)


def lose(soak: Soak, proc: Proc) -> None:
    """Frozen past the heartbeat timeout: the head gives it up (its work retried elsewhere); then it
    resumes, with requests the head no longer counts on it, and joins again."""
    time.sleep(0.3)
    with soak.client() as c:
        with stopped(proc):
            wait_for("the frozen denoiser counted as lost", lambda: alive(c, Role.DENOISER) == 1, HEARTBEAT_S * 4)
        wait_for("the resumed denoiser back", lambda: alive(c, Role.DENOISER) == 2)


def kill_and_restart(soak: Soak, proc: Proc) -> None:
    """SIGKILL while it holds requests, started again on its port at once (as a container restarts in
    its pod): the head hears a new process behind the address before the old one's heartbeats are
    missed, and retries what the old one held then (cause session_mismatch), not at the request timeout."""
    with soak.client() as c:

        def holds_one() -> bool:  # frozen, it cannot finish them before the kill
            return any(r["instance"] == proc.url and r["age_s"] < 1 for r in c.get("/v1/pipeline").json()["requests"])

        time.sleep(0.3)
        with stopped(proc):
            wait_for(f"a request on {proc.url}", holds_one, TIMEOUT_S)
            soak.dep.stop_worker(proc, drain=False)
        soak.dep.start_worker(proc.role)  # on the port it had
        soak.notes["restart to retry, s"] = wait_for(
            "the killed process's requests retried once its replacement heartbeats",
            lambda: metric(c, "triptych_retries_total", cause="session_mismatch") > 0,
            TIMEOUT_S,
        )
        wait_for("the restarted denoiser serving", lambda: alive(c, Role.DENOISER) == 2, 60)


def burst(soak: Soak, proc: Proc) -> None:
    """More at once than --max-queued-requests admits beyond the workers' slots: some get 429."""
    soak.run(1, [slow] * BURST, concurrency=BURST)


def test_a_deployment_returns_to_rest_after_a_long_mixed_workload(tiny_models, tmp_path):
    started = time.monotonic()
    with deployment(tiny_models["tiny-flux"], tmp_path, simulate=True, denoisers=2, role_flags=ROLE_FLAGS,
                    head_flags=HEAD_FLAGS) as dep:  # fmt: skip
        soak = Soak(dep)
        first, second = dep.workers(Role.DENOISER)

        # Warm-up: every kind of request, the burst, a timeout.
        soak.run(4)
        soak.run_during(1, burst, first)
        soak.run_during(3, freeze, first)
        settle(dep)
        rest = measure(dep)
        del rest[name(second)]  # killed in the soak: its replacement is measured once it has joined

        # The soak, in two halves; `second` is replaced in the first.
        soak.run_during(5, kill_and_restart, second)
        soak.run_during(5, lose, first)
        settle(dep)
        (replacement,) = [p for p in dep.workers(Role.DENOISER) if p is not first]
        rest[name(replacement)] = measure(dep)[name(replacement)]
        soak.run_during(5, burst, first)
        soak.run_during(5, lose, replacement)
        soak.run_during(5, freeze, first)
        settle(dep)
        after = measure(dep)

        with soak.client() as c:
            # Standing slots: none is still held for a request long gone (the head lists no holders).
            allocs = metric(c, "triptych_worker_messages_sent_total", type="transfer_alloc")
            pushes = metric(c, "triptych_worker_messages_sent_total", type="transfer_push")
            for _ in range(6):
                assert c.post(GENERATE, json=SMALL).status_code == 200
            assert metric(c, "triptych_worker_messages_sent_total", type="transfer_push") == pushes + 12
            assert metric(c, "triptych_worker_messages_sent_total", type="transfer_alloc") == allocs, (
                "a request at rest needed a transfer_alloc: a standing slot is still taken"
            )
            states = {s: metric(c, "triptych_requests_total", state=s) for s in ("DONE", "CANCELLED", "TIMED_OUT")}
            retries = metric(c, "triptych_retries_total")
            refused = {
                "overloaded": metric(c, "triptych_rejected_overloaded_requests_total"),
                "deadline": metric(c, "triptych_rejected_deadline_requests_total"),
            }

    took = time.monotonic() - started
    summary = soak.summary()
    report = f"{sum(soak.results.values())} requests in {took:.0f}s; {states}, retries {retries:g}, refused {refused}, "
    report += ", ".join(f"{k} {v:.1f}" for k, v in soak.notes.items())
    table = compare(rest, after)
    print(f"\n{report}\n{summary}\n{table}")  # shown with -s

    unexpected = {k: n for k, n in soak.results.items() if not allowed(*k)}
    assert not unexpected, f"answers no request of that kind should get: {unexpected}\n{summary}"
    # Every path was taken: successes, hang-ups, refusals, errors, timeouts, retries, replays.
    got = {result for _, result in soak.results}
    for wanted in ("200", "200+png", "stream:completed", "dropped", "hung up", "400:loras", "400:size",
                   "429:deadline_unachievable", "429:overloaded"):  # fmt: skip
        assert wanted in got, f"no request got {wanted!r}:\n{summary}"
    assert any(kind == "retried" and result.endswith("replayed") for kind, result in soak.results), summary
    assert states["CANCELLED"] > 0 and states["TIMED_OUT"] > 0 and retries > 0, report
    check(rest, after, departed=1, table=table)


# --- video jobs (tiny Wan) ---------------------------------------------------------------------

VIDEO = {"prompt": "waves on a beach", "size": "48x32", "num_frames": 5, "num_inference_steps": 3, "fps": 8}
LONG_VIDEO = {**VIDEO, "num_inference_steps": 200}  # ~0.7 s of denoising here: long enough to cancel during
VIDEOS = "/v1/videos"
ENDED = ("completed", "failed", "cancelled")


def until_ended(c: httpx.Client, job_id: str) -> str:
    deadline = time.monotonic() + 60
    while (status := c.get(f"{VIDEOS}/{job_id}").json()["status"]) not in ENDED:
        assert time.monotonic() < deadline, f"video {job_id} still {status} after 60s"
        time.sleep(0.1)
    return str(status)


def content(c: httpx.Client, job_id: str, variant: str = "video") -> str:
    r = c.get(f"{VIDEOS}/{job_id}/content", params={"variant": variant})
    magic = r.content[4:8] == b"ftyp" if variant == "video" else r.content[:2] == b"PK"
    return f"+{variant}" if r.status_code == 200 and magic else f"+{variant} {r.status_code}"


def video_followed(c: httpx.Client) -> str:
    """Made, followed over its events to the end, fetched (MP4 and frames), then deleted with its files."""
    r = c.post(VIDEOS, json=VIDEO)
    if r.status_code != 200:
        return outcome(r)
    job_id = r.json()["id"]
    with c.stream("GET", f"{VIDEOS}/{job_id}/events") as events:
        names = [line.split(":", 1)[1].strip() for line in events.iter_lines() if line.startswith("event:")]
    status = until_ended(c, job_id)
    fetched = content(c, job_id) + content(c, job_id, "frames") if status == "completed" else ""
    deleted = c.delete(f"{VIDEOS}/{job_id}").status_code
    return f"{names[-1] if names else 'no events'} {status}{fetched} deleted {deleted}"


def video_kept(c: httpx.Client) -> str:
    """Made, polled to the end and fetched; kept (the results' retention removes it, not the test)."""
    r = c.post(VIDEOS, json=VIDEO)
    if r.status_code != 200:
        return outcome(r)
    status = until_ended(c, r.json()["id"])
    return status + (content(c, r.json()["id"]) if status == "completed" else "")


def video_cancelled(c: httpx.Client) -> str:
    """Cancelled (DELETE) while it denoises."""
    r = c.post(VIDEOS, json=LONG_VIDEO)
    if r.status_code != 200:
        return outcome(r)
    job_id = r.json()["id"]
    deadline = time.monotonic() + 30
    while c.get(f"{VIDEOS}/{job_id}").json()["status"] == "queued" and time.monotonic() < deadline:
        time.sleep(0.05)
    return f"deleted {c.delete(f'{VIDEOS}/{job_id}').json()['status']}"


def video_events_dropped(c: httpx.Client) -> str:
    """Its events stream dropped after the first event; the job runs on."""
    r = c.post(VIDEOS, json=LONG_VIDEO)
    if r.status_code != 200:
        return outcome(r)
    job_id = r.json()["id"]
    with c.stream("GET", f"{VIDEOS}/{job_id}/events") as events:
        for line in events.iter_lines():
            if line.startswith("event:"):
                break
    return f"dropped, {until_ended(c, job_id)}"


def video_bad(c: httpx.Client) -> str:
    return outcome(c.post(VIDEOS, json={**VIDEO, "num_frames": 6}))  # Wan takes 1 + a multiple of 4


VIDEO_MIX = [video_followed, video_followed, video_kept, video_cancelled, video_events_dropped, video_bad]
VIDEO_ALLOWED = {
    "video_followed": {"completed completed+video+frames deleted 200"},
    "video_kept": {"completed+video"},
    "video_cancelled": {"deleted cancelled", "deleted completed"},  # it may have ended just before the DELETE
    "video_events_dropped": {"dropped, completed"},
    "video_bad": {"400:num_frames"},
}


def test_video_jobs_made_followed_fetched_and_cancelled_leave_the_deployment_at_rest(tiny_models, tmp_path):
    started = time.monotonic()
    with deployment(tiny_models["tiny-wan"], tmp_path, simulate=True, role_flags=ROLE_FLAGS) as dep:
        soak = Soak(dep)
        # Warm-up: every kind of job, at twice the soak's concurrency, so that the head's thread pools
        # (the media pool's encoders, asyncio's executor for the job store) are at their working size.
        soak.run(3, VIDEO_MIX, concurrency=2 * CONCURRENCY)
        settle(dep)
        rest = measure(dep)
        soak.run(8, VIDEO_MIX)
        settle(dep)
        after = measure(dep)

    took = time.monotonic() - started
    summary, table = soak.summary(), compare(rest, after)
    print(f"\n{sum(soak.results.values())} video requests in {took:.0f}s\n{summary}\n{table}")  # shown with -s
    unexpected = {k: n for k, n in soak.results.items() if k[1] not in VIDEO_ALLOWED[k[0]]}
    assert not unexpected, f"answers no request of that kind should get: {unexpected}\n{summary}"
    assert ("video_cancelled", "deleted cancelled") in soak.results, summary
    check(rest, after, departed=0, table=table)
