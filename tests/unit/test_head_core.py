"""The head's decisions, driven message by message with no socket, thread or sleep (core.py).

The core is given what the frontend and the workers say and a hand-moved clock; what it sends
is recorded. The invariants the transfer flow rests on are checked from both sides after every
step of many seeded random schedules: never two requests in one receive slot, never a write into
a slot freed or given to another, never a worker above its capacity, never a slot leaked, and
every request ends exactly once.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from tests.unit.core_harness import CAPACITY, PARAMS, Harness, SimWorker, SlotViolation
from triptych.params import GenerationParams
from triptych.protocol import (
    BatchResized,
    CancelWork,
    HandOff,
    Ping,
    Progress,
    RequestEvent,
    RequestResult,
    StepCacheStats,
    Submit,
    TransferAlloc,
    TransferAllocated,
    TransferPush,
    TransferReady,
    TransferStaged,
    Work,
    encode,
)
from triptych.protocol.codec import PROTOCOL_VERSION
from triptych.roles import Role
from triptych_head.state import RequestState
from triptych_head.timeline import DEVICE_SECONDS, parse_server_timing

THREE_ROLES = {Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1}


def _kinds(h: Harness) -> list[tuple[str, str]]:
    return [(h.workers[url].role.value, type(msg).__name__) for url, msg in h.pending]


def test_a_request_walks_the_transfer_flow_one_message_at_a_time() -> None:
    h = Harness(THREE_ROLES)
    h.submit("r")
    assert _kinds(h) == [("encoder", "Work")]
    assert h.state("r") is RequestState.ENCODER_RUNNING
    h.deliver()  # the encoder runs and stages its outputs
    h.answer()
    assert _kinds(h) == [("denoiser", "TransferAlloc")]
    assert h.state("r") is RequestState.DENOISING_WAITING
    h.deliver()  # the denoiser reserves a slot
    h.answer()
    assert _kinds(h) == [("encoder", "TransferPush")]
    h.deliver()  # the encoder writes and reports
    h.answer()
    assert _kinds(h) == [("denoiser", "TransferReady")]
    assert h.state("r") is RequestState.DENOISING_RUNNING
    h.deliver()
    h.answer()  # staged for the decoder
    for _ in range(2):  # alloc, push
        h.deliver()
        h.answer()
    assert _kinds(h) == [("decoder", "TransferReady")]
    assert h.state("r") is RequestState.DECODER_RUNNING
    h.deliver()
    h.answer()  # pixels
    assert [type(m) for m in h.endings()["r"]] == [RequestResult]
    h.check_idle()


def test_a_message_type_of_a_newer_worker_is_dropped_without_failing_its_request() -> None:
    """A worker of a newer release sends something this head does not know, naming a request: it is
    dropped and counted, and the request goes on; a known message that is malformed still fails it."""
    h = Harness(THREE_ROLES)
    h.submit("r")
    ((encoder, work),) = h.pending
    newer = msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": "stage_note_v9", "request_id": work.request_id,
                                    "instance": encoder})  # fmt: skip
    h.core.on_worker(Role.ENCODER, [newer])
    assert h.state("r") is RequestState.ENCODER_RUNNING and h.endings() == {}
    h.deliver()
    h.answer()
    assert h.state("r") is RequestState.DENOISING_WAITING
    garbled = msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": "failed", "request_id": work.request_id})
    h.core.on_worker(Role.ENCODER, [garbled])
    assert h.core.requests.get("r") is None and "r" in h.endings()


def test_a_dead_encoder_is_found_by_the_clock_and_its_request_goes_to_the_other_one() -> None:
    h = Harness({Role.ENCODER: 2, Role.DENOISER: 1, Role.DECODER: 1})
    h.submit("r")
    ((url, work),) = h.pending
    h.workers[url].alive = False
    h.pending.clear()
    h.clock.advance(h.args.disagg_heartbeat_timeout + 1)
    h.tick()
    ((retry_url, retry),) = [(u, m) for u, m in h.pending if isinstance(m, Work)]
    assert retry_url != url and isinstance(retry, Work)
    assert retry.request_id != work.request_id  # a new attempt: late messages of the old one cannot touch it
    assert h.core.metrics.retries.labels("encoder", "heartbeat_lost")._value.get() == 1


def test_a_refused_allocation_keeps_the_outputs_on_the_sender_until_the_receiver_has_room() -> None:
    h = Harness(THREE_ROLES)
    h.submit("r")
    h.deliver()
    h.answer()  # staged
    assert h.refuse_next_alloc()
    h.answer()
    assert h.state("r") is RequestState.DENOISING_WAITING and h.pending == []
    h.tick()  # the receiver's next heartbeat clears the refusal: the head asks again
    assert _kinds(h) == [("denoiser", "TransferAlloc")]


def test_a_send_to_a_disconnected_worker_retries_what_it_held_elsewhere() -> None:
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1})
    h.submit("r")
    h.deliver()
    h.answer()  # staged; alloc to one denoiser
    ((denoiser, alloc),) = h.pending
    h.pending.clear()
    h.transport.down.add(denoiser)  # its socket is gone: the next send to it fails at once
    h.workers[denoiser].alive = False
    allocated = TransferAllocated(alloc.request_id, denoiser, h.workers[denoiser].session, 0x10, standing=False)
    h.workers[denoiser].reserved[0x10] = alloc.request_id
    h.core.on_worker(Role.DENOISER, encode(allocated))
    h.collect()
    # The push was sent to the encoder (up); the denoiser's loss shows when the head sends it TransferReady.
    h.deliver()
    h.answer()
    h.collect()
    kinds = _kinds(h)
    assert h.core.requests["r"].retries == 1, kinds
    assert ("encoder", "Work") in kinds  # the sender freed its outputs with the push: the route restarts


def test_the_core_refuses_new_requests_once_shutting_down_and_fails_the_rest_at_the_deadline() -> None:
    h = Harness(THREE_ROLES)
    h.submit("r")
    h.core.shut_down(5)
    h.submit("late")
    assert h.endings()["late"][0].status_code == 503
    assert not h.core.drained()
    h.clock.advance(6)
    assert h.core.drained()
    (ended,) = h.endings()["r"]
    assert isinstance(ended, RequestEvent) and ended.state == "FAILED" and ended.status_code == 503
    assert ended.code == "head_shut_down"  # what a client sends again to another head (triptych.client)
    h.check_idle()

    # Through the head's own API client: the answer's error carries that code.
    import asyncio

    from triptych_head.backend import LocalClient

    async def answer() -> str:
        future = asyncio.get_running_loop().create_future()
        client = LocalClient.__new__(LocalClient)
        client._pending = {"r": (future, None)}
        client._answer(ended, [])
        try:
            await future
        except Exception as exc:
            return str(getattr(exc, "code", ""))
        return ""

    assert asyncio.run(answer()) == "head_shut_down"


def _run_schedule(
    seed: int,
    counts: dict[Role, int],
    flags: tuple[str, ...] = (),
    heads: int = 1,
    kill_head: bool = False,
    priorities: bool = False,
) -> Harness:
    """Requests (through each head in turn), worker answers in random order, refusals, failures,
    cancels, worker deaths and (`kill_head`) the death of the last head, bounded in steps; the
    invariants are checked after every step, then everything must end. `priorities`: requests of
    random priorities, denoisers of one slot whose stages run until a random step ends them (or a
    HandOff suspends them), so that requests are suspended and resumed throughout."""
    rnd = random.Random(seed)
    held = {"capacity": {Role.DENOISER: 1}, "hold": frozenset({Role.DENOISER})} if priorities else {}
    h = Harness(counts, flags, heads=heads, **held)  # type: ignore[arg-type]

    def finish_one() -> bool:
        computing = sorted(rid for w in h.workers.values() if w.alive for rid in w.computing)
        if not computing:
            return False
        h.finish(rnd.choice(computing))
        return True

    n_requests = (10 if priorities else 6) * heads
    submitted = 0
    kill_at = rnd.randrange(10, 120) if kill_head else -1  # a step while requests are in flight
    for step in range(600 * heads):
        h.check_ledger()
        if step == kill_at:
            h.kill_head(heads - 1)
        choice = rnd.random()
        if submitted < n_requests and choice < 0.15:
            h.submit(f"r{submitted}", head=submitted % heads, priority=rnd.randrange(3) if priorities else 1)
            submitted += 1
        elif priorities and choice < 0.16 and finish_one():
            pass
        elif h.pending and choice < 0.55:
            i = rnd.randrange(len(h.pending))
            roll = rnd.random()
            if not (roll < 0.05 and h.fail(i)):
                h.deliver(i)
        elif h.answers and choice < 0.9:
            h.answer(rnd.randrange(len(h.answers)))
        elif choice < 0.93 and _active(h):
            h.cancel(rnd.choice(sorted(_active(h))))
        elif choice < 0.95:
            h.refuse_next_alloc()
        elif choice < 0.96:
            victim = rnd.choice(sorted(h.workers))
            peers = [w for w in h.workers.values() if w.role is h.workers[victim].role and w.alive]
            if h.workers[victim].alive and len(peers) > 1:
                h.workers[victim].alive = False
                _forget(h, h.workers[victim])
        else:
            h.clock.advance(rnd.choice((0.1, 0.5, h.args.disagg_heartbeat_timeout + 0.5)))
            h.tick()
        if submitted == n_requests and not _active(h) and not h.pending and not h.answers and step > kill_at:
            break
    # Let it all end: every message handled, then time passes until nothing is held.
    for _ in range(200 * heads):
        h.check_ledger()
        if h.pending:
            h.deliver()
        elif h.answers:
            h.answer()
        elif finish_one():
            pass
        elif _active(h) or any(c.held_slots for c in h.live_cores()):
            h.clock.advance(h.args.disagg_heartbeat_timeout + 0.5)
            h.tick()
        else:
            break
    for i in range(submitted, n_requests):
        if h.cores[i % heads].head_id not in h.dead:
            h.submit(f"r{i}", head=i % heads)  # the ones the schedule never sent: refused or run
    while h.pending or h.answers or finish_one():
        h.deliver() if h.pending else h.answer() if h.answers else None
        h.check_ledger()
    for _ in range(50):  # what is left ends by timing out
        if not _active(h) and not any(c.held_slots for c in h.live_cores()):
            break
        h.clock.advance(h.args.disagg_timeout + 1)
        h.tick()
        while h.pending or h.answers:
            h.deliver() if h.pending else h.answer()
    return h


def _active(h: Harness) -> set[str]:
    return {rid for core in h.live_cores() for rid in core.requests}


def _forget(h: Harness, w: SimWorker) -> None:
    """A dead worker's state is gone with it."""
    w.computing.clear()
    w.staged.clear()
    w.reserved.clear()
    w.kept.clear()
    w.content.clear()


