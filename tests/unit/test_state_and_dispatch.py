"""The request state machine and the dispatch policies."""

from __future__ import annotations

import itertools

import pytest

from triptych.roles import Role
from triptych_head.dispatch import RoundRobin, dispatch_max_free_slots
from triptych_head.instances import WorkerInstance
from triptych_head.state import InvalidTransition, RequestState, check_transition

S = RequestState
HAPPY_PATH = [
    S.PENDING, S.ENCODER_WAITING, S.ENCODER_RUNNING, S.ENCODER_DONE, S.DENOISING_WAITING, S.DENOISING_RUNNING,
    S.DENOISING_DONE, S.DECODER_WAITING, S.DECODER_RUNNING, S.DONE,
]  # fmt: skip


def test_happy_path_is_allowed():
    for a, b in itertools.pairwise(HAPPY_PATH):
        check_transition(a, b)


def test_a_full_pipeline_request_has_one_hop_which_ends_it():
    for a, b in itertools.pairwise([S.PENDING, S.DENOISING_WAITING, S.DENOISING_RUNNING, S.DONE]):
        check_transition(a, b)


@pytest.mark.parametrize("state", HAPPY_PATH[:-1])
def test_any_live_state_can_fail_or_time_out(state):
    for end in (S.FAILED, S.TIMED_OUT, S.CANCELLED):
        check_transition(state, end)


@pytest.mark.parametrize(
    ("a", "b"), [(S.PENDING, S.DENOISING_RUNNING), (S.ENCODER_RUNNING, S.DECODER_RUNNING), (S.DONE, S.FAILED),
                 (S.FAILED, S.ENCODER_WAITING), (S.DECODER_RUNNING, S.ENCODER_WAITING)],
)  # fmt: skip
def test_skips_and_resurrections_are_rejected(a, b):
    with pytest.raises(InvalidTransition):
        check_transition(a, b)


def instances(*free: int) -> list[WorkerInstance]:
    out = []
    for i, f in enumerate(free):
        w = WorkerInstance(url=f"tcp://w{i}:1", role=Role.DENOISER, capacity=4)
        w.inflight = {f"r{i}-{k}" for k in range(4 - f)}
        out.append(w)
    return out


def test_round_robin_cycles_and_skips_full_instances():
    ws = instances(1, 0, 1)
    rr = RoundRobin()
    picks = [rr(ws, lambda w: w.free_slots > 0).url for _ in range(4)]
    assert picks == ["tcp://w0:1", "tcp://w2:1", "tcp://w0:1", "tcp://w2:1"]
    assert rr(ws, lambda w: False) is None


def test_max_free_slots_picks_the_emptiest():
    ws = instances(1, 3, 2)
    assert dispatch_max_free_slots(ws, lambda w: True).url == "tcp://w1:1"
    assert dispatch_max_free_slots(ws, lambda w: w.url != "tcp://w1:1").url == "tcp://w2:1"


def test_the_standing_slots_a_head_keeps_are_never_more_than_the_worker_lists_and_its_holders():
    """A heartbeat claiming any capacity used to add every slot it listed to a table that only grew
    (one forged heartbeat: a million slots, scanned at every dispatch). Now an idle slot the worker
    no longer lists is forgotten; one a request holds stays until it lets it go."""
    w = WorkerInstance(url="tcp://w:1", role=Role.DENOISER)
    listed = tuple((0x1000 + i * 0x100, 256) for i in range(5000))
    w.on_heartbeat(0.0, 1 << 62, "s1", 1 << 20, 1 << 20, "m")
    w.adopt_standing(listed)
    assert len(w.standing) == 5000
    w.standing[0x1000].holder = "r1"  # a request took one
    w.on_heartbeat(1.0, 2, "s1", 1 << 20, 1 << 20, "m")  # the worker's own next heartbeat
    w.adopt_standing(((0x9000, 512),))
    assert {addr: s.holder for addr, s in w.standing.items()} == {0x1000: "r1", 0x9000: None}
    w.standing[0x1000].holder = None  # r1 is done with it, and the worker does not list it
    w.adopt_standing(((0x9000, 512), (0xA000, 512), (0xB000, 512)))
    assert sorted(w.standing) == [0x9000, 0xA000]  # at most its capacity
    assert w.heard_for(3.0) == 3.0
