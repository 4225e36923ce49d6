"""Batching's rules without processes: which requests are compatible, which groups the head sends,
which queued jobs a worker runs together, the flags and the WorkBatch message."""

from __future__ import annotations

import time
from collections import deque

import msgspec
import pytest

from tests.unit.core_harness import Harness
from triptych.batching import batch_key
from triptych.cli import build_parser
from triptych.config import ConfigError, ServeArgs
from triptych.params import GenerationParams, LoraWeight
from triptych.protocol import TransferReady, Work, WorkBatch, decode, encode
from triptych.roles import Role
from triptych_head.batcher import GroupBatcher
from triptych_head.state import RequestRecord
from triptych_worker.job_groups import Job, resize_group, take_group
from triptych_worker.resume import ADAPTERS, RESUME

BASE = GenerationParams("a cat", width=64, height=48, num_inference_steps=4, guidance_scale=3.5, seed=1)


def parse(*argv: str) -> ServeArgs:
    return ServeArgs.from_namespace(build_parser().parse_args(["serve", "--model-path", "m", *argv]))


HEAD = ("--disagg-role", "server", "--encoder-urls", "tcp://127.0.0.1:1", "--denoiser-urls", "tcp://127.0.0.2:1",
        "--decoder-urls", "tcp://127.0.0.3:1")  # fmt: skip


# --- the compatibility rule -----------------------------------------------------------------


def test_prompt_negative_text_and_seed_may_differ_within_a_batch():
    negative = msgspec.structs.replace(BASE, negative_prompt="blurry")
    assert batch_key(BASE) == batch_key(msgspec.structs.replace(BASE, prompt="a dog", seed=99))
    assert batch_key(negative) == batch_key(msgspec.structs.replace(negative, negative_prompt="dark"))


@pytest.mark.parametrize(
    "change",
    [
        {"width": 48},
        {"height": 64},
        {"num_frames": 5},
        {"num_inference_steps": 3},
        {"guidance_scale": 5.0},
        {"negative_prompt": "blurry"},
        {"max_sequence_length": 256},
        {"num_outputs": 2},
        {"step_cache": "first_block"},
    ],
)
def test_what_changes_shapes_or_math_makes_requests_incompatible(change: dict):
    assert batch_key(BASE) != batch_key(msgspec.structs.replace(BASE, **change))


def test_requests_batch_only_with_the_same_step_cache_mode_and_knob():
    pab = msgspec.structs.replace(BASE, step_cache="pyramid_attention_broadcast")
    assert batch_key(pab) == batch_key(msgspec.structs.replace(pab, step_cache_interval=2))  # its default, spelt out
    assert batch_key(pab) != batch_key(msgspec.structs.replace(pab, step_cache_interval=3))
    assert batch_key(pab) != batch_key(msgspec.structs.replace(pab, step_cache="taylorseer", step_cache_interval=2))


def test_edits_are_never_batched():
    edit = msgspec.structs.replace(BASE, image=b"png")
    assert batch_key(edit, "r1") != batch_key(edit, "r2")


# --- the head's groups ----------------------------------------------------------------------


def record(rid: str, params: GenerationParams, queued_at: float) -> RequestRecord:
    rec = RequestRecord(request_id=rid, params=params, route=[Role.ENCODER], client=b"", deadline=1e18)
    rec.hop_started = queued_at
    return rec


def test_a_group_leaves_when_full_or_at_the_delay_and_never_mixes_incompatible_requests():
    batcher = GroupBatcher(max_size=4, delay_s=0.05)
    other = msgspec.structs.replace(BASE, width=48)
    fewer_steps = msgspec.structs.replace(BASE, num_inference_steps=2)
    queued = [record("a0", BASE, 10.0), record("b0", other, 10.0)]  # in queue order: as they came
    queued += [record(f"a{i}", BASE, 10.0 + i * 0.001) for i in range(1, 5)] + [record("c0", fewer_steps, 10.02)]
    groups = batcher.ready_groups(queued, room=8, now=10.01)  # before the delay: only the full group
    assert [[r.request_id for r in g] for g in groups] == [["a0", "a1", "a2", "a3"]]
    groups = batcher.ready_groups(queued, room=8, now=10.1)  # past it: every group, in queue order
    assert [[r.request_id for r in g] for g in groups] == [["a0", "a1", "a2", "a3"], ["b0"], ["a4"], ["c0"]]