@pytest.mark.parametrize("seed", range(40))
def test_random_schedules_never_share_a_slot_oversubscribe_a_worker_or_leak(seed: int) -> None:
    h = _run_schedule(seed, {Role.ENCODER: 2, Role.DENOISER: 2, Role.DECODER: 1})
    h.check_idle()
    endings = h.endings()
    assert sorted(endings) == [f"r{i}" for i in range(6)], endings
    assert all(len(e) == 1 for e in endings.values()), {k: v for k, v in endings.items() if len(v) != 1}
    assert all(w.peak_computing <= 2 for w in h.workers.values())


@pytest.mark.parametrize("seed", range(30))
def test_random_schedules_with_priorities_suspend_and_resume_and_keep_the_same_invariants(seed: int) -> None:
    h = _run_schedule(seed, {Role.ENCODER: 2, Role.DENOISER: 2, Role.DECODER: 1}, priorities=True)
    h.check_idle()
    endings = h.endings()
    assert sorted(endings) == sorted(f"r{i}" for i in range(10)), endings
    assert all(len(e) == 1 for e in endings.values()), {k: v for k, v in endings.items() if len(v) != 1}
    assert all(w.peak_computing <= 1 for w in h.workers.values() if w.role is Role.DENOISER)


def test_random_schedules_with_priorities_do_suspend_requests() -> None:
    suspended = sum(
        _run_schedule(
            seed, {Role.ENCODER: 2, Role.DENOISER: 2, Role.DECODER: 1}, priorities=True
        ).core.metrics.suspensions._value.get()
        for seed in range(30)
    )
    assert suspended >= 5, "the schedules above would test nothing of preemption"


