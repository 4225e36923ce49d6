"""The messaging floor of one request: its 12 control messages over raw ZMQ, nothing else.

A request through the head touches five processes with 12 one-way messages: client -> head,
five head -> worker -> head round trips (encoder: work, push; denoiser: ready, push; decoder:
ready), head -> client. Here the same sockets (DEALER -> ROUTER, PUSH -> PULL) between the same
number of processes carry messages of the same sizes and frames as a request of bench/head_bench.py
(measured from its encoded messages: a 303-byte submit, a 390-byte work, 515-byte readies, the
decoder's result and the reply with their 768-byte pixel frame, ...), the head <-> worker sockets
authenticated and encrypted with CURVE as deployed (the client's frontend socket is not, as in the
head), and every process only forwards, so the median latency is what the messages alone cost on
this machine.

    python bench/zmq_floor.py [--requests 200]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triptych_dev.localdeploy import free_port_block

ROUTE = (0, 0, 1, 1, 2)  # worker index of each head -> worker -> head round trip of one request
# Bytes of each frame of a request's messages in bench/head_bench.py (msgpack headers, pixel frames):
SUBMIT = (303,)  # client -> head
HOPS = (  # per round trip of ROUTE: (head -> worker, worker -> head)
    ((390,), (204,)),  # work, transfer_staged
    ((161,), (102,)),  # transfer_push, transfer_pushed
    ((515,), (204,)),  # transfer_ready, transfer_staged
    ((161,), (102,)),  # transfer_push, transfer_pushed
    ((515,), (168, 768)),  # transfer_ready, result + pixels
)
REPLY = (613, 768)  # head -> client: request_result + pixels
MESSAGE = b"x" * SUBMIT[0]
TIMEOUT_MS = 10_000


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


def _worker(work_port: int, result_port: int, keys: dict[str, bytes]) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    _curve(pull, keys, server=True)
    _curve(push, keys, server=False)
    pull.bind(f"tcp://127.0.0.1:{work_port}")
    push.connect(f"tcp://127.0.0.1:{result_port}")
    replies = [_frames(back, hop) for hop, (_, back) in enumerate(HOPS)]
    while (msg := pull.recv_multipart()) != [b"stop"]:
        push.send_multipart(replies[msg[0][0]])


def _head(front_port: int, result_port: int, work_ports: list[int], keys: dict[str, bytes]) -> None:
    ctx = zmq.Context()
    front, results = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    _curve(results, keys, server=True)
    front.bind(f"tcp://127.0.0.1:{front_port}")
    results.bind(f"tcp://127.0.0.1:{result_port}")
    workers = [ctx.socket(zmq.PUSH) for _ in work_ports]
    for sock, port in zip(workers, work_ports, strict=True):
        _curve(sock, keys, server=False)
        sock.connect(f"tcp://127.0.0.1:{port}")
    outbound = [_frames(out, hop) for hop, (out, _) in enumerate(HOPS)]
    reply = _frames(REPLY, 0)
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
    """The five forwarding processes and a client, up for the `with` block; `block(n)` measures n
    requests now, so a caller can alternate floor blocks with its own in one process lifetime."""

    def __init__(self) -> None:
        n_ports = 2 + 1 + max(ROUTE)
        base = free_port_block(n_ports)
        self.front_port, result_port, *work_ports = range(base, base + n_ports)
        public, secret = zmq.curve_keypair()  # one key pair, as every head <-> worker link has its peer's
        keys = {"public": public, "secret": secret}
        spawn = mp.get_context("spawn")
        self.procs = [spawn.Process(target=_worker, args=(p, result_port, keys), daemon=True) for p in work_ports]
        self.procs.append(
            spawn.Process(target=_head, args=(self.front_port, result_port, work_ports, keys), daemon=True)
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
            self.client.send(MESSAGE)
            self.client.recv_multipart()
        return self

    def block(self, requests: int, max_seconds: float = 30.0) -> list[float]:
        """Seconds of each request's 12 messages, at most `requests` in `max_seconds`."""
        samples: list[float] = []
        deadline = time.monotonic() + max_seconds
        while len(samples) < requests and time.monotonic() < deadline:
            t0 = time.perf_counter()
            self.client.send(MESSAGE)
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
