"""An attacker on the network against a running deployment: real processes, real tiny FLUX on CPU.

The attacker is a plain ZMQ peer (no keys) that reaches every port: the workers' work sockets and
the head's result sockets. Each test is one attack from issue 12's list. The attacker must get
nothing, no worker may act on it (no pool bytes held, no slot kept, no write), and real requests
sent meanwhile must come back with the same pixels as before the attack.

Written against the unauthenticated control plane, where each attack succeeded; the deployment
here is the default one of triptych_dev.localdeploy (keys generated in its workdir).
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from tests.e2e.harness import deployment
from tests.local_address import local_address
from tests.models.fixtures import MODELS_DIR
from triptych.params import GenerationParams
from triptych.ports import MOONCAKE_PORT_RANGE, result_port
from triptych.protocol import Heartbeat, Ping, TransferAlloc, TransferPush, Work, encode
from triptych.roles import Role
from triptych_dev.localdeploy import LocalDeployment
from triptych_worker.transfer.listeners import listening_sockets

pytestmark = pytest.mark.slow

IMAGE = {"prompt": "a lighthouse at dusk", "size": "32x32", "seed": 7, "num_inference_steps": 2}
PARAMS = GenerationParams("a forged prompt", width=32, height=32, num_inference_steps=2, seed=1)
SETTLE_S = 2.5  # two worker heartbeats: what a worker holds shows in the head's /health by then
FOREIGN = "tcp://192.0.2.66:19000"  # an instance name the head does not know
HOST_ADDRESS = "198.18.0.42"  # TEST-NET (RFC 2544), on this machine only: tests.local_address
HOST_DEVICE = "trp-p2p"


@pytest.fixture(scope="module")
def dep(tiny_models, tmp_path_factory) -> Iterator[LocalDeployment]:
    with deployment(tiny_models["tiny-flux"], tmp_path_factory.mktemp("attacked"), denoisers=2) as d:
        yield d


@pytest.fixture(scope="module")
def expected(dep: LocalDeployment) -> str:
    """The image of IMAGE before any attack (the seed fixes it)."""
    with dep.client() as c:
        return generate(c)


def generate(client: httpx.Client) -> str:
    r = client.post("/v1/images/generations", json=IMAGE, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["data"][0]["b64_json"])


def pools(dep: LocalDeployment) -> dict[str, tuple[int, int, int, bool]]:
    """Per worker: (pool bytes, free bytes, kept-slot bytes, draining) as its heartbeats report them."""
    health = httpx.get(f"{dep.http}/health", timeout=5).json()
    return {
        w["url"]: (w["pool_bytes"], w["free_bytes"], w["standing_bytes"], w["draining"])
        for ws in health["workers"].values()
        for w in ws
    }


def settled(dep: LocalDeployment) -> dict[str, tuple[int, int, int, bool]]:
    """The workers' pools once nothing is in flight (two heartbeats after the last request)."""
    time.sleep(SETTLE_S)
    return pools(dep)


