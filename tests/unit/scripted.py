"""A real DiffusionServer with scripted workers over real ZMQ sockets.

A scripted worker binds a worker's work socket, answers pings with heartbeats and records every
other message, so a test can play the worker side of the protocol step by step: pause in the
middle of a write, fall silent as a killed process does, or report that it drains.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import zmq

from triptych.cli import build_parser
from triptych.config import ServeArgs
from triptych.ports import result_port
from triptych.protocol import (
    Heartbeat,
    Ping,
    ProtocolError,
    Result,
    TransferAlloc,
    TransferAllocated,
    TransferPush,
    TransferPushed,
    TransferReady,
    TransferStaged,
    decode,
    encode,
)
from triptych.roles import Role
from triptych_dev.localdeploy import deployment_ports
from triptych_head.server import DiffusionServer

PARAMS = {"prompt": "x", "width": 16, "height": 16}
SESSION = "127.0.0.1:1"  # the Mooncake session every scripted worker reports
ROLES = (Role.ENCODER, Role.DENOISER, Role.DECODER)


class ScriptedWorker:
    """Binds a worker's work socket, answers pings, and records every other message it gets."""

    def __init__(self, ctx: zmq.Context, role: Role, scheduler_port: int, port: int):
        self.role = role
        self.port = port
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.work = ctx.socket(zmq.PULL)
        self.work.bind(self.url)
        self.results = ctx.socket(zmq.PUSH)
        self.results.connect(f"tcp://127.0.0.1:{result_port(scheduler_port, role)}")
        self.got: list[object] = []
        self.pings: list[Ping] = []
        self.unreadable: list[str] = []  # why each message it could not decode was dropped, as a worker drops it
        self.max_batch = 1  # its --batching-max-size, which its heartbeats report
        self.draining = False  # what its heartbeats report
        self.standing_slots: tuple[tuple[int, int], ...] = ()  # and the standing slots they list

    def send(self, msg: object, frames: Sequence[object] = ()) -> None:
        self.results.send_multipart(encode(msg, frames))

    def heartbeat(self, instance: str) -> Heartbeat:
        standing = sum(nbytes for _, nbytes in self.standing_slots)
        return Heartbeat(
            instance, self.role.value, SESSION, 1 << 20, (1 << 20) - standing, 2, "m", draining=self.draining,
            standing_bytes=standing, standing_slots=self.standing_slots, max_batch=self.max_batch,
        )  # fmt: skip

    def pump(self, seconds: float = 0.05) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.work.poll(int(left * 1000) + 1):
                try:
                    msg, _ = decode(self.work.recv_multipart())
                except ProtocolError as exc:
                    self.unreadable.append(str(exc))
                    continue
                if isinstance(msg, Ping):
                    self.pings.append(msg)
                    self.send(self.heartbeat(msg.instance))
                else:
                    self.got.append(msg)

    def wait_for(self, kind: type, seconds: float = 5.0, others: Sequence[ScriptedWorker] = ()) -> object:
        """The first recorded message of `kind`; `others` keep heartbeating meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for msg in self.got:
                if isinstance(msg, kind):
                    return msg
            self.pump()
            for other in others:
                other.pump(0.0)
        raise AssertionError(
            f"{self.role.value} never got {kind.__name__}; got {self.got}, unreadable {self.unreadable}"
        )


@contextmanager
def scripted_head(
    counts: dict[Role, int] | None = None, flags: Sequence[str] = ()
) -> Iterator[tuple[DiffusionServer, zmq.Socket, dict[Role, list[ScriptedWorker]]]]:
    """A head serving scripted workers (one per role unless `counts` says otherwise), and a client
    DEALER on its frontend; yields once every worker heartbeats."""
    ctx = zmq.Context()
    counts = counts or dict.fromkeys(ROLES, 1)
    [(sched, _)], ports = deployment_ports(counts)
    workers = {role: [ScriptedWorker(ctx, role, sched, p) for p in ports[role]] for role in ROLES}
    argv = ["serve", "--model-path", "m", "--disagg-role", "server", "--scheduler-port", str(sched), *flags]
    for role, ws in workers.items():
        argv += [f"--{role.value}-urls", ";".join(w.url for w in ws)]
    try:
        server = DiffusionServer(ServeArgs.from_namespace(build_parser().parse_args(argv)), ctx=ctx)
    except BaseException:  # refused flags: close the workers' sockets, or the context's collection blocks
        ctx.destroy(linger=0)
        raise
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    client = ctx.socket(zmq.DEALER)
    client.connect(server.frontend_endpoint)
    everyone = [w for ws in workers.values() for w in ws]
    deadline = time.monotonic() + 10
    while not all(server.registry.alive(i) for r in workers for i in server.registry.instances(r)):
        assert time.monotonic() < deadline, "scripted workers never registered"
        for w in everyone:
            w.pump()
    try:
        yield server, client, workers
    finally:
        server.stop()
        loop.join(5)
        ctx.destroy(linger=0)


def finish_request(w: dict[Role, ScriptedWorker], rid: str, pixels: tuple[list[dict], list[object]] = ([], [])) -> None:
    """Drive request `rid`, whose Work the encoder has, to the decoder's result (`pixels`: its
    tensor specs and frames, tensors_to_frames), playing each worker's part of the transfer flow."""
    manifest = [{"name": "x", "dtype": "uint8", "shape": [8], "offset": 0}]
    for sender, receiver in ((Role.ENCODER, Role.DENOISER), (Role.DENOISER, Role.DECODER)):
        src, dst = w[sender], w[receiver]
        src.send(TransferStaged(rid, src.url, 8, manifest, {}, 0.0))
        alloc = dst.wait_for(TransferAlloc)
        dst.got.remove(alloc)
        dst.send(TransferAllocated(rid, alloc.instance, SESSION, 4096))
        push = src.wait_for(TransferPush)
        src.got.remove(push)
        src.send(TransferPushed(rid, push.instance, 8, 0.0))
        ready = dst.wait_for(TransferReady)
        dst.got.remove(ready)
    specs, frames = pixels
    w[Role.DECODER].send(Result(rid, w[Role.DECODER].url, specs, 0.0), frames)


def forgotten(server: DiffusionServer, request_id: str) -> bool:
    """Whether the head's thread forgets the request within 5 s, as it does right after it answers
    it or cancels it on the workers (the client or the worker may hear of that first)."""
    deadline = time.monotonic() + 5
    while request_id in server.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    return request_id not in server.requests
