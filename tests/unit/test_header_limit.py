"""A control message over the header limit (codec.MAX_HEADER_BYTES, which every receiver refuses to
decode) is never sent: the head fails the one request it belongs to at once, naming what was too
large and by how much, releases what the request held, and serves the next request as usual.

Before, the head sent it anyway; the worker dropped it unread (it cannot even learn the request id
from a header it refuses), and the request waited for its whole --disagg-timeout.

Scripted workers over real ZMQ sockets (tests/unit/scripted.py): a scripted worker records a message
it cannot decode, as a real worker drops one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import msgspec
import pytest
import zmq

from tests.unit.scripted import PARAMS, SESSION, ScriptedWorker, finish_request, forgotten, scripted_head
from triptych.protocol import (
    CancelWork,
    Failed,
    HeaderTooLarge,
    ProtocolError,
    RequestEvent,
    RequestResult,
    Submit,
    TransferAlloc,
    TransferAllocated,
    TransferPush,
    TransferPushed,
    TransferStaged,
    Work,
    WorkBatch,
    decode,
    encode,
)
from triptych.protocol.codec import MAX_HEADER_BYTES
from triptych.roles import Role
from triptych_head.server import DiffusionServer

TIMEOUT_S = 60  # --disagg-timeout: a request that waits for it fails these tests long before
MANIFEST = [{"name": "x", "dtype": "uint8", "shape": [8], "offset": 0}]


@pytest.fixture
def head():
    with scripted_head(flags=["--disagg-timeout", str(TIMEOUT_S)]) as (server, client, workers):
        yield server, client, {role: ws[0] for role, ws in workers.items()}


def answer(client: zmq.Socket, rid: str, workers: Sequence[ScriptedWorker], seconds: float = 10.0) -> object:
    """The message that ends `rid` for its client (a RequestResult or a final RequestEvent); the
    workers answer pings meanwhile. Fails the test after `seconds`, well before --disagg-timeout."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if client.poll(20):
            msg, _ = decode(client.recv_multipart())
            if msg.request_id == rid and (isinstance(msg, RequestResult) or msg.state in ("FAILED", "TIMED_OUT")):
                return msg
        for w in workers:
            w.pump(0.01)
    raise AssertionError(f"{rid} had no answer within {seconds:g}s (its timeout is {TIMEOUT_S}s)")


def test_a_transfer_ready_over_the_limit_fails_its_request_at_once_and_the_next_request_runs(head):
    """The encoder's outputs carry a meta of nearly the whole limit: its transfer_staged fits, the
    transfer_ready the head builds from it (the request's parameters added) does not."""
    server, client, w = head
    enc, den, dec = w[Role.ENCODER], w[Role.DENOISER], w[Role.DECODER]
    everyone = list(w.values())
    client.send_multipart(encode(Submit("big", PARAMS)))
    work = enc.wait_for(Work)
    enc.got.clear()
    meta = {"blob": "m" * (MAX_HEADER_BYTES - 300)}
    staged = TransferStaged("big", work.instance, 8, MANIFEST, meta, 0.0)
    assert len(encode(staged)[0]) <= MAX_HEADER_BYTES  # the head can read it
    enc.send(staged)
    alloc = den.wait_for(TransferAlloc)
    den.got.clear()
    den.send(TransferAllocated("big", alloc.instance, SESSION, 4096))
    push = enc.wait_for(TransferPush)
    enc.got.clear()
    started = time.monotonic()
    enc.send(TransferPushed("big", push.instance, 8, 0.01))

    failed = answer(client, "big", everyone)
    took = time.monotonic() - started
    assert isinstance(failed, RequestEvent) and failed.state == "FAILED" and failed.status_code == 500
    error = failed.error or ""
    assert error.startswith("transfer_ready for request big is "), error
    size = int(error.removeprefix("transfer_ready for request big is ").split()[0])
    assert size > MAX_HEADER_BYTES
    assert f"over the {MAX_HEADER_BYTES}-byte ({MAX_HEADER_BYTES >> 20} MiB) control header limit" in error
    assert (
        "the encoder's outputs manifest/meta is too large" in error
        and f"meta {len(msgspec.msgpack.encode(meta))} bytes" in error
    )
    assert took < 5, f"the failure took {took:.1f}s"
    # Never sent; the receiver's slot is released as for any failed request.
    assert den.wait_for(CancelWork).request_id == "big"
    assert den.unreadable == []
    assert forgotten(server, "big")
    den.got.clear()

    client.send_multipart(encode(Submit("next", PARAMS)))
    assert enc.wait_for(Work, others=[den, dec]).request_id == "next"
    enc.got.clear()
    finish_request(w, "next")
    assert isinstance(answer(client, "next", everyone), RequestResult)
    assert forgotten(server, "next") and not server.requests