class Attacker:
    """Unauthenticated PUSH sockets to any endpoint, as anyone on the pod network could open."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sockets: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, msg: Any) -> None:
        sock = self.sockets.get(endpoint)
        if sock is None:
            sock = self.sockets[endpoint] = self.ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.sndhwm = 100_000
            sock.connect(endpoint)
        try:
            sock.send_multipart(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected (refused): as good as sent, for an attacker

    def spam(self, endpoint: str, make: Callable[[int], Any], seconds: float, interval: float = 0.005) -> int:
        deadline, n = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            self.send(endpoint, make(n))
            n += 1
            time.sleep(interval)
        return n

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    a = Attacker()
    yield a
    a.close()


def url(dep: LocalDeployment, role: Role, i: int = 0) -> str:
    return dep.workers(role)[i].url


def test_forged_work_is_never_run_and_holds_no_pool_bytes(dep, expected, attacker):
    before = settled(dep)
    encoder = url(dep, Role.ENCODER)
    for i in range(20):  # as issue 12: Work naming an instance the head does not know, so nothing frees it
        attacker.send(encoder, Work(f"forged-work-{i}", FOREIGN, PARAMS))
    assert settled(dep) == before
    with dep.client() as c:
        assert generate(c) == expected


def rss_mib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_peer_without_keys_announcing_a_huge_frame_is_cut_off_before_it_costs_memory(dep, expected):
    """libzmq reads a handshake's frames before the key check can refuse their sender: a peer with no
    key that greets a worker's work port as a CURVE client, announces a 2 GiB frame and streams it is
    disconnected at once (the work port takes frames of a header's size at most), instead of the
    worker holding all it sends for the handshake's 30 s."""
    worker = dep.workers(Role.DENOISER)[0]
    host, port = worker.url.removeprefix("tcp://").rsplit(":", 1)
    before = rss_mib(worker.popen.pid)
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32
    sent_mib = 0
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(greeting)
        s.recv(64)
        s.sendall(bytes([0x06]) + struct.pack(">Q", 2 << 30))  # a command frame, long: 2 GiB
        chunk = b"\x00" * (1 << 20)
        with contextlib.suppress(OSError):  # the worker hung up: what it should do
            for _ in range(256):
                s.sendall(chunk)
                sent_mib += 1
        time.sleep(1)
        grown = rss_mib(worker.popen.pid) - before  # while the connection is open: what it holds for it
    assert sent_mib < 64 and grown < 64, f"sent {sent_mib} MiB before the worker hung up; it grew {grown} MiB"
    with dep.client() as c:
        assert generate(c) == expected


def test_forged_transfer_push_writes_nothing_to_the_attacker(dep, expected, attacker):
    from triptych_worker.transfer import MooncakeTransport

    trap = np.zeros(1 << 20, dtype=np.uint8)  # the attacker's own Mooncake buffer, waiting for bytes
    with MooncakeTransport("127.0.0.1") as transport:
        transport.register(trap.ctypes.data, trap.nbytes)
        encoder = url(dep, Role.ENCODER)
        # A request for the encoder to stage, then the push that would send its output to the attacker.
        attacker.send(encoder, Work("forged-push", FOREIGN, PARAMS))
        time.sleep(2.0)
        attacker.send(encoder, TransferPush("forged-push", FOREIGN, transport.session_id, trap.ctypes.data))
        # And pushes for whatever the real requests below stage (ids a sniffer could have seen).
        with concurrent.futures.ThreadPoolExecutor(2) as pool, dep.client() as c:
            images = [pool.submit(generate, c) for _ in range(2)]
            attacker.spam(
                encoder,
                lambda n: TransferPush(f"forged-push-{n}", encoder, transport.session_id, trap.ctypes.data),
                seconds=1.0,
            )
            assert [f.result(timeout=120) for f in images] == [expected, expected]
        time.sleep(1.0)
        assert not trap.any(), "a worker wrote into the attacker's buffer"


def test_forged_pings_from_another_head_drop_nothing_real_requests_rely_on(dep, expected, attacker):
    denoisers = [url(dep, Role.DENOISER, i) for i in range(2)]
    stop = threading.Event()

    def spam() -> None:
        n = 0
        while not stop.is_set() and n < 100_000:
            for d in denoisers:
                attacker.send(d, Ping(instance=d, head_id=f"rogue-head-{n % 2}"))
            n += 1
            time.sleep(0.005)

    spammer = threading.Thread(target=spam, daemon=True)
    spammer.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool, dep.client() as c:
            images = [pool.submit(generate, c) for _ in range(6)]
            results = [f.result(timeout=120) for f in images]
    finally:
        stop.set()
        spammer.join(timeout=5)
    assert results == [expected] * 6


def test_forged_kept_slot_allocations_pin_nothing(dep, expected, attacker):
    before = settled(dep)
    for d in [url(dep, Role.DENOISER, i) for i in range(2)]:
        pool_bytes = before[d][0]
        for i in range(16):  # issue 12: enough standing slots to pin every byte of both pools
            attacker.send(d, TransferAlloc(f"forged-keep-{i}", d, nbytes=pool_bytes // 16, standing=True))
    assert settled(dep) == before
    with dep.client() as c:
        assert generate(c) == expected


def test_forged_messages_on_the_heads_result_ports_change_nothing(dep, expected, attacker):
    before = settled(dep)
    forged: list[tuple[str, Heartbeat]] = []
    for role in (Role.ENCODER, Role.DENOISER, Role.DECODER):
        endpoint = f"tcp://127.0.0.1:{result_port(dep.scheduler_port, role)}"
        for proc in dep.workers(role):
            # "I am draining, with no room and no capacity": the head would stop sending it work.
            beat = Heartbeat(proc.url, role.value, "192.0.2.66:1", 1 << 20, 0, 0, "forged", draining=True)
            forged.append((endpoint, beat))
    samples = []
    stop = threading.Event()

    def spam() -> None:
        n = 0
        while not stop.is_set() and n < 100_000:
            for endpoint, beat in forged:
                attacker.send(endpoint, beat)
            n += 1
            time.sleep(0.005)

    spammer = threading.Thread(target=spam, daemon=True)
    spammer.start()
    try:
        with dep.client() as c:
            results = [generate(c) for _ in range(3)]
            for _ in range(10):
                samples.append(pools(dep))
                time.sleep(0.1)
    finally:
        stop.set()
        spammer.join(timeout=5)
    assert results == [expected] * 3
    assert all(not draining for sample in samples for (*_, draining) in sample.values()), samples
    assert settled(dep) == before


def assert_workers_listen_only_on(dep: LocalDeployment, address: str) -> None:
    """Everything each worker listens on: its work socket and Mooncake's two listeners (handshake,
    TCP data), all on `address` (--disagg-p2p-hostname), none on 0.0.0.0 or ::. Mooncake's ports
    come from MOONCAKE_PORT_RANGE, the ports the operator's NetworkPolicy opens to peer workers only."""
    low, high = MOONCAKE_PORT_RANGE
    for role in (Role.ENCODER, Role.DENOISER, Role.DECODER):
        for proc in dep.workers(role):
            work_port = int(proc.url.rsplit(":", 1)[1])
            sockets = listening_sockets(proc.popen.pid)
            assert {a for a, _ in sockets} == {address}, (role, sockets)
            mooncake = {port for _, port in sockets} - {work_port}
            assert len(mooncake) == 2 and all(low <= port <= high for port in mooncake), sockets


def stock_image() -> bytes:
    """IMAGE's pixels from stock diffusers in this process: what every deployment returned before the
    workers' listeners were confined (tests/e2e/test_pixels.py)."""
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(MODELS_DIR / "tiny-flux")
    w, h = map(int, str(IMAGE["size"]).split("x"))
    image = pipe(
        IMAGE["prompt"], width=w, height=h, num_inference_steps=IMAGE["num_inference_steps"],
        generator=torch.Generator("cpu").manual_seed(int(IMAGE["seed"])), output_type="pil",
    ).images[0]  # fmt: skip
    return np.array(image).tobytes()


def pixels(b64_png: str) -> bytes:
    from PIL import Image

    return np.array(Image.open(io.BytesIO(base64.b64decode(b64_png)))).tobytes()


def test_workers_listen_only_on_the_p2p_hostname_on_loopback(dep, expected):
    """With every flag saying 127.0.0.1, Mooncake's listeners too are on 127.0.0.1 only (they were on
    0.0.0.0 and [::] before: issue 12), and the pixels are stock diffusers' own."""
    assert_workers_listen_only_on(dep, "127.0.0.1")
    assert pixels(expected) == stock_image()


def test_workers_listen_only_on_the_p2p_hostname_on_a_host_address(tiny_models, tmp_path, expected):
    """The same on an address of a network interface rather than loopback (HOST_ADDRESS, put on this
    machine for the test: a real interface's address would be dialled), and the request returns the
    pixels the loopback deployment does."""
    with (
        local_address(HOST_ADDRESS, HOST_DEVICE) as address,
        deployment(tiny_models["tiny-flux"], tmp_path, host=address) as host_dep,
    ):
        assert_workers_listen_only_on(host_dep, address)
        with host_dep.client() as c:
            assert generate(c) == expected