@pytest.mark.parametrize("seed", range(10))
def test_random_schedules_with_batching_keep_the_same_invariants(seed: int) -> None:
    flags = ("--batching-mode", "dynamic", "--batching-max-size", "2", "--batching-delay-ms", "0")
    h = _run_schedule(seed, {Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1}, flags)
    h.check_idle()
    assert all(len(e) == 1 for e in h.endings().values())


def _batching(max_size: int, *flags: str) -> Harness:
    """--batching-mode dynamic with groups of `max_size` over workers of 8 slots that heartbeat that
    batch size, and `flags`."""
    flags = ("--batching-mode", "dynamic", "--batching-max-size", str(max_size), *flags)
    h = Harness(THREE_ROLES, flags, capacity={Role.ENCODER: 8, Role.DENOISER: 8, Role.DECODER: 8})
    for w in h.workers.values():
        w.max_batch = max_size
    h.tick()
    return h


def test_a_role_s_own_batching_delay_holds_its_groups_only() -> None:
    """--batching-role-delay-ms encoder=1000 with --batching-delay-ms 0: requests wait a second for
    an encoder group to fill, then leave together; the denoiser's groups, at every role's 0 ms, at once."""
    h = _batching(4, "--batching-delay-ms", "0", "--batching-role-delay-ms", "encoder=1000")
    h.submit("a")
    h.submit("b")
    h.clock.advance(0.9)
    h.core.dispatch()
    h.collect()
    assert h.pending == [], "the encoder's group waits for its own delay"
    h.clock.advance(0.1)
    h.core.dispatch()
    h.collect()
    assert _kinds(h) == [("encoder", "WorkBatch")] and len(h.pending[0][1].items) == 2
    h.deliver()
    h.answer()
    h.answer()  # both staged: the denoiser's group leaves with no wait
    assert sorted(_kinds(h)) == [("denoiser", "TransferAlloc")] * 2