def test_groups_leave_in_queue_order_so_a_higher_level_goes_before_an_older_lower_one():
    """The queue holds the higher level first (queues.py); a group of it leaves before an older group
    of another key at a lower level. Before, groups left oldest first whatever their level."""
    batcher = GroupBatcher(max_size=2, delay_s=0.0)
    high = record("high", BASE, 10.5)
    low = record("low", msgspec.structs.replace(BASE, width=32), 10.0)
    groups = batcher.ready_groups([high, low], room=2, now=11.0)
    assert [[r.request_id for r in g] for g in groups] == [["high"], ["low"]]


def test_a_role_s_own_delay_replaces_every_role_s():
    batcher = GroupBatcher(max_size=4, delay_s=0.05, role_delays_s={Role.DENOISER: 2.0, Role.ENCODER: 0.0})
    assert (batcher.delay_for(Role.DENOISER), batcher.delay_for(Role.DECODER), batcher.shortest_delay_s) == (2, 0.05, 0)
    queued = [record("a0", BASE, 10.0)]
    assert batcher.ready_groups(queued, room=4, now=10.1, delay_s=batcher.delay_for(Role.DENOISER)) == []
    assert len(batcher.ready_groups(queued, room=4, now=10.1, delay_s=batcher.delay_for(Role.DECODER))) == 1
    assert len(batcher.ready_groups(queued, room=4, now=10.0, delay_s=batcher.delay_for(Role.ENCODER))) == 1


def test_a_group_is_bounded_by_the_roomiest_instance_and_then_counts_as_full():
    batcher = GroupBatcher(max_size=4, delay_s=10.0)
    queued = [record(f"a{i}", BASE, 10.0) for i in range(3)]
    assert [len(g) for g in batcher.ready_groups(queued, room=2, now=10.0)] == [2]
    assert batcher.ready_groups(queued, room=0, now=99.0) == []


# --- the worker's groups --------------------------------------------------------------------


def job(rid: str, params: GenerationParams = BASE, group: str = "", size: int = 1, at: float = 0.0) -> Job:
    return Job(rid, params, group=group, group_size=size, queued_at=at or time.monotonic())


def test_without_batching_the_oldest_job_runs_alone():
    queue = deque([job("a"), job("b")])
    assert [j.request_id for j in take_group(queue, 1, 0.0)] == ["a"]


def test_a_dispatched_group_waits_for_its_members_until_the_cutoff():
    queue = deque([job("g1", group="g1", size=3, at=5.0), job("g2", group="g1", size=3, at=5.0)])
    assert take_group(queue, 4, assembly_cutoff=4.0) == []  # g3 is on its way
    assert [j.request_id for j in take_group(queue, 4, assembly_cutoff=6.0)] == ["g1", "g2"]  # waited long enough
    queue = deque([job(f"g{i}", group="g0", size=5) for i in range(5)])
    assert [len(take_group(queue, 4, 0.0)), len(take_group(queue, 4, 0.0))] == [4, 1]  # the worker's own bound


def test_a_later_member_s_smaller_size_runs_the_group_at_once():
    """The head counts a group's size as each member's message leaves (state.BatchTag): one that
    left after a member dropped out says fewer, and the group runs as soon as that many are here."""
    queue = deque([job("g1", group="g1", size=3, at=5.0), job("g2", group="g1", size=2, at=5.0)])
    assert [j.request_id for j in take_group(queue, 4, assembly_cutoff=4.0)] == ["g1", "g2"]


def test_a_group_the_head_resized_runs_with_the_members_it_has():
    """BatchResized: the head lost a member after g1 and g2 said a group of three; the queued members
    of that group alone, and only those of the head that says so, wait for fewer."""
    queue = deque([job("g1", group="g1", size=3, at=5.0), job("g2", group="g1", size=3, at=5.0),
                   job("h1", group="h1", size=2, at=5.0)])  # fmt: skip
    resize_group(queue, "g1", 2, owned=lambda j: False)  # another head's group of that id
    assert take_group(queue, 4, assembly_cutoff=4.0) == []  # still three
    resize_group(queue, "g1", 2, owned=lambda j: True)
    resize_group(queue, "g1", 5, owned=lambda j: True)  # never larger than a member said
    assert [j.request_id for j in take_group(queue, 4, assembly_cutoff=4.0)] == ["g1", "g2"]
    assert take_group(queue, 4, assembly_cutoff=4.0) == []  # h1's group is not touched


