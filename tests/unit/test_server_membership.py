"""Workers come and go: draining ones get no new work, lost ones have their requests retried.

Workers are scripted over real ZMQ sockets (tests/unit/scripted.py), so a test decides exactly
when a worker falls silent (as a killed process does) and what it has done by then.
"""

from __future__ import annotations

import time

from tests.unit.scripted import PARAMS, SESSION, ScriptedWorker, scripted_head
from triptych.liveness import MIN_HEARTBEAT_TIMEOUT_S
from triptych.params import GenerationParams
from triptych.protocol import (
    Failed,
    Submit,
    TransferAlloc,
    TransferAllocated,
    TransferPush,
    TransferPushed,
    TransferReady,
    TransferStaged,
    Work,
    decode,
    encode,
)
from triptych.roles import Role
from triptych_head.workload import work_units

FAST_LOSS = ("--disagg-heartbeat-timeout", f"{MIN_HEARTBEAT_TIMEOUT_S:g}")  # the shortest it takes
MANIFEST = [{"name": "x", "dtype": "uint8", "shape": [8], "offset": 0}]


def pump_all(workers: list[ScriptedWorker], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for w in workers:
            w.pump(0.01)


def first_with(kind: type, workers: list[ScriptedWorker], others: list[ScriptedWorker], seconds: float = 5.0):  # type: ignore[no-untyped-def]
    """(worker, message): the first of `workers` to get a message of `kind`; `others` keep heartbeating."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for w in workers:
            for msg in w.got:
                if isinstance(msg, kind):
                    w.got.remove(msg)
                    return w, msg
        pump_all([*workers, *others], 0.02)
    raise AssertionError(f"none of {[w.url for w in workers]} got {kind.__name__}")


def client_event(client, seconds: float = 5.0):  # type: ignore[no-untyped-def]
    assert client.poll(int(seconds * 1000)), "the client heard nothing"
    msg, _ = decode(client.recv_multipart())
    return msg


def test_a_draining_worker_is_acknowledged_and_gets_no_new_work():
    with scripted_head({Role.ENCODER: 2, Role.DENOISER: 1, Role.DECODER: 1}) as (server, client, w):
        draining, other = w[Role.ENCODER]
        everyone = [*w[Role.ENCODER], *w[Role.DENOISER], *w[Role.DECODER]]
        draining.draining = True
        deadline = time.monotonic() + 5
        while not any(p.drain_acknowledged for p in draining.pings):
            assert time.monotonic() < deadline, "the head never acknowledged the drain"
            pump_all(everyone, 0.05)
        assert not any(p.drain_acknowledged for p in other.pings)
        for i in range(4):
            client.send_multipart(encode(Submit(f"r{i}", GenerationParams(**PARAMS))))
        pump_all(everyone, 1.0)
        assert not any(isinstance(m, Work) for m in draining.got), draining.got
        assert sum(isinstance(m, Work) for m in other.got) == 2  # its capacity; the rest wait for it
        health = {i["url"]: i for i in server.registry.snapshot()["encoder"]}
        assert health[draining.url]["draining"] and not health[draining.url]["ready"]


def _encode_and_stage(client, enc: ScriptedWorker, rid: str, others: list[ScriptedWorker]) -> None:  # type: ignore[no-untyped-def]
    client.send_multipart(encode(Submit(rid, GenerationParams(**PARAMS))))
    _, work = first_with(Work, [enc], others)
    enc.send(TransferStaged(work.request_id, work.instance, 8, MANIFEST, {}, 0.01))


def test_round_robin_takes_each_roles_instances_in_turn_whatever_the_other_roles_sizes():
    with scripted_head({Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1}) as (_, client, w):
        enc, dec = w[Role.ENCODER][0], w[Role.DECODER][0]
        receivers = []
        for rid in ("r1", "r2"):
            _encode_and_stage(client, enc, rid, [*w[Role.DENOISER], dec])
            den, alloc = first_with(TransferAlloc, w[Role.DENOISER], [enc, dec])
            assert alloc.request_id == rid
            receivers.append(den)
        assert receivers[0] is not receivers[1], "both requests went to the same denoiser"


def test_a_receiver_lost_before_the_write_is_replaced_without_re_encoding():
    with scripted_head({Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1}, FAST_LOSS) as (server, client, w):
        enc, dec = w[Role.ENCODER][0], w[Role.DECODER][0]
        _encode_and_stage(client, enc, "r1", [*w[Role.DENOISER], dec])
        lost, _ = first_with(TransferAlloc, w[Role.DENOISER], [enc, dec])
        survivor = next(d for d in w[Role.DENOISER] if d is not lost)
        # `lost` falls silent without answering; the head notices within the heartbeat timeout.
        _, again = first_with(TransferAlloc, [survivor], [enc, dec], seconds=5)
        assert again.request_id == "r1"  # the same attempt: the encoder's outputs are still staged
        assert not any(isinstance(m, Work) for m in enc.got), "the encoder ran the request again"
        survivor.send(TransferAllocated("r1", again.instance, SESSION, 4096))
        _, push = first_with(TransferPush, [enc], [survivor, dec])
        assert push.dest_addr == 4096
        retries = server.metrics.registry.get_sample_value(
            "triptych_retries_total", {"role": "denoiser", "cause": "heartbeat_lost"}
        )
        assert retries == 1


def _play_to_running_denoiser(client, w, rid: str):  # type: ignore[no-untyped-def]
    """Submit `rid` and play encoder and transfer until a denoiser runs it; returns that denoiser."""
    enc, dec = w[Role.ENCODER][0], w[Role.DECODER][0]
    _encode_and_stage(client, enc, rid, [*w[Role.DENOISER], dec])
    den, alloc = first_with(TransferAlloc, w[Role.DENOISER], [enc, dec])
    den.send(TransferAllocated(alloc.request_id, alloc.instance, SESSION, 4096))
    _, push = first_with(TransferPush, [enc], [*w[Role.DENOISER], dec])
    enc.send(TransferPushed(push.request_id, push.instance, 8, 0.01))
    first_with(TransferReady, [den], [enc, dec])
    return den


def test_a_request_whose_running_denoiser_dies_restarts_as_a_new_attempt():
    with scripted_head({Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1}, FAST_LOSS) as (server, client, w):
        enc, dec = w[Role.ENCODER][0], w[Role.DECODER][0]
        lost = _play_to_running_denoiser(client, w, "r1")
        survivor = next(d for d in w[Role.DENOISER] if d is not lost)
        _, work = first_with(Work, [enc], [survivor, dec], seconds=5)
        assert work.request_id == "r1~retry1"  # its own id: nothing of the lost attempt can match it
        # A late report of the first attempt (e.g. a worker that was only slow) changes nothing.
        enc.send(TransferStaged("r1", work.instance, 8, MANIFEST, {}, 0.01))
        enc.send(TransferStaged(work.request_id, work.instance, 8, MANIFEST, {}, 0.01))
        _, alloc = first_with(TransferAlloc, [survivor], [enc, dec])
        assert alloc.request_id == "r1~retry1"
        assert server.requests["r1"].state.value == "DENOISING_WAITING"


def test_a_failed_push_restarts_the_request_since_the_sender_freed_its_outputs():
    with scripted_head({Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1}) as (server, client, w):
        enc, den, dec = w[Role.ENCODER][0], w[Role.DENOISER][0], w[Role.DECODER][0]
        _encode_and_stage(client, enc, "r1", [den, dec])
        _, alloc = first_with(TransferAlloc, [den], [enc, dec])
        den.send(TransferAllocated("r1", alloc.instance, SESSION, 4096))
        _, push = first_with(TransferPush, [enc], [den, dec])
        enc.send(Failed("r1", push.instance, "peer closed the connection"))
        _, work = first_with(Work, [enc], [den, dec])
        assert work.request_id == "r1~retry1"
        retries = server.metrics.registry.get_sample_value(
            "triptych_retries_total", {"role": "denoiser", "cause": "transfer_failed"}
        )
        assert retries == 1


def test_a_request_out_of_retries_fails_naming_the_lost_worker():
    flags = (*FAST_LOSS, "--disagg-max-retries", "0")
    with scripted_head({Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1}, flags) as (_, client, w):
        enc, dec = w[Role.ENCODER][0], w[Role.DECODER][0]
        lost = _play_to_running_denoiser(client, w, "r1")
        survivor = next(d for d in w[Role.DENOISER] if d is not lost)
        deadline = time.monotonic() + 5
        while not client.poll(0):
            assert time.monotonic() < deadline
            pump_all([enc, survivor, dec], 0.05)
        failed = client_event(client)
        assert failed.state == "FAILED" and failed.status_code == 503
        assert lost.url in failed.error and "gave up after 0 retries" in failed.error


def test_requests_fail_when_their_role_has_had_no_ready_instance_for_the_wait():
    flags = (*FAST_LOSS, "--disagg-no-instance-wait", "1")
    with scripted_head(flags=flags) as (_, client, w):
        den, dec = w[Role.DENOISER][0], w[Role.DECODER][0]
        pump_all([den, dec], MIN_HEARTBEAT_TIMEOUT_S + 0.5)  # the encoder is silent: lost after the timeout
        client.send_multipart(encode(Submit("r1", GenerationParams(**PARAMS))))
        started = time.monotonic()
        # It fails within the 1 s wait plus an upkeep tick (0.5 s); a head that did not apply the wait
        # would hold it until --disagg-timeout (600 s). 10 s tells the two apart on a loaded machine too.
        bound = 10
        while not client.poll(0):
            assert time.monotonic() - started < bound, f"the request still waited after {bound}s"
            pump_all([den, dec], 0.05)
        failed = client_event(client)
        assert failed.state == "FAILED" and failed.status_code == 503
        assert "--disagg-no-instance-wait" in failed.error, failed.error
        took = time.monotonic() - started
        assert took < bound, f"the request failed {took:.1f}s after it was submitted"


def test_pending_work_counts_every_role_a_request_still_needs():
    with scripted_head() as (server, client, w):
        everyone = [ws[0] for ws in w.values()]
        params = GenerationParams(**PARAMS)
        for i in range(3):
            client.send_multipart(encode(Submit(f"r{i}", params)))
        pump_all(everyone, 1.2)  # the encoder takes two (its capacity) and answers nothing

        def sample(name: str, role: Role) -> float:
            value = server.metrics.registry.get_sample_value(name, {"role": role.value})
            assert value is not None, name
            return value

        assert sample("triptych_role_queued_requests", Role.ENCODER) == 1
        assert sample("triptych_role_running_requests", Role.ENCODER) == 2
        assert sample("triptych_role_ready_instances", Role.DENOISER) == 1
        denoise = work_units(Role.DENOISER, params) * sample("triptych_role_seconds_per_work_unit", Role.DENOISER)
        assert sample("triptych_role_pending_work_seconds", Role.DENOISER) == 3 * denoise


def test_the_wait_for_an_instance_counts_from_when_a_request_waits_not_from_when_the_role_lost_its_last():
    flags = (*FAST_LOSS, "--disagg-no-instance-wait", "2")
    with scripted_head(flags=flags) as (_, client, w):
        den, dec = w[Role.DENOISER][0], w[Role.DECODER][0]
        # The encoder is silent: lost after the heartbeat timeout, then idle without one for longer than the wait
        # (a role parked, or scaled to zero while no request needed it).
        pump_all([den, dec], MIN_HEARTBEAT_TIMEOUT_S + 3.5)
        client.send_multipart(encode(Submit("r1", GenerationParams(**PARAMS))))
        started = time.monotonic()
        while time.monotonic() - started < 1.2:  # well inside its own 2 s: a new instance may still come up
            assert not client.poll(0), f"failed {time.monotonic() - started:.1f}s after it was submitted"
            pump_all([den, dec], 0.05)
        bound = 10
        while not client.poll(0):
            assert time.monotonic() - started < bound, f"the request still waited after {bound}s"
            pump_all([den, dec], 0.05)
        failed = client_event(client)
        assert failed.state == "FAILED" and "--disagg-no-instance-wait" in failed.error, failed.error