def _denoiser_group_of_two() -> Harness:
    """--batching-mode dynamic, groups of 2: a and b ran as one encoder batch, and the head has just
    sent the denoiser their two TransferAllocs, as one group (full: it leaves before its delay)."""
    h = _batching(2, "--batching-delay-ms", "1000")
    h.submit("a")
    h.submit("b")
    h.core.dispatch()  # the loop turn's end
    h.collect()
    assert _kinds(h) == [("encoder", "WorkBatch")]
    h.deliver()
    h.answer()
    h.answer()
    assert _kinds(h) == [("denoiser", "TransferAlloc")] * 2
    return h


def _transfer_ready(h: Harness, rid: str) -> TransferReady:
    """Run the flow, message by message, until the head sends `rid`'s TransferReady."""
    for _ in range(100):
        for _, msg in h.pending:
            if isinstance(msg, TransferReady) and msg.request_id == rid:
                return msg
        if h.answers:
            h.answer()
        elif h.pending:
            h.deliver()
        else:
            break
    raise AssertionError(f"no TransferReady for {rid}: pending {_kinds(h)}")


def test_a_later_role_s_group_is_tagged_with_the_members_that_go_together() -> None:
    h = _denoiser_group_of_two()
    sizes = {rid: (m.batch_id, m.batch_size) for rid in ("a", "b") if (m := _transfer_ready(h, rid))}
    assert sizes == {"a": ("a", 2), "b": ("a", 2)}


def test_a_group_member_refused_by_the_receiver_is_not_waited_for() -> None:
    """The denoiser refuses a's slot (its pool is full): a waits in the queue again, and b's
    TransferReady says it runs alone. Before, b said a group of two, and the denoiser waited its
    assembly time (0.5 s) for an a that was not coming."""
    h = _denoiser_group_of_two()
    assert h.refuse_next_alloc()
    ready = _transfer_ready(h, "b")
    assert (ready.batch_id, ready.batch_size) == ("", 1)


def test_a_group_member_cancelled_on_the_way_is_not_waited_for() -> None:
    h = _denoiser_group_of_two()
    h.cancel("a")
    ready = _transfer_ready(h, "b")
    assert (ready.batch_id, ready.batch_size) == ("", 1)


@pytest.mark.parametrize("lost", ["cancelled", "failed", "retried", "requeued"])
def test_a_group_member_lost_after_its_sibling_s_transfer_ready_resizes_the_group(lost: str) -> None:
    """b's TransferReady went out saying a group of two; then a is lost on its way (the client cancels
    it, its sender fails it, its sender is lost and it starts over, it waits for another receiver):
    the denoiser is told the group is b alone now (BatchResized), where it waited its assembly time
    (0.5 s) for an a that was not coming."""
    h = _denoiser_group_of_two()
    ready = _transfer_ready(h, "b")
    assert (ready.batch_id, ready.batch_size) == ("a", 2)
    a = h.core.requests["a"]
    assert a.batch is not None and not _resized(h)
    if lost == "cancelled":
        h.cancel("a")
    elif lost == "failed":
        h.core.finish(a, RequestState.FAILED, "its sender failed it", 500)
    elif lost == "retried":  # its sender is lost: it starts over
        encoder = h.core.membership.find(next(u for u, w in h.workers.items() if w.role is Role.ENCODER))
        assert encoder is not None
        h.core.retry(a, encoder, "disconnected", "the encoder is lost", outputs_kept=False)
    else:  # its receiver gave it up: it waits for another, its outputs kept
        denoiser = h.core.membership.find(ready.instance)
        assert denoiser is not None
        h.core.retry(a, denoiser, "refused", "the denoiser gave it up")
    h.collect()
    assert _resized(h) == [(ready.instance, "a", 1)]
    h.cancel("b")
    h.collect()
    assert len(_resized(h)) == 1, "b's own end resizes nothing: no TransferReady counts a member still to come"


def _resized(h: Harness) -> list[tuple[str, str, int]]:
    return [(url, m.batch_id, m.batch_size) for url, m in h.pending if isinstance(m, BatchResized)]


@pytest.mark.parametrize("seed", range(30))
def test_two_heads_over_shared_workers_never_oversubscribe_one_or_share_a_slot_and_every_request_ends(
    seed: int,
) -> None:
    h = _run_schedule(seed, {Role.ENCODER: 2, Role.DENOISER: 2, Role.DECODER: 1}, heads=2)
    h.check_idle()
    endings = h.endings()
    assert sorted(endings) == sorted(f"r{i}" for i in range(12)), endings
    assert all(len(e) == 1 for e in endings.values()), {k: v for k, v in endings.items() if len(v) != 1}


