"""DiffusionServer.drain: new requests are refused, accepted ones may finish until the deadline,
then fail with a reason and release every worker slot; the loop ends within the bound.

Scripted workers over real ZMQ sockets (tests/unit/scripted.py), so a request can be held at
exactly the point the test needs; the loop runs in a thread of the test's own, to see it end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from tests.unit.scripted import PARAMS, ROLES, ScriptedWorker, finish_request
from triptych.cli import build_parser
from triptych.config import ServeArgs
from triptych.protocol import (
    CancelWork,
    RequestEvent,
    RequestResult,
    Submit,
    TransferStaged,
    Work,
    decode,
)
from triptych.protocol import encode as encode_message
from triptych.roles import Role
from triptych_dev.localdeploy import deployment_ports
from triptych_head.server import DiffusionServer


@pytest.fixture
def served() -> Iterator[tuple[DiffusionServer, threading.Thread, zmq.Socket, dict[Role, ScriptedWorker]]]:
    ctx = zmq.Context()
    [(sched, _)], ports = deployment_ports(dict.fromkeys(ROLES, 1))
    workers = {role: ScriptedWorker(ctx, role, sched, ports[role][0]) for role in ROLES}
    argv = ["serve", "--model-path", "m", "--disagg-role", "server", "--scheduler-port", str(sched)]
    for role, w in workers.items():
        argv += [f"--{role.value}-urls", w.url]
    server = DiffusionServer(ServeArgs.from_namespace(build_parser().parse_args(argv)), ctx=ctx)
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    client = ctx.socket(zmq.DEALER)
    client.connect(server.frontend_endpoint)
    deadline = time.monotonic() + 10
    while not all(server.registry.alive(i) for r in workers for i in server.registry.instances(r)):
        assert time.monotonic() < deadline, "scripted workers never registered"
        for w in workers.values():
            w.pump()
    try:
        yield server, loop, client, workers
    finally:
        server.stop()
        loop.join(5)
        ctx.destroy(linger=0)


def reply(client: zmq.Socket) -> object:
    assert client.poll(5000), "the client heard nothing"
    msg, _ = decode(client.recv_multipart())
    return msg


def test_a_drain_fails_what_is_left_at_the_deadline_releasing_its_slots_and_ends_the_loop(served):
    server, loop, client, w = served
    client.send_multipart(encode_message(Submit("held", PARAMS)))
    work = w[Role.ENCODER].wait_for(Work)
    w[Role.ENCODER].send(TransferStaged("held", work.instance, 8, [], {}, 0.0))  # the encoder holds its output
    w[Role.DENOISER].wait_for(object)  # the head asked the denoiser for a slot, which never answers

    server.drain(0.5)
    client.send_multipart(encode_message(Submit("late", PARAMS)))
    refused = reply(client)
    assert isinstance(refused, RequestEvent) and refused.request_id == "late" and refused.status_code == 503
    assert "shutting down" in (refused.error or "")

    failed = reply(client)
    assert isinstance(failed, RequestEvent) and failed.request_id == "held" and failed.status_code == 503
    assert "--disagg-drain-timeout" in (failed.error or "")
    loop.join(2)
    assert not loop.is_alive(), "the loop kept running after the drain"
    for role in (Role.ENCODER, Role.DENOISER):  # the sender's staged output and the receiver's slot
        assert w[role].wait_for(CancelWork).request_id == "held"


def test_a_drain_ends_as_soon_as_the_requests_in_flight_are_done(served):
    server, loop, client, w = served
    client.send_multipart(encode_message(Submit("r", PARAMS)))
    work = w[Role.ENCODER].wait_for(Work)
    drain_s = 60.0  # a loop that waited out the drain instead would run this long
    server.drain(drain_s)
    w[Role.ENCODER].got.clear()
    assert server.requests["r"].instance == work.instance
    started = time.monotonic()
    finish_request(w, "r")
    assert isinstance(reply(client), RequestResult)
    loop.join(drain_s / 4)
    # Finishing the request and ending the loop take a fraction of a second (a few on a loaded
    # machine); a quarter of the drain timeout tells that apart from waiting the drain out.
    took = time.monotonic() - started
    assert not loop.is_alive(), f"the loop still ran {took:.1f}s after the last request in flight began to finish"
    assert took < drain_s / 4, f"finishing the last request and ending the loop took {took:.1f}s"
