"""The messaging floor of one request: its 12 control messages over raw ZMQ, nothing else.

A request through the head touches five processes with 12 one-way messages: client -> head,
five head -> worker -> head round trips (encoder: work, push; denoiser: ready, push; decoder:
ready), head -> client. Here the same sockets (DEALER -> ROUTER, PUSH -> PULL) between the same
number of processes carry messages of the same sizes and frames as a request of bench/head_bench.py
(`request_messages`: the protocol's own messages, encoded at start-up with the values such a request
carries, so the sizes follow the protocol), the head <-> worker sockets authenticated and encrypted
with CURVE as deployed (the client's frontend socket is not, as in the head), and the head and the
three workers only forward, so the median latency is what the messages alone cost on this machine.

    python bench/zmq_floor.py [--requests 200]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triptych.params import GenerationParams
from triptych.protocol import (
    RequestResult,
    Result,
    Submit,
    TransferPush,
    TransferPushed,
    TransferReady,
    TransferStaged,
    Work,
    encode,
)
from triptych.protocol.codec import Message
from triptych.roles import Role
from triptych_dev.localdeploy import free_port_block
from triptych_dev.null_pipeline import FixedPayload
from triptych_head.timeline import DEVICE_SECONDS, server_timing

ROLES = (Role.ENCODER, Role.DENOISER, Role.DECODER)  # the workers, in a request's order
ROUTE = (0, 0, 1, 1, 2)  # worker index of each head -> worker -> head round trip of one request
PARAMS = GenerationParams("bench", width=16, height=16, num_inference_steps=1)  # bench/head_bench.py's requests
PAYLOAD_BYTES = 64 * 1024  # what each hop hands over (head_bench's --payload-bytes): it is in the manifests
TIMEOUT_MS = 10_000

Sizes = tuple[int, ...]
"""Bytes of each frame of one message: its msgpack header, then its raw (pixel) frames."""


@dataclass(frozen=True)
class Messages:
    """The frame sizes of one request's 12 messages."""

    submit: Sizes  # client -> head
    hops: tuple[tuple[Sizes, Sizes], ...]  # per round trip of ROUTE: (head -> worker, worker -> head)
    reply: Sizes  # head -> client: request_result + pixels