@pytest.mark.parametrize("seed", range(20))
def test_a_killed_head_s_work_is_released_on_every_worker_and_the_other_head_s_requests_all_end(seed: int) -> None:
    h = _run_schedule(seed, {Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1}, heads=2, kill_head=True)
    assert h.dead, "the schedule kills the second head"
    h.check_idle()  # the live head holds nothing, and no worker holds anything for either head
    endings = h.endings()
    survivor = {f"r{i}" for i in range(0, 12, 2)}  # head 0's requests
    assert survivor <= set(endings), sorted(survivor - set(endings))
    assert all(len(endings[r]) == 1 for r in survivor)


def test_the_invariant_checks_catch_a_core_that_gives_one_slot_to_two_requests() -> None:
    """The checks can fail: a core that forgets a standing slot's holder hands it out twice."""
    h = Harness(THREE_ROLES)
    h.submit("a")
    h.deliver()
    h.answer()  # a staged; TransferAlloc(keep) to the denoiser
    h.deliver()
    h.answer()  # allocated and kept: TransferPush to the encoder
    inst = h.core.membership.find(next(u for u, w in h.workers.items() if w.role is Role.DENOISER))
    assert inst is not None and inst.standing, "the first transfer's slot should be kept"
    h.deliver()  # a's bytes land in the slot; the denoiser has not loaded them yet
    for slot in inst.standing.values():
        slot.holder = None  # the bug: the slot looks free while it holds a's input
    h.submit("b")
    h.deliver()  # b's encoder stage
    h.answer()  # a pushed: TransferReady(a) waits for the denoiser
    h.answer()  # b staged: the "free" standing slot is reused at once
    push_b = next(i for i, (_, m) in enumerate(h.pending) if isinstance(m, TransferPush))
    h.deliver(push_b)  # b's bytes overwrite a's
    with pytest.raises(SlotViolation, match=r"loaded 'b''s bytes as a's input"):
        h.deliver()  # TransferReady(a)


def test_a_staged_message_for_an_ended_attempt_is_answered_with_cancel_work() -> None:
    h = Harness(THREE_ROLES)
    h.submit("r")
    ((url, work),) = h.pending
    h.cancel("r")
    h.pending.clear()
    h.core.on_worker(Role.ENCODER, encode(TransferStaged(work.request_id, url, 10, [], {}, 0.1)))
    h.collect()
    assert [m.TYPE for _, m in h.pending] == ["cancel_work"]