def test_untagged_jobs_batch_with_compatible_ones_only():
    other = msgspec.structs.replace(BASE, num_inference_steps=2)
    queue = deque([job("a"), job("b", other), job("c"), job("d", other)])
    assert [j.request_id for j in take_group(queue, 4, 0.0)] == ["a", "c"]
    assert [j.request_id for j in take_group(queue, 4, 0.0)] == ["b", "d"]


def test_an_edit_whose_reference_the_head_left_out_still_runs_in_no_batch():
    """Past the encoders the head sends an edit's params without its reference (wire_params), so they
    key like a plain request's: its TransferReady says it is an edit, and the worker batches it with
    nothing. Before, a denoiser merged it with a plain request, and the merge dropped its reference's
    tensors: the edit came back as text-to-image pixels."""
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    h.submit("e", image=b"png")
    while not any(isinstance(m, TransferReady) for _, m in h.pending):
        h.deliver() if h.pending else h.answer()
    ready = next(m for _, m in h.pending if isinstance(m, TransferReady))
    assert ready.params.image is None and ready.edit
    assert batch_key(ready.params) == batch_key(msgspec.structs.replace(ready.params, image=None))  # looks plain
    incoming = (None, [], {})
    queue = deque([Job("p", ready.params, incoming), Job("e", ready.params, incoming, edit=ready.edit),
                   Job("q", ready.params, incoming)])  # fmt: skip
    assert [j.request_id for j in take_group(queue, 4, 0.0)] == ["p", "q"]
    assert [j.request_id for j in take_group(queue, 4, 0.0)] == ["e"]


def test_continuations_whose_earlier_steps_used_other_adapter_files_run_apart():
    """A merged batch runs on with its first member's adapter files: continuations of one step, some
    suspended before the catalogue pointed `style` at another file and some after, never share one."""
    styled = msgspec.structs.replace(BASE, loras=(LoraWeight("style", 1.0),))

    def continuation(rid: str, source: str) -> Job:
        return Job(rid, styled, (None, [], {RESUME: {"step": 2, ADAPTERS: {"style": source}}}))

    queue = deque([continuation("a", "/ink"), continuation("b", "/paper"), continuation("c", "/ink")])
    assert [j.request_id for j in take_group(queue, 4, 0.0)] == ["a", "c"]
    assert [j.request_id for j in take_group(queue, 4, 0.0)] == ["b"]


def test_a_wrongly_grouped_member_runs_apart():
    other = msgspec.structs.replace(BASE, width=48)
    queue = deque([job("a", group="g", size=2, at=1.0), job("b", other, group="g", size=2, at=1.0)])
    assert [j.request_id for j in take_group(queue, 4, assembly_cutoff=2.0)] == ["a"]
    assert [j.request_id for j in take_group(queue, 4, assembly_cutoff=2.0)] == ["b"]


# --- flags and messages ---------------------------------------------------------------------