def request_messages(params: GenerationParams = PARAMS, payload_bytes: int = PAYLOAD_BYTES) -> Messages:
    """The sizes of a bench/head_bench.py request's messages: the protocol's classes, encoded with the
    values such a request carries (the null workers' manifests, ids, addresses and numbers as long as a
    real run's), so that they follow the protocol as it changes. The result's timings and Server-Timing
    parts are named as triptych_head.transfers and .timeline name them."""
    rid = "seq-100"  # head_bench's sequential ids: 300 of a default run's 400 have three digits
    head_id = uuid.uuid4().hex  # as triptych_head.membership makes it
    addr = 0x7FC6_1234_5000  # a receiving slot's address in a worker's pool (a real run's are as long)
    seconds = 1e-3  # msgpack floats are 9 bytes whatever they hold; in Server-Timing, "1.000" as a run's
    instances = [f"tcp://127.0.0.1:{30285 + i}" for i in range(len(ROLES))]  # local_deployment's ports
    sessions = [f"127.0.0.1:{16091 + i}" for i in range(len(ROLES))]  # the workers' Mooncake sessions
    shapes = FixedPayload(payload_bytes)
    payload = [spec.to_wire() for spec in shapes.output_specs(Role.ENCODER, params)]
    pixel_specs = shapes.output_specs(Role.DECODER, params)
    pixels, pixel_bytes = [spec.to_wire() for spec in pixel_specs], tuple(spec.nbytes for spec in pixel_specs)

    def staged(i: int) -> TransferStaged:
        return TransferStaged(
            request_id=rid, instance=instances[i], nbytes=payload_bytes, manifest=payload, meta={}, seconds=seconds
        )

    def push(i: int) -> TransferPush:
        return TransferPush(
            request_id=rid, instance=instances[i], dest_session=sessions[i + 1], dest_addr=addr, head_id=head_id,
            slot_bytes=payload_bytes,
        )  # fmt: skip

    def pushed(i: int) -> TransferPushed:
        return TransferPushed(request_id=rid, instance=instances[i], nbytes=payload_bytes, seconds=seconds)

    def ready(i: int) -> TransferReady:
        return TransferReady(
            request_id=rid, instance=instances[i], params=params, manifest=payload, meta={}, slot_addr=addr,
            head_id=head_id,
        )  # fmt: skip

    timings: dict[str, float] = {}
    parts: dict[str, float] = {}
    for i, role in enumerate(r.value for r in ROLES):
        parts[f"queue-{role}"] = seconds
        if i:
            parts[f"transfer-{ROLES[i - 1].value}-{role}"] = seconds
        parts[role] = seconds
        timings[role] = timings[f"worker_{role}"] = seconds
        if i + 1 < len(ROLES):
            timings[f"transfer_{role}_{ROLES[i + 1].value}"] = timings[f"handoff_{role}_{ROLES[i + 1].value}"] = seconds
    timings[DEVICE_SECONDS] = timings["total"] = seconds
    result = Result(request_id=rid, instance=instances[-1], tensors=pixels, seconds=seconds)
    reply = RequestResult(rid, pixels, timings, server_timing(parts, seconds))

    def size(msg: Message, frames: Sizes = ()) -> Sizes:
        return (len(encode(msg)[0]), *frames)

    hops = (
        (size(Work(request_id=rid, instance=instances[0], params=params, head_id=head_id)), size(staged(0))),
        (size(push(0)), size(pushed(0))),
        (size(ready(1)), size(staged(1))),
        (size(push(1)), size(pushed(1))),
        (size(ready(2)), size(result, pixel_bytes)),
    )
    assert len(hops) == len(ROUTE)
    return Messages(size(Submit(rid, params)), hops, size(reply, pixel_bytes))


def _frames(sizes: tuple[int, ...], hop: int) -> list[bytes]:
    """A message of these frame sizes; its first byte names the round trip (the worker's reply to it)."""
    return [bytes([hop]) + b"x" * (sizes[0] - 1), *(b"x" * n for n in sizes[1:])]


def _curve(sock: zmq.Socket, keys: dict[str, bytes], server: bool) -> None:
    """CURVE as the head <-> worker sockets have it (the ZAP check runs at connect only, so it is left out)."""
    sock.curve_secretkey = keys["secret"]
    sock.curve_publickey = keys["public"]
    if server:
        sock.curve_server = True
    else:
        sock.curve_serverkey = keys["public"]


def _worker(work_port: int, result_port: int, keys: dict[str, bytes], messages: Messages) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    _curve(pull, keys, server=True)
    _curve(push, keys, server=False)
    pull.bind(f"tcp://127.0.0.1:{work_port}")
    push.connect(f"tcp://127.0.0.1:{result_port}")
    replies = [_frames(back, hop) for hop, (_, back) in enumerate(messages.hops)]
    while (msg := pull.recv_multipart()) != [b"stop"]:
        push.send_multipart(replies[msg[0][0]])