def test_a_watched_request_s_events_name_each_hop_s_own_role_split_encoders_included() -> None:
    h = Harness({Role.PROMPT_ENCODER: 1, Role.IMAGE_ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    h.core.on_frontend(b"c", encode(Submit("r", GenerationParams(**PARAMS, image=b"\x89PNG"), watch=True)))
    h.collect()
    while h.pending or h.answers:
        h.deliver() if h.pending else h.answer()
    roles = [(m.state, m.role) for _, m in h.transport.replies if isinstance(m, RequestEvent)]
    assert ("ENCODER_RUNNING", "prompt_encoder") in roles and ("ENCODER_RUNNING", "image_encoder") in roles
    assert ("DENOISING_RUNNING", "denoiser") in roles and ("DECODER_RUNNING", "decoder") in roles
    assert all(role == "" for state, role in roles if state in ("PENDING", "DONE"))


def test_server_timing_names_each_queue_stage_and_transfer_and_its_parts_fit_in_the_total() -> None:
    h = Harness(THREE_ROLES)
    h.submit("r")
    while h.pending:
        h.clock.now += 0.1  # each message takes 100 ms to be handled, and each reply as long
        h.deliver()
        h.clock.now += 0.1
        h.answer()
    (result,) = h.endings()["r"]
    parts = parse_server_timing(result.server_timing)
    assert list(parts) == [
        "queue-encoder", "encoder",
        "queue-denoiser", "transfer-encoder-denoiser", "denoiser",
        "queue-decoder", "transfer-denoiser-decoder", "decoder", "total",
    ]  # fmt: skip
    assert parts["total"] == pytest.approx(1400.0)  # seven messages each way
    assert parts["encoder"] == pytest.approx(10.0)  # what the worker reported, not the 200 ms the head saw
    assert parts["transfer-encoder-denoiser"] == pytest.approx(400.0)  # alloc and push, each way
    assert all(ms >= 0 for ms in parts.values())
    assert sum(ms for name, ms in parts.items() if name != "total") <= parts["total"]


def test_a_result_s_device_seconds_are_each_stage_s_share_times_its_instance_s_devices() -> None:
    """What API keys' device-second quotas count (timeline.DEVICE_SECONDS): every stage reports 10 ms
    here; the denoiser runs on 4 devices."""
    h = Harness(THREE_ROLES)
    next(w for w in h.workers.values() if w.role is Role.DENOISER).devices = 4
    h.tick()  # its heartbeat says so
    h.submit("r")
    while h.pending:
        h.deliver()
        h.clock.now += 0.1  # each stage's 10 ms fits in the time the head saw pass
        h.answer()
    (result,) = h.endings()["r"]
    assert result.timings[DEVICE_SECONDS] == pytest.approx(0.01 + 0.04 + 0.01)


def test_a_stage_time_beyond_what_the_head_saw_pass_is_taken_as_that_time() -> None:
    """A worker cannot have run a hop for longer than the head has seen pass since it dispatched it:
    a report beyond that (a week, once) is cut to it before it calibrates the work estimate that
    admission refuses requests by, or counts as device-seconds against the request's API key."""
    h = Harness(THREE_ROLES)
    h.submit("r")
    h.deliver()  # the encoder's work
    h.clock.now += 0.5
    role, staged, url, head = h.answers[0]
    h.answers[0] = (role, msgspec.structs.replace(staged, seconds=7 * 24 * 3600.0), url, head)
    h.answer()
    while h.pending:
        h.deliver()
        h.clock.now += 0.1
        h.answer()
    (result,) = h.endings()["r"]
    assert result.timings["worker_encoder"] == pytest.approx(0.5)
    assert result.timings[DEVICE_SECONDS] == pytest.approx(0.5 + 0.01 + 0.01)
    assert h.core.workload.seconds_per_unit(Role.ENCODER) == pytest.approx(0.5)


def test_server_timing_parts_fit_in_the_total_when_sending_takes_time() -> None:
    """A send that takes milliseconds (the loop's thread waiting for the GIL while the API encodes a
    preview: CI's one failure, parts 4.7 ms over the total) must not make two parts overlap."""
    h = Harness(THREE_ROLES)
    send = h.transport.send

    def slow_send(url: str, msg: object) -> bool:
        h.clock.advance(0.005)
        return send(url, msg)

    h.transport.send = slow_send  # type: ignore[method-assign]
    h.submit("r")
    while h.pending:
        h.deliver()
        h.answer()
    (result,) = h.endings()["r"]
    parts = parse_server_timing(result.server_timing)
    assert "transfer-encoder-denoiser" in parts and "transfer-denoiser-decoder" in parts
    assert sum(ms for name, ms in parts.items() if name != "total") <= parts["total"] + 1e-6


def _to_denoiser(h: Harness, rid: str) -> str:
    """Walk `rid` to its denoiser's TransferReady (not yet delivered); returns that denoiser."""
    while not any(isinstance(m, TransferReady) and h.workers[u].role is Role.DENOISER for u, m in h.pending):
        h.deliver()
        h.answer()
    return next(u for u, m in h.pending if isinstance(m, TransferReady))


def test_a_handed_off_request_continues_on_another_denoiser_at_the_same_hop_then_decodes() -> None:
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1})
    h.submit("r")
    first = _to_denoiser(h, "r")
    assert h.core.hand_off("r")
    h.collect()
    assert [type(m) for u, m in h.pending] == [TransferReady, HandOff] and h.pending[1][0] == first
    h.workers[first].handing_off.add("r")  # the HandOff reached it while its loop ran
    h.pending.pop(1)
    h.deliver()
    h.answer()  # the continuation, staged by the first denoiser
    rec = h.core.requests["r"]
    assert rec.state is RequestState.DENOISING_WAITING and rec.hop == rec.route.index(Role.DENOISER)
    assert rec.staged is not None and rec.staged.continues_at == 1 and rec.staged.meta == {"resume": {"step": 1}}
    [(receiver, alloc)] = h.pending
    assert isinstance(alloc, TransferAlloc) and receiver != first, "never back to the denoiser that handed it off"
    while "r" not in h.endings():
        h.deliver()
        h.clock.advance(0.5)  # each stage takes the 0.01 s the workers report
        h.answer()
    assert [type(m) for m in h.endings()["r"]] == [RequestResult]
    assert h.core.metrics.migrations.labels("asked")._value.get() == 1
    # Neither denoiser ran the whole loop: their times calibrate nothing (the decoder's does). Before,
    # the second one's, the last steps alone, was taken for the whole request's work.
    assert not h.core.workload.calibrated(Role.DENOISER) and h.core.workload.calibrated(Role.DECODER)
    h.check_idle()


def test_a_continuation_waits_rather_than_return_to_the_denoiser_it_left() -> None:
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    h.submit("r")
    only = _to_denoiser(h, "r")
    h.workers[only].handing_off.add("r")
    h.deliver()
    h.answer()
    h.tick()
    assert h.core.requests["r"].state is RequestState.DENOISING_WAITING
    assert not h.pending  # nothing was sent: the one denoiser is the sender