def test_work_over_the_limit_fails_its_request_at_once_as_too_large_and_the_next_request_runs(head):
    """A prompt that fits the client's submit (the head reads it) but not the Work the head builds
    from it (its own fields added): 413, the parameters named."""
    server, client, w = head
    enc = w[Role.ENCODER]
    everyone = list(w.values())
    base = len(encode(Submit("big", {**PARAMS, "prompt": ""}))[0])
    submit = Submit("big", {**PARAMS, "prompt": "p" * (MAX_HEADER_BYTES - base - 8)})  # type: ignore[arg-type]
    assert len(encode(submit)[0]) <= MAX_HEADER_BYTES
    started = time.monotonic()
    client.send_multipart(encode(submit))

    failed = answer(client, "big", everyone)
    assert time.monotonic() - started < 5
    assert isinstance(failed, RequestEvent) and failed.state == "FAILED" and failed.status_code == 413
    error = failed.error or ""
    assert (
        error.startswith("work for request big is ")
        and f"over the {MAX_HEADER_BYTES}-byte ({MAX_HEADER_BYTES >> 20} MiB) control header limit" in error
    )
    assert "the request's parameters are too large" in error
    assert enc.unreadable == [] and not any(isinstance(m, Work) for m in enc.got)
    assert forgotten(server, "big")

    client.send_multipart(encode(Submit("next", PARAMS)))
    assert enc.wait_for(Work).request_id == "next"
    enc.got.clear()
    finish_request(w, "next")
    assert isinstance(answer(client, "next", everyone), RequestResult)


@contextmanager
def group_of_two(
    prompts: tuple[str, str], flags: Sequence[str] = ()
) -> Iterator[tuple[DiffusionServer, zmq.Socket, dict[Role, ScriptedWorker]]]:
    """--batching-mode dynamic, groups of 2: requests a and b, with these prompts (compatible, so
    one group for the encoder), submitted."""
    flags = ["--disagg-timeout", str(TIMEOUT_S), "--batching-mode", "dynamic", "--batching-max-size", "2",
             "--batching-delay-ms", "2000", *flags]  # fmt: skip
    with scripted_head(flags=flags) as (server, client, workers):
        w = {role: ws[0] for role, ws in workers.items()}
        enc = w[Role.ENCODER]
        enc.max_batch = 2
        enc.send(enc.heartbeat(enc.pings[-1].instance))
        deadline = time.monotonic() + 5
        while server.registry.instances(Role.ENCODER)[0].max_batch != 2:
            assert time.monotonic() < deadline, "the encoder's batch size never reached the head"
            enc.pump(0.02)
        for rid, prompt in zip(("a", "b"), prompts, strict=True):
            client.send_multipart(encode(Submit(rid, {**PARAMS, "prompt": prompt})))  # type: ignore[arg-type]
        yield server, client, w


def work_got(enc: ScriptedWorker, count: int) -> list[Work | WorkBatch]:
    """The first `count` Work or WorkBatch messages the encoder gets."""
    deadline = time.monotonic() + 5
    while len(got := [m for m in enc.got if isinstance(m, (Work, WorkBatch))]) < count:
        assert time.monotonic() < deadline, f"the encoder got {enc.got}, unreadable {enc.unreadable}"
        enc.pump(0.05)
    return got