def test_batching_flags_parse_for_the_head_and_the_worker():
    head = parse(*HEAD, "--batching-mode", "dynamic", "--batching-max-size", "28", "--batching-delay-ms", "30",
                 "--enable-batching-metrics")  # fmt: skip
    assert (head.batching_mode, head.batching_max_size, head.batching_delay_ms) == ("dynamic", 28, 30.0)
    assert head.enable_batching_metrics
    roles = parse(*HEAD, "--batching-mode", "dynamic", "--batching-role-delay-ms", " encoder=5, denoiser=80.5,")
    assert roles.role_batching_delays_ms() == {Role.ENCODER: 5.0, Role.DENOISER: 80.5}
    assert parse(*HEAD).role_batching_delays_ms() == {}
    worker = parse("--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--batching-max-size", "4")
    ranks = parse("--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--batching-max-size", "4",
                  "--num-gpus", "2")  # fmt: skip
    assert ranks.batching_max_size == 4  # a multi-device worker batches on every rank (parallel/ranks.py)
    assert worker.batching_max_size == 4 and worker.batching_mode == "off"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((*HEAD, "--batching-max-size", "0"), "--batching-max-size 0 must be >= 1"),
        ((*HEAD, "--batching-delay-ms", "-1"), "--batching-delay-ms -1.0 must be >= 0"),
        ((*HEAD, "--batching-delay-ms", "nan"), "--batching-delay-ms nan must be a finite number"),
        (("--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--batching-mode", "dynamic"),
         "--batching-mode is for the head"),
        (("--batching-max-size", "4"), "monolithic mode runs one request at a time"),
        ((*HEAD, "--batching-max-size", "4"),
         "--batching-max-size 4 on --disagg-role server does nothing without --batching-mode dynamic"),
        ((*HEAD, "--batching-mode", "off", "--batching-max-size", "2"), "add --batching-mode dynamic, or drop it"),
        ((*HEAD, "--batching-delay-ms", "50"),
         "--batching-delay-ms on --disagg-role server does nothing without --batching-mode dynamic"),
        ((*HEAD, "--batching-mode", "dynamic", "--batching-role-delay-ms", "vae=5"),
         r"--batching-role-delay-ms 'vae=5': 'vae=5' is not ROLE=MS with ROLE one of encoder, prompt_encoder, "
         "image_encoder, denoiser, decoder"),
        ((*HEAD, "--batching-mode", "dynamic", "--batching-role-delay-ms", "encoder"), "'encoder' is not ROLE=MS"),
        ((*HEAD, "--batching-mode", "dynamic", "--batching-role-delay-ms", "encoder=-1"),
         r"encoder='-1' must be a number of milliseconds >= 0"),
        ((*HEAD, "--batching-mode", "dynamic", "--batching-role-delay-ms", "decoder=soon"),
         r"decoder='soon' must be a number of milliseconds >= 0"),
        ((*HEAD, "--batching-mode", "dynamic", "--batching-role-delay-ms", "decoder=1,decoder=2"),
         "decoder is given twice"),
        ((*HEAD, "--batching-role-delay-ms", "decoder=5"),
         "--batching-role-delay-ms on --disagg-role server does nothing without --batching-mode dynamic"),
        (("--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--batching-role-delay-ms", "denoiser=5"),
         "--batching-role-delay-ms is for the head"),
        ((*HEAD, "--enable-batching-metrics"),
         "--enable-batching-metrics on --disagg-role server does nothing without --batching-mode dynamic"),
    ],
)  # fmt: skip
def test_bad_batching_flags_are_refused_naming_the_flag(argv: tuple[str, ...], message: str):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def test_the_heads_group_size_is_taken_with_dynamic_batching_and_a_workers_without():
    """The head groups requests only in dynamic mode, so its --batching-max-size needs it; a worker's
    is its batched forward's size, whatever the head's mode."""
    assert parse(*HEAD, "--batching-mode", "dynamic", "--batching-max-size", "4").batching_max_size == 4
    assert parse(*HEAD, "--batching-max-size", "1").batching_max_size == 1  # one per group: nothing to ignore
    worker = ("--disagg-role", "decoder", "--disagg-server-addr", "tcp://h:1", "--batching-max-size", "4")
    assert parse(*worker).batching_max_size == 4


def test_an_unknown_batching_mode_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        parse(*HEAD, "--batching-mode", "static")
    assert "--batching-mode: invalid choice: 'static'" in capsys.readouterr().err


def test_a_work_batch_and_a_tagged_transfer_ready_round_trip():
    items = [Work(f"r{i}", "tcp://w:1", msgspec.structs.replace(BASE, seed=i), progress=i == 0) for i in range(3)]
    msg, _ = decode(encode(WorkBatch("tcp://w:1", items)))
    assert isinstance(msg, WorkBatch) and msg.items == items
    ready = TransferReady("r1", "tcp://w:1", BASE, [], {}, batch_id="r0", batch_size=3)
    assert decode(encode(ready))[0] == ready
    old = TransferReady("r1", "tcp://w:1", BASE, [], {})  # a sender of the previous version: not in a group
    assert decode(encode(old))[0].batch_size == 1