def test_a_draining_denoiser_is_asked_to_hand_off_only_while_a_peer_has_room() -> None:
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1})
    h.submit("r")
    first = _to_denoiser(h, "r")
    h.deliver()  # the denoiser runs it; its output report is not read yet
    peer = next(u for u, w in h.workers.items() if w.role is Role.DENOISER and u != first)
    h.core.membership.find(peer).draining = True  # type: ignore[union-attr]
    h.core.membership.find(first).draining = True  # type: ignore[union-attr]
    from triptych_head import migration

    migration.drain_by_migration(h.core)
    assert not any(isinstance(m, HandOff) for _, m in h.transport.outbox)  # no peer ready: it finishes there
    h.core.membership.find(peer).draining = False  # type: ignore[union-attr]
    migration.drain_by_migration(h.core)
    migration.drain_by_migration(h.core)  # asked once
    assert [(u, type(m)) for u, m in h.transport.outbox if isinstance(m, HandOff)] == [(first, HandOff)]


def test_a_denoiser_that_starts_draining_is_asked_to_hand_off_at_once_and_acknowledged_once_empty() -> None:
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1})
    h.submit("r")
    first = _to_denoiser(h, "r")
    h.deliver()
    sent: list[tuple[str, object]] = []
    send = h.transport.send
    h.transport.send = lambda url, msg: sent.append((url, msg)) or send(url, msg)  # type: ignore[method-assign]
    beat = msgspec.structs.replace(h.workers[first].heartbeat(), draining=True)
    h.core.on_worker(Role.DENOISER, encode(beat))  # no tick: the draining heartbeat alone
    assert [(u, type(m)) for u, m in sent] == [(first, HandOff)]
    for _ in range(50):
        if not h.core.membership.find(first).inflight:  # type: ignore[union-attr]
            break
        if h.pending:
            h.deliver()
        if h.answers:
            h.answer()
    # The message that took its last request off it was answered by an acknowledging ping, before any tick.
    assert any(isinstance(m, Ping) and m.drain_acknowledged for u, m in sent if u == first)


def test_with_migration_off_a_draining_denoiser_finishes_its_requests_in_place() -> None:
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 1}, ("--disagg-migration", "off"))
    h.submit("r")
    first = _to_denoiser(h, "r")
    h.deliver()
    h.core.membership.find(first).draining = True  # type: ignore[union-attr]
    from triptych_head import migration

    migration.drain_by_migration(h.core)
    h.tick()
    assert not any(isinstance(m, HandOff) for _, m in h.transport.outbox)  # the peer has room, but none is asked
    assert h.core.requests["r"].instance == first


def computing_on_a_standing_slot() -> tuple[Harness, SimWorker, str, Any]:
    """Request "a" computing on the (held) denoiser, its input in the denoiser's standing slot:
    (harness, the denoiser, a's wire id, the head's instance of it)."""
    h = Harness(THREE_ROLES, hold=frozenset({Role.DENOISER}))
    denoiser = next(w for w in h.workers.values() if w.role is Role.DENOISER)
    h.submit("a")
    for _ in range(20):  # the encoder stage, the kept slot's allocation, the push, transfer_ready
        if denoiser.computing:
            break
        if h.pending:
            h.deliver()
        elif h.answers:
            h.answer()
    (wire_id,) = denoiser.computing
    inst = h.core.membership.find(denoiser.url)
    assert inst is not None and [s.holder for s in inst.standing.values()] == [wire_id]
    return h, denoiser, wire_id, inst


@pytest.mark.parametrize("inputs_held", [True, False])
def test_a_standing_slot_stays_taken_while_the_stage_uses_its_inputs_in_place(inputs_held: bool) -> None:
    """A receiver that uses its inputs in place (views on the slot) reports its steps with
    inputs_held: its standing slot goes to no other transfer before the stage's last report.
    One that copied its inputs out has given the slot back by its first report."""
    h, denoiser, wire_id, inst = computing_on_a_standing_slot()
    h.core.on_worker(Role.DENOISER, encode(Progress(wire_id, denoiser.url, 1, 4, inputs_held=inputs_held)))
    assert [s.holder for s in inst.standing.values()] == [wire_id if inputs_held else None]
    h.finish(wire_id)
    h.answer()  # its last report (transfer_staged): the slot is free either way
    assert [s.holder for s in inst.standing.values()] == [None]