FITS_ALONE = "p" * (MAX_HEADER_BYTES * 6 // 10)  # one fits in a Work, two do not


def test_a_group_over_the_limit_together_goes_as_one_work_each_and_both_run():
    """--batching-mode dynamic: two requests that fit a Work each but not one WorkBatch together
    run apart, neither failed nor left waiting."""
    with group_of_two((FITS_ALONE, FITS_ALONE)) as (_, client, w):
        enc = w[Role.ENCODER]
        work_got(enc, 2)
        assert enc.unreadable == []
        assert sorted(m.request_id for m in enc.got if isinstance(m, Work)) == ["a", "b"]
        enc.got.clear()
        for rid in ("a", "b"):
            finish_request(w, rid)
            assert isinstance(answer(client, rid, list(w.values())), RequestResult)


def batch_sizes(server: DiffusionServer, role: Role, count: float) -> tuple[float | None, ...]:
    """The head's batching histograms for `role` once `count` groups are in them (the loop observes
    a group just after sending it): the groups, their requests, fill ratios, waits and seconds waited."""
    sample = server.metrics.registry.get_sample_value
    labels = {"role": role.value}
    deadline = time.monotonic() + 5
    while sample("triptych_batch_size_count", labels) != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return (
        sample("triptych_batch_size_count", labels),
        sample("triptych_batch_size_sum", labels),
        sample("triptych_batch_fill_ratio_sum", labels),
        sample("triptych_batch_wait_seconds_count", labels),
        sample("triptych_batch_wait_seconds_sum", labels),
    )


def test_a_group_that_went_apart_counts_as_groups_of_one_in_the_batching_metrics():
    """What the head sent, not the group it formed: two Work messages are two groups of one, each
    half full, each having waited since its own request was queued (not 0: its dispatch restarts
    the hop's clock). Before, one group of two, its wait always 0."""
    with group_of_two((FITS_ALONE, FITS_ALONE), ["--enable-batching-metrics"]) as (server, _, w):
        assert [type(m) for m in work_got(w[Role.ENCODER], 2)] == [Work, Work]
        groups, requests, fill, waits, waited = batch_sizes(server, Role.ENCODER, 2)
        assert (groups, requests, fill, waits) == (2, 2, 1.0, 2)
        assert waited is not None and waited > 0


def test_a_member_that_fails_alone_after_its_group_went_apart_is_counted_in_no_group():
    """b's own Work is over the limit too: it fails (413) and a is the one group of one sent."""
    base = len(encode(Submit("b", {**PARAMS, "prompt": ""}))[0])  # type: ignore[arg-type]
    too_large = "p" * (MAX_HEADER_BYTES - base - 8)  # b's submit fits, its Work does not
    with group_of_two((FITS_ALONE, too_large), ["--enable-batching-metrics"]) as (server, client, w):
        failed = answer(client, "b", list(w.values()))
        assert isinstance(failed, RequestEvent) and failed.status_code == 413
        assert [m.request_id for m in work_got(w[Role.ENCODER], 1)] == ["a"]
        groups, requests, fill, waits, _ = batch_sizes(server, Role.ENCODER, 1)
        assert (groups, requests, fill, waits) == (1, 1, 0.5, 1)


def test_an_answer_to_the_client_over_the_limit_is_replaced_by_a_failure_it_can_read(head):
    """A worker's error text of nearly the whole limit: the head's failure event (the worker named
    before it) would be over it, so the client hears a short failure instead of one it cannot decode."""
    server, client, w = head
    enc = w[Role.ENCODER]
    client.send_multipart(encode(Submit("r", PARAMS)))
    work = enc.wait_for(Work)
    room = (
        MAX_HEADER_BYTES - len(encode(Failed("r", work.instance, ""))[0]) - 4
    )  # a longer string's length takes 4 more
    enc.send(Failed("r", work.instance, "e" * room))  # the longest error that fits
    failed = answer(client, "r", list(w.values()))
    assert isinstance(failed, RequestEvent) and failed.state == "FAILED" and failed.status_code == 500
    assert (failed.error or "").startswith("event for request r is ")
    assert "control header limit" in (failed.error or "")
    assert forgotten(server, "r")


def test_encode_refuses_exactly_the_headers_decode_would_refuse():
    """The longest header that decodes encodes; one byte more raises HeaderTooLarge (a ProtocolError)
    naming the message, its request, its size and the limit, and nothing is built."""
    room = MAX_HEADER_BYTES - len(encode(Failed("r", "w", ""))[0]) - 4  # a long string: 4 more bytes
    longest = encode(Failed("r", "w", "e" * room))
    assert len(longest[0]) == MAX_HEADER_BYTES
    assert decode(longest)[0].error == "e" * room
    with pytest.raises(HeaderTooLarge) as refused:
        encode(Failed("r", "w", "e" * (room + 1)))
    assert isinstance(refused.value, ProtocolError)
    assert (refused.value.message_type, refused.value.nbytes, refused.value.request_id) == (
        "failed",
        MAX_HEADER_BYTES + 1,
        "r",
    )
    assert str(refused.value) == (
        f"failed for request r is {MAX_HEADER_BYTES + 1} bytes, over the {MAX_HEADER_BYTES}-byte "
        f"({MAX_HEADER_BYTES >> 20} MiB) control header limit"
    )


def test_a_reference_of_the_largest_size_allowed_passes_every_hop_of_the_split_route() -> None:
    """An upload over 1 MiB (an ordinary photo) failed 413 once the prompt encoder had run: the image
    encoder's TransferReady, the reference inlined, was over the old 1 MiB header limit."""
    from tests.unit.core_harness import PARAMS as CORE_PARAMS
    from tests.unit.core_harness import Harness
    from triptych.params import GenerationParams
    from triptych.reference import MAX_REFERENCE_BYTES

    h = Harness({Role.PROMPT_ENCODER: 1, Role.IMAGE_ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    sent: list[str] = []

    def encoding(send):  # type: ignore[no-untyped-def]
        def encoded(url: str, msg: object) -> bool:  # as the ZMQ transport does: HeaderTooLarge past the limit
            encode(msg)  # type: ignore[arg-type]
            sent.append(type(msg).__name__)
            return bool(send(url, msg))

        return encoded

    for transport in h.transports:
        transport.send = encoding(transport.send)  # type: ignore[method-assign]
    image = b"\x89PNG" + bytes(MAX_REFERENCE_BYTES - 4)
    h.core.on_client(b"client", Submit("edit", GenerationParams(**CORE_PARAMS, image=image), watch=True))
    h.collect()
    while h.pending or h.answers:
        h.deliver() if h.pending else h.answer()
    states = [m.state for _, m in h.transport.replies if isinstance(m, RequestEvent)]
    assert "FAILED" not in states and any(isinstance(m, RequestResult) for _, m in h.transport.replies), states
    assert "TransferReady" in sent and "Work" in sent
    h.check_idle()