def _head(front_port: int, result_port: int, work_ports: list[int], keys: dict[str, bytes], messages: Messages) -> None:
    ctx = zmq.Context()
    front, results = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    _curve(results, keys, server=True)
    front.bind(f"tcp://127.0.0.1:{front_port}")
    results.bind(f"tcp://127.0.0.1:{result_port}")
    workers = [ctx.socket(zmq.PUSH) for _ in work_ports]
    for sock, port in zip(workers, work_ports, strict=True):
        _curve(sock, keys, server=False)
        sock.connect(f"tcp://127.0.0.1:{port}")
    outbound = [_frames(out, hop) for hop, (out, _) in enumerate(messages.hops)]
    reply = _frames(messages.reply, 0)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(results, zmq.POLLIN)
    client, hop = b"", 0
    while True:
        ready = dict(poller.poll(TIMEOUT_MS))
        if front in ready:
            client, body = front.recv_multipart()
            if body == b"stop":
                for w in workers:
                    w.send(b"stop")
                return
            hop = 0
            workers[ROUTE[0]].send_multipart(outbound[0])
        if results in ready:
            results.recv_multipart()
            hop += 1
            if hop < len(ROUTE):
                workers[ROUTE[hop]].send_multipart(outbound[hop])
            else:
                front.send_multipart([client, *reply])


class Floor:
    """The four forwarding processes (`procs`: the three workers and the head) and a client (this
    process), up for the `with` block; `block(n)` measures n requests now, so a caller can alternate
    floor blocks with its own in one process lifetime. `payload_bytes`: the hops' (their manifests)."""

    def __init__(self, payload_bytes: int = PAYLOAD_BYTES) -> None:
        self.messages = request_messages(PARAMS, payload_bytes)
        self.message = b"x" * self.messages.submit[0]
        n_ports = 2 + 1 + max(ROUTE)
        base = free_port_block(n_ports)
        self.front_port, result_port, *work_ports = range(base, base + n_ports)
        public, secret = zmq.curve_keypair()  # one key pair, as every head <-> worker link has its peer's
        keys = {"public": public, "secret": secret}
        spawn = mp.get_context("spawn")
        self.procs = [
            spawn.Process(target=_worker, args=(p, result_port, keys, self.messages), daemon=True) for p in work_ports
        ]
        self.procs.append(
            spawn.Process(
                target=_head, args=(self.front_port, result_port, work_ports, keys, self.messages), daemon=True
            )
        )
        self.ctx = zmq.Context()
        self.client = self.ctx.socket(zmq.DEALER)

    def __enter__(self) -> Floor:
        for p in self.procs:
            p.start()
        self.client.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        self.client.setsockopt(zmq.LINGER, 0)
        self.client.connect(f"tcp://127.0.0.1:{self.front_port}")
        for _ in range(20):  # connect and warm up
            self.client.send(self.message)
            self.client.recv_multipart()
        return self

    def block(self, requests: int, max_seconds: float = 30.0) -> list[float]:
        """Seconds of each request's 12 messages, at most `requests` in `max_seconds`."""
        samples: list[float] = []
        deadline = time.monotonic() + max_seconds
        while len(samples) < requests and time.monotonic() < deadline:
            t0 = time.perf_counter()
            self.client.send(self.message)
            self.client.recv_multipart()
            samples.append(time.perf_counter() - t0)
        return samples

    def __exit__(self, *exc: object) -> None:
        try:
            self.client.send(b"stop")
        finally:
            self.client.close()
            self.ctx.term()
            for p in self.procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()


def summary(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "messages": 2 + 2 * len(ROUTE),
        "floor_ms": statistics.median(samples) * 1e3,
        "floor_p90_ms": samples[int(0.9 * (len(samples) - 1))] * 1e3,
        "floor_p99_ms": samples[int(0.99 * (len(samples) - 1))] * 1e3,
    }


def measure(requests: int = 200, max_seconds: float = 30.0) -> dict[str, float]:
    """Median, p90 and p99 seconds of one request's 12 messages, over at most `requests` in `max_seconds`."""
    with Floor() as floor:
        return summary(floor.block(requests, max_seconds))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200)
    args = p.parse_args()
    out = measure(args.requests)
    print(f"{out['messages']} raw ZMQ messages over 5 processes: {out['floor_ms']:.2f} ms median, "
          f"{out['floor_p90_ms']:.2f} ms p90, {out['floor_p99_ms']:.2f} ms p99")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