def test_a_head_side_message_on_a_result_socket_is_dropped_and_changes_nothing() -> None:
    """A worker (or a key holder speaking for one) sending a message of the head's side: counted as
    dropped; it used to free the request's standing slot first (a cancel_work), or raise (a ping)."""
    h, denoiser, wire_id, inst = computing_on_a_standing_slot()
    dropped = h.core.metrics.registry.get_sample_value("triptych_dropped_messages_total") or 0.0
    h.core.on_worker(Role.DENOISER, encode(CancelWork(wire_id, denoiser.url, h.core.head_id)))
    h.core.on_worker(Role.DENOISER, encode(Ping(denoiser.url, h.core.head_id)))
    assert [s.holder for s in inst.standing.values()] == [wire_id]
    assert h.core.metrics.registry.get_sample_value("triptych_dropped_messages_total") == dropped + 2


def test_a_request_id_with_the_retry_mark_is_refused() -> None:
    """A retry's wire id is "<id>~retry<N>": a client's "a~retry1" would take over a's retry's messages."""
    h = Harness(THREE_ROLES)
    h.submit("a~retry1")
    (refused,) = h.endings()["a~retry1"]
    assert refused.status_code == 400 and "must not contain '~'" in (refused.error or "")
    assert not h.core.requests


def test_a_heartbeat_s_step_cache_modes_are_the_known_ones_once_each() -> None:
    """Each mode is a labelled series in /metrics: unknown names (a heartbeat naming thousands of new
    ones grew the head by 170 MB in 40 heartbeats and its /metrics to 22 MB) are not kept."""
    h = Harness(THREE_ROLES)
    denoiser = next(w for w in h.workers.values() if w.role is Role.DENOISER)
    modes = (*(StepCacheStats(f"x{i}", 1, 1, 1) for i in range(2000)), StepCacheStats("first_block", 1, 2, 3))
    beat = msgspec.structs.replace(denoiser.heartbeat(), step_cache=(*modes, StepCacheStats("first_block", 2, 4, 6)))
    h.core.on_worker(Role.DENOISER, encode(beat))
    h.core.tick(h.discovered())
    inst = h.core.membership.find(denoiser.url)
    assert inst is not None and inst.step_cache == (StepCacheStats("first_block", 2, 4, 6),)
    series = [m for m in h.core.metrics.registry.collect() if m.name.startswith("triptych_step_cache")]
    assert {s.labels["mode"] for m in series for s in m.samples} == {"first_block"}


def test_a_deployment_without_a_pool_that_encodes_references_serves_its_model_without_edits() -> None:
    """A FLUX.1 Kontext head with a prompt encoder and no image encoder advertised edits (/v1/models,
    the contract, the playground's upload) and refused every one."""
    from triptych.families import ModelInfo
    from triptych_head.main import served_model

    kontext = ModelInfo("kontext", "FluxKontextPipeline", "image", 4, 3.5, edits=True)
    text_only = Harness({Role.PROMPT_ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1}).core
    split = Harness({Role.PROMPT_ENCODER: 1, Role.IMAGE_ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1}).core
    combined = Harness({Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1}).core
    assert not text_only.encodes_images and split.encodes_images and combined.encodes_images
    assert not served_model(kontext, text_only.encodes_images).edits
    assert served_model(kontext, split.encodes_images) is kontext


def test_edits_wait_for_an_absent_image_encoder_without_holding_the_prompt_encoder_from_text_to_image() -> None:
    """Split encoders with the image encoder pool down (crashed, scaled to zero): edits ran on the
    prompt encoder and their staged outputs held its slots, so text-to-image requests, which never
    visit the image encoder, waited until --disagg-no-instance-wait failed the edits."""
    h = Harness({Role.PROMPT_ENCODER: 1, Role.IMAGE_ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    (image_encoder,) = [w for w in h.workers.values() if w.role is Role.IMAGE_ENCODER]
    image_encoder.alive = False
    h.clock.advance(h.args.disagg_heartbeat_timeout + 1)
    h.tick()
    for i in range(CAPACITY + 1):
        h.submit(f"edit{i}", image=b"\x89PNG")
    h.submit("t2i")
    h.core.dispatch()  # the DiffusionServer's loop turn
    h.collect()
    (prompt_encoder,) = h.core.membership.instances(Role.PROMPT_ENCODER)
    assert prompt_encoder.inflight == {"t2i"}  # the edits wait; the text-to-image request runs at once
    assert all(h.state(f"edit{i}") == RequestState.ENCODER_WAITING for i in range(CAPACITY + 1))
    while h.pending or h.answers:
        h.deliver() if h.pending else h.answer()
    (done,) = h.endings()["t2i"]
    assert isinstance(done, RequestResult)
    h.tick()  # the image encoder's wait is counted from here: the edits wait for it
    h.clock.advance(h.args.disagg_no_instance_wait + 1)
    h.tick()
    for i in range(CAPACITY + 1):
        (ended,) = h.endings()[f"edit{i}"]
        assert ended.status_code == 503 and "no image_encoder instance" in (ended.error or ""), ended
    h.check_idle()
