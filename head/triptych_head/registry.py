"""The head's view of its worker pools: instances, their work sockets, pings and liveness."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import zmq

from triptych.protocol import Ping
from triptych.roles import Role
from triptych.security import ControlPlane
from triptych.sockets import connect, send_message
from triptych_head.discovery import WorkerDirectory
from triptych_head.instances import WorkerInstance
from triptych_head.metrics import HeadMetrics

log = logging.getLogger(__name__)


class WorkerRegistry:
    """Instances per role, kept in sync with discovery; one PUSH socket per instance.

    Work sockets use ZMQ_IMMEDIATE, so a send to an instance that is not connected fails at
    once instead of queueing work for a worker that may never come.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        directories: dict[Role, WorkerDirectory],
        heartbeat_timeout: float,
        metrics: HeadMetrics,
        security: ControlPlane | None = None,
    ):
        self._ctx = ctx
        self._security = security
        self._directories = directories
        self.heartbeat_timeout = heartbeat_timeout
        self._metrics = metrics
        self._instances: dict[Role, dict[str, WorkerInstance]] = {role: {} for role in directories}
        self.head_id = uuid.uuid4().hex
        self._sockets: dict[str, zmq.Socket] = {}
        self.sync()

    def roles(self) -> list[Role]:
        return list(self._instances)

    def instances(self, role: Role) -> Sequence[WorkerInstance]:
        return list(self._instances.get(role, {}).values())

    def get(self, role: Role, url: str) -> WorkerInstance | None:
        return self._instances.get(role, {}).get(url)

    def find(self, url: str) -> WorkerInstance | None:
        for by_url in self._instances.values():
            if url in by_url:
                return by_url[url]
        return None

    def alive(self, inst: WorkerInstance) -> bool:
        return inst.alive(time.monotonic(), self.heartbeat_timeout)

    def ready(self, inst: WorkerInstance) -> bool:
        """Alive and taking new work (not draining, not leaving)."""
        return inst.ready(time.monotonic(), self.heartbeat_timeout)

    def sync(self) -> None:
        """Match discovery: connect to new endpoints; mark the ones it dropped as leaving.

        A leaving instance gets no new work but keeps its socket, so that what it holds can
        finish (a pod that is scaled down leaves DNS while it drains); the head removes it
        with remove() once it holds nothing. An endpoint that comes back stops leaving.
        """
        for role, directory in self._directories.items():
            current = self._instances[role]
            wanted = directory.urls
            for url in wanted:
                inst = current.get(url)
                if inst is not None:
                    if inst.leaving:
                        inst.leaving = False
                        log.info("%s instance %s is listed again", role.value, url)
                    continue
                try:
                    self._sockets[url] = self._connect(url)
                except zmq.ZMQError as exc:
                    log.error("%s instance %s skipped: cannot connect (%s)", role.value, url, exc)
                    continue
                current[url] = WorkerInstance(url=url, role=role)
                log.info("%s instance added: %s", role.value, url)
            for inst in current.values():
                if inst.url not in wanted and not inst.leaving:
                    inst.leaving = True
                    log.info("%s instance %s left discovery; it gets no new work", role.value, inst.url)

    def leaving(self) -> list[WorkerInstance]:
        return [i for by_url in self._instances.values() for i in by_url.values() if i.leaving]

    def remove(self, inst: WorkerInstance) -> None:
        """Forget an instance discovery dropped (once nothing of a request is left on it)."""
        self._instances[inst.role].pop(inst.url, None)
        sock = self._sockets.pop(inst.url, None)
        if sock is not None:
            sock.close(linger=0)
        self._forget_metrics(inst.role, inst.url)
        log.info("%s instance removed: %s", inst.role.value, inst.url)

    def _connect(self, url: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        if self._security is not None:
            self._security.client(sock)
        connect(sock, url)
        return sock

    def send(self, url: str, msg: Any, frames: Sequence[Any] = ()) -> bool:
        """Send without blocking; False when the instance is not connected (or its queue is full)."""
        sock = self._sockets.get(url)
        if sock is None:
            return False
        try:
            send_message(sock, msg, frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._metrics.worker_messages.labels(msg.TYPE).inc()
        return True

    def ping_all(self) -> None:
        for by_url in self._instances.values():
            for inst in by_url.values():
                # A draining worker exits once acknowledged and idle, so acknowledge only when nothing is
                # on its way to it (a push into one of its kept slots, say): all that went before is there.
                ack = inst.draining and not inst.inflight
                self.send(inst.url, Ping(instance=inst.url, head_id=self.head_id, drain_acknowledged=ack))

    def lost(self) -> list[WorkerInstance]:
        """Instances whose heartbeats stopped since the last call (each reported once)."""
        now = time.monotonic()
        gone = []
        for by_url in self._instances.values():
            for inst in by_url.values():
                if inst.last_heartbeat is not None and not inst.alive(now, self.heartbeat_timeout):
                    inst.last_heartbeat = None
                    gone.append(inst)
        return gone

    def publish_metrics(self) -> None:
        now = time.monotonic()
        for role, by_url in self._instances.items():
            self._metrics.role_ready.labels(role.value).set(
                sum(1 for i in by_url.values() if i.ready(now, self.heartbeat_timeout))
            )
            for url, inst in by_url.items():
                up = inst.alive(now, self.heartbeat_timeout)
                self._metrics.instance_up.labels(role.value, url).set(1 if up else 0)
                self._metrics.free_slots.labels(role.value, url).set(inst.free_slots if up else 0)
                self._metrics.free_pool_bytes.labels(role.value, url).set(inst.free_bytes if up else 0)
                if inst.encoder_cache is not None:
                    for field, gauge in self._metrics.encoder_cache.items():
                        gauge.labels(role.value, url).set(getattr(inst.encoder_cache, field))

    def _forget_metrics(self, role: Role, url: str) -> None:
        gauges = (self._metrics.instance_up, self._metrics.free_slots, self._metrics.free_pool_bytes)
        for gauge in (*gauges, *self._metrics.encoder_cache.values()):
            try:
                gauge.remove(role.value, url)
            except KeyError:
                pass

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """For /health: every instance with its liveness and load."""
        now = time.monotonic()
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
                    "pool_bytes": i.pool_bytes,
                    "free_bytes": i.free_bytes,
                    "standing_bytes": i.standing_bytes,
                    "dispatched": i.dispatched_total,
                    "full_pipeline": i.full_pipeline,
                    "wrong_topology": i.wrong_topology,
                }
                for i in by_url.values()
            ]
            for role, by_url in self._instances.items()
        }

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; messages still queued get up to `linger_ms` to leave."""
        for sock in self._sockets.values():
            sock.close(linger=linger_ms)
        for directory in self._directories.values():
            directory.close()
