"""The head's view of its worker pools: which instances exist, their liveness, and their slots.

Pure state: no sockets, no threads. The head core (core.py) owns one; the worker links
(links.py) open and close a socket as instances come and go, through the core's Transport.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from triptych.protocol import Ping
from triptych.roles import Role
from triptych_head.instances import WorkerInstance
from triptych_head.metrics import HeadMetrics

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class Transport(Protocol):
    """How the head core's decisions leave it: the edge (server.py) sends them on ZMQ sockets; a test
    records them. The core only decides; it never touches a socket."""

    def open(self, url: str) -> str | None:
        """Make `url` reachable by send(); the reason it cannot be, or None."""

    def close(self, url: str) -> None:
        """`url` is forgotten: drop its link."""

    def send(self, url: str, msg: Any) -> bool:
        """Send to a worker without blocking; False when it is not connected (or its queue is full)."""

    def reply(self, client: bytes, msg: Any, frames: Sequence[Any] = ()) -> None:
        """Send to an API client of this head (a client that does not read loses the message)."""


class Membership:
    """Instances per role, kept in step with discovery (sync), and what their heartbeats said."""

    def __init__(
        self, roles: Sequence[Role], heartbeat_timeout: float, metrics: HeadMetrics, transport: Transport, clock: Clock
    ):
        self.heartbeat_timeout = heartbeat_timeout
        self._metrics = metrics
        self._transport = transport
        self._clock = clock
        self._instances: dict[Role, dict[str, WorkerInstance]] = {role: {} for role in roles}
        # The step-cache modes each worker has series of in /metrics: a mode its worker stops reporting
        # (a process restarted at the same URL) has its series removed, as have all of a departed worker.
        self._step_cache_series: dict[tuple[Role, str], set[str]] = {}
        self.head_id = uuid.uuid4().hex  # pings carry it: a worker knows which heads it serves

    def roles(self) -> list[Role]:
        return list(self._instances)

    def instances(self, role: Role) -> Sequence[WorkerInstance]:
        return list(self._instances.get(role, {}).values())

    def all(self) -> list[WorkerInstance]:
        return [i for by_url in self._instances.values() for i in by_url.values()]

    def get(self, role: Role, url: str) -> WorkerInstance | None:
        return self._instances.get(role, {}).get(url)

    def find(self, url: str) -> WorkerInstance | None:
        for by_url in self._instances.values():
            if url in by_url:
                return by_url[url]
        return None

    def alive(self, inst: WorkerInstance) -> bool:
        return inst.alive(self._clock(), self.heartbeat_timeout)

    def ready(self, inst: WorkerInstance) -> bool:
        """Alive and taking new work (not draining, not leaving)."""
        return inst.ready(self._clock(), self.heartbeat_timeout)

    def sync(self, wanted: Mapping[Role, Sequence[str]]) -> None:
        """Match discovery: add new endpoints; mark the ones it dropped as leaving.

        A leaving instance gets no new work but keeps its link, so that what it holds can finish
        (a pod that is scaled down leaves DNS while it drains); the core removes it with remove()
        once it holds nothing. An endpoint that comes back stops leaving.
        """
        for role, current in self._instances.items():
            urls = wanted.get(role, ())
            for url in urls:
                inst = current.get(url)
                if inst is not None:
                    if inst.leaving:
                        inst.leaving = False
                        log.info("%s instance %s is listed again", role.value, url)
                    continue
                if (error := self._transport.open(url)) is not None:
                    log.error("%s instance %s skipped: cannot connect (%s)", role.value, url, error)
                    continue
                current[url] = WorkerInstance(url=url, role=role)
                log.info("%s instance added: %s", role.value, url)
            for inst in current.values():
                if inst.url not in urls and not inst.leaving:
                    inst.leaving = True
                    log.info("%s instance %s left discovery; it gets no new work", role.value, inst.url)

    def leaving(self) -> list[WorkerInstance]:
        return [i for i in self.all() if i.leaving]

    def remove(self, inst: WorkerInstance) -> None:
        """Forget an instance discovery dropped (once nothing of a request is left on it)."""
        self._instances[inst.role].pop(inst.url, None)
        self._transport.close(inst.url)
        self._forget_metrics(inst)
        log.info("%s instance removed: %s", inst.role.value, inst.url)

    def ping_all(self) -> None:
        for inst in self.all():
            self.ping(inst)

    def ping(self, inst: WorkerInstance) -> None:
        # A draining worker exits once acknowledged and idle, so acknowledge only when nothing is
        # on its way to it (a push into one of its standing slots, say): all that went before is there.
        ack = inst.draining and not inst.inflight
        self.send(inst.url, Ping(instance=inst.url, head_id=self.head_id, drain_acknowledged=ack, via=inst.via))

    def send(self, url: str, msg: Any) -> bool:
        """To a worker, counted; False when it is not connected. A message over the control header
        limit is not sent: codec.HeaderTooLarge (the caller fails its request: HeadCore.message_too_large)."""
        if not self._transport.send(url, msg):
            return False
        self._metrics.child(self._metrics.worker_messages, msg.TYPE).inc()
        return True

    def lost(self) -> list[WorkerInstance]:
        """Instances whose heartbeats stopped since the last call (each reported once)."""
        now = self._clock()
        gone = []
        for inst in self.all():
            if inst.last_heartbeat is not None and not inst.alive(now, self.heartbeat_timeout):
                inst.last_heartbeat = None
                gone.append(inst)
        return gone

    def every_role_ready(self) -> bool:
        """Each role of the topology has an instance that takes work: the workers have found this head."""
        return all(any(self.ready(i) for i in self.instances(role)) for role in self.roles())

    def ready_capacity(self, role: Role) -> tuple[int, int]:
        """(ready instances, their scheduling slots) of `role`."""
        ready = [i for i in self.instances(role) if self.ready(i)]
        return len(ready), sum(i.capacity for i in ready)

    def held_loras(self, role: Role) -> frozenset[str]:
        """The LoRA adapters some ready instance of `role` holds loaded (their heartbeats' word)."""
        return frozenset(name for i in self.instances(role) if self.ready(i) for name in i.loras)

    def publish_metrics(self) -> None:
        now = self._clock()
        for role, by_url in self._instances.items():
            self._metrics.role_ready.labels(role.value).set(
                sum(1 for i in by_url.values() if i.ready(now, self.heartbeat_timeout))
            )
            for url, inst in by_url.items():
                up = inst.alive(now, self.heartbeat_timeout)
                self._metrics.instance_up.labels(role.value, url).set(1 if up else 0)
                self._metrics.free_slots.labels(role.value, url).set(inst.free_slots if up else 0)
                self._metrics.free_pool_bytes.labels(role.value, url).set(inst.free_bytes if up else 0)
                self._metrics.worker_open_files.labels(role.value, url).set(inst.open_files)
                self._metrics.worker_open_files_limit.labels(role.value, url).set(inst.open_files_limit)
                if inst.encoder_cache is not None:
                    for field, gauge in self._metrics.encoder_cache.items():
                        gauge.labels(role.value, url).set(getattr(inst.encoder_cache, field))
                for stats in inst.step_cache:
                    for field, gauge in self._metrics.step_cache.items():
                        gauge.labels(role.value, url, stats.mode).set(getattr(stats, field))
                self._forget_step_cache_modes(inst, keep={stats.mode for stats in inst.step_cache})

    def _forget_step_cache_modes(self, inst: WorkerInstance, keep: set[str]) -> None:
        """Remove `inst`'s step-cache series of every mode but `keep`: a worker restarted at the same URL
        reports none of its predecessor's modes, whose series would otherwise show stale counts (and
        outlive the worker when it leaves)."""
        key = (inst.role, inst.url)
        for mode in self._step_cache_series.get(key, set()) - keep:
            for gauge in self._metrics.step_cache.values():
                try:
                    gauge.remove(inst.role.value, inst.url, mode)
                except KeyError:
                    pass
        if keep:
            self._step_cache_series[key] = keep
        else:
            self._step_cache_series.pop(key, None)

    def _forget_metrics(self, inst: WorkerInstance) -> None:
        role, url = inst.role, inst.url
        gauges = (
            self._metrics.instance_up,
            self._metrics.free_slots,
            self._metrics.free_pool_bytes,
            self._metrics.worker_open_files,
            self._metrics.worker_open_files_limit,
        )
        for gauge in (*gauges, *self._metrics.encoder_cache.values()):
            try:
                gauge.remove(role.value, url)
            except KeyError:
                pass
        self._forget_step_cache_modes(inst, keep=set())

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """For /health: every instance with its liveness and load."""
        now = self._clock()
        return {
            role.value: [
                {
                    "url": i.url,
                    "alive": i.alive(now, self.heartbeat_timeout),
                    "ready": i.ready(now, self.heartbeat_timeout),
                    "draining": i.draining,
                    "leaving": i.leaving,
                    "capacity": i.capacity,
                    "free_slots": i.free_slots,
                    "others_busy": i.others_busy,
                    "held": i.held,
                    "peak_held": i.peak_held,
                    "open_files": i.open_files,
                    "open_files_limit": i.open_files_limit,
                    "pool_bytes": i.pool_bytes,
                    "free_bytes": i.free_bytes,
                    "standing_bytes": i.standing_bytes,
                    "dispatched": i.dispatched_total,
                    "full_pipeline": i.full_pipeline,
                    "wrong_topology": i.wrong_topology,
                    "wrong_model": i.wrong_model,
                    "loras": sorted(i.loras),
                    "devices": i.devices,
                    "dtype": i.dtype,
                }
                for i in by_url.values()
            ]
            for role, by_url in self._instances.items()
        }
