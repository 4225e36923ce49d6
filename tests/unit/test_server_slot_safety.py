"""A receive slot is never freed while its sender may still be writing into it.

The workers here are scripted over real ZMQ sockets (tests/unit/scripted.py): a real worker
cannot be paused in the middle of a Mooncake write, and that window is exactly what this test needs.
"""

from __future__ import annotations

import pytest

from tests.unit.scripted import PARAMS, SESSION, scripted_head
from triptych.protocol import (
    Cancel,
    CancelWork,
    Failed,
    Progress,
    Submit,
    TransferAlloc,
    TransferAllocated,
    TransferPush,
    TransferPushed,
    TransferReady,
    TransferRefused,
    TransferStaged,
    Work,
    encode,
)
from triptych.roles import Role


@pytest.fixture
def head():
    with scripted_head() as (_, client, workers):
        yield client, {role: ws[0] for role, ws in workers.items()}


def test_cancel_during_a_push_frees_the_receive_slot_only_after_the_write(head):
    client, w = head
    enc, den = w[Role.ENCODER], w[Role.DENOISER]
    client.send_multipart(encode(Submit("r1", PARAMS)))
    work = enc.wait_for(Work)
    manifest = [{"name": "x", "dtype": "uint8", "shape": [8], "offset": 0}]
    enc.send(TransferStaged("r1", work.instance, 8, manifest, {}, 0.0))
    alloc = den.wait_for(TransferAlloc)
    den.send(TransferAllocated("r1", alloc.instance, SESSION, 4096))
    push = enc.wait_for(TransferPush)
    assert push.dest_addr == 4096

    client.send_multipart(encode(Cancel("r1")))  # the write is (as far as the head knows) under way
    enc.wait_for(CancelWork)
    den.pump(0.5)
    assert not any(isinstance(m, CancelWork) for m in den.got), "slot freed while the sender may be writing"

    enc.send(TransferPushed("r1", push.instance, 8, 0.01))  # the sender reports the write is over
    released = den.wait_for(CancelWork)
    assert released.request_id == "r1"


def _run_to_push(client, w, rid):  # type: ignore[no-untyped-def]
    """Submit `rid` and play the encoder up to the head's transfer_push; returns the push."""
    enc = w[Role.ENCODER]
    client.send_multipart(encode(Submit(rid, PARAMS)))
    work = next(m for m in iter(lambda: enc.wait_for(Work), None) if m.request_id == rid)
    enc.got.remove(work)
    manifest = [{"name": "x", "dtype": "uint8", "shape": [8], "offset": 0}]
    enc.send(TransferStaged(rid, work.instance, 8, manifest, {}, 0.0))
    return work


def test_a_standing_slot_is_reused_without_transfer_alloc_once_its_holder_has_loaded_it(head):
    client, w = head
    enc, den = w[Role.ENCODER], w[Role.DENOISER]
    _run_to_push(client, w, "a")
    alloc = den.wait_for(TransferAlloc)
    assert alloc.standing, "the head should ask the receiver to keep its first slot"
    den.got.remove(alloc)
    den.send(TransferAllocated("a", alloc.instance, SESSION, 8192, standing=True))
    den.standing_slots = ((8192, alloc.nbytes),)  # as a worker keeping it does, its heartbeats list it
    push = enc.wait_for(TransferPush)
    enc.got.remove(push)
    enc.send(TransferPushed("a", push.instance, 8, 0.01))
    ready = den.wait_for(TransferReady)
    assert ready.slot_addr == 8192
    den.got.remove(ready)

    _run_to_push(client, w, "b")  # slot still held by "a": the head must allocate another one
    second = den.wait_for(TransferAlloc)
    assert second.request_id == "b"
    den.got.remove(second)
    den.send(TransferRefused("b", second.instance, "transfer pool full", fatal=False))

    den.send(Progress("a", ready.instance, 1, 4))  # "a" reports, so it has loaded its slot
    den.send(den.heartbeat(ready.instance))
    push_b = enc.wait_for(TransferPush)
    assert push_b.request_id == "b" and push_b.dest_addr == 8192
    assert not any(isinstance(m, TransferAlloc) for m in den.got), "a fitting standing slot needs no transfer_alloc"


def test_standing_slots_a_receiver_reserved_at_start_up_are_used_from_the_first_request(head):
    """Its heartbeat lists them: the first hop to it goes straight to a push into the smallest that
    fits, with no transfer_alloc; a payload larger than every one of them takes the alloc path."""
    client, w = head
    enc, den = w[Role.ENCODER], w[Role.DENOISER]
    den.standing_slots = ((4096, 1024), (8192, 512))
    den.send(den.heartbeat(den.pings[-1].instance))
    den.pump(0.3)
    _run_to_push(client, w, "a")  # 8 bytes: both fit, the smaller is taken
    push = enc.wait_for(TransferPush)
    assert push.request_id == "a" and push.dest_addr == 8192
    assert not any(isinstance(m, TransferAlloc) for m in den.got), "a start-up slot needs no transfer_alloc"

    client.send_multipart(encode(Submit("big", PARAMS)))
    work = next(m for m in iter(lambda: enc.wait_for(Work), None) if m.request_id == "big")
    manifest = [{"name": "x", "dtype": "uint8", "shape": [2000], "offset": 0}]
    enc.send(TransferStaged("big", work.instance, 2000, manifest, {}, 0.0))
    alloc = den.wait_for(TransferAlloc)
    assert alloc.request_id == "big" and alloc.nbytes == 2000


def test_a_push_that_gave_up_with_its_write_pending_keeps_the_receive_slot(head):
    client, w = head
    enc, den = w[Role.ENCODER], w[Role.DENOISER]
    _run_to_push(client, w, "stalled")
    alloc = den.wait_for(TransferAlloc)
    den.send(TransferAllocated("stalled", alloc.instance, SESSION, 4096))
    push = enc.wait_for(TransferPush)

    enc.got.clear()
    enc.send(Failed("stalled", push.instance, "write did not finish", write_pending=True))
    retried = enc.wait_for(Work)  # a failed push is retried from the start, as a new attempt
    assert retried.request_id == "stalled~retry1"
    den.pump(0.5)
    assert not any(isinstance(m, CancelWork) for m in den.got), "slot freed while the write may still land"

    enc.send(Failed("stalled", push.instance, "the write ended after all"))  # a late report frees it
    assert den.wait_for(CancelWork).request_id == "stalled"


def test_a_slot_offered_in_another_transfer_session_gets_no_push(head):
    """The sender writes only to the session its receiver heartbeats, whatever an allocation names."""
    client, w = head
    enc, den = w[Role.ENCODER], w[Role.DENOISER]
    client.send_multipart(encode(Submit("elsewhere", PARAMS)))
    work = enc.wait_for(Work)
    manifest = [{"name": "x", "dtype": "uint8", "shape": [8], "offset": 0}]
    enc.send(TransferStaged("elsewhere", work.instance, 8, manifest, {}, 0.0))
    alloc = den.wait_for(TransferAlloc)
    den.send(TransferAllocated("elsewhere", alloc.instance, "192.0.2.66:15001", 4096))
    enc.pump(1.0)
    assert not any(isinstance(m, TransferPush) for m in enc.got), "the sender was sent to a foreign session"
