"""ProgressFeed and its subscribers: offering never waits, a slow subscriber loses its oldest
messages (and is told how many), never the last one."""

from __future__ import annotations

import asyncio
import json

from triptych.protocol import RequestEvent
from triptych_head.api.progress import (
    MAX_PREVIEWS,
    QUEUE_LIMIT,
    ProgressFeed,
    SSEMessage,
    Subscriber,
    message_of,
    role_of,
)


def parse(chunks: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for chunk in chunks:
        head, data = chunk.decode().strip().split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


async def read_all(feed: ProgressFeed, sub) -> list[tuple[str, dict]]:
    return parse([chunk async for chunk in sub.messages(feed.request_id)])


def test_a_subscriber_that_never_reads_keeps_the_newest_messages_and_learns_how_many_it_lost():
    async def run() -> list[tuple[str, dict]]:
        feed = ProgressFeed("r1")
        sub = feed.subscribe()
        for step in range(1, 101):
            feed.on_event(RequestEvent("r1", "DENOISING_RUNNING", step=step, total_steps=100, role="denoiser"))
        feed.publish(SSEMessage("completed", {"id": "r1"}))
        return await read_all(feed, sub)

    got = asyncio.run(run())
    assert got[0] == ("dropped", {"id": "r1", "dropped": 101 - QUEUE_LIMIT})
    steps = [d["step"] for e, d in got if e == "step"]
    assert steps == list(range(102 - QUEUE_LIMIT, 101))  # the newest, in order
    assert got[-1] == ("completed", {"id": "r1"})


def test_a_late_subscriber_gets_what_it_missed_even_just_after_the_end_and_a_later_one_only_the_end():
    async def run() -> tuple[list, list, list]:
        feed = ProgressFeed("r2", linger_s=0.2)  # a video job's feed (HISTORY_LINGER_S)
        feed.on_event(RequestEvent("r2", "ENCODER_RUNNING", role="encoder"))
        late = feed.subscribe()
        feed.on_event(RequestEvent("r2", "DENOISING_RUNNING", 1, 2, preview=b"\x89PNG", role="denoiser"))
        feed.publish(SSEMessage("error", {"id": "r2", "error": {"message": "boom"}}))
        just_after = feed.subscribe()  # a fast job's client asking for its events right after the POST
        await asyncio.sleep(0.4)
        later = feed.subscribe()
        return await read_all(feed, late), await read_all(feed, just_after), await read_all(feed, later)

    late, just_after, later = asyncio.run(run())
    assert [e for e, _ in late] == ["state", "step", "error"]
    assert late[0][1] == {"id": "r2", "state": "ENCODER_RUNNING", "role": "encoder"}
    assert late[1][1]["preview"] == "iVBORw=="  # base64 of the PNG bytes
    assert just_after == late
    assert [e for e, _ in later] == ["error"]


def test_a_subscriber_joining_after_the_last_preview_sees_it_then_the_latest_state():
    async def run() -> list:
        feed = ProgressFeed("r3")
        feed.on_event(RequestEvent("r3", "DENOISING_RUNNING", 2, 2, preview=b"\x89PNG", role="denoiser"))
        feed.on_event(RequestEvent("r3", "DECODER_RUNNING", role="decoder"))
        late = feed.subscribe()
        feed.publish(SSEMessage("completed", {"id": "r3"}))
        return await read_all(feed, late)

    got = asyncio.run(run())
    assert [e for e, _ in got] == ["step", "state", "completed"]
    assert got[0][1]["preview"] == "iVBORw==" and got[1][1]["role"] == "decoder"


def test_a_late_subscriber_gets_the_newest_history_and_how_much_it_missed():
    async def run() -> list:
        feed = ProgressFeed("r4")
        feed.on_event(RequestEvent("r4", "ENCODER_RUNNING", role="encoder"))
        for step in range(1, 101):
            feed.on_event(RequestEvent("r4", "DENOISING_RUNNING", step=step, total_steps=100, role="denoiser"))
        late = feed.subscribe()
        feed.publish(SSEMessage("completed", {"id": "r4"}))
        return await read_all(feed, late)

    got = asyncio.run(run())
    # As for one subscribed from the start that never read: 102 messages, the newest 64 kept.
    assert got[0] == ("dropped", {"id": "r4", "dropped": 102 - QUEUE_LIMIT})
    assert [d["step"] for e, d in got if e == "step"] == list(range(102 - QUEUE_LIMIT, 101))
    assert got[-1] == ("completed", {"id": "r4"})


def test_events_name_the_role_the_head_says_a_request_is_at():
    events = [
        ("PENDING", ""),
        ("ENCODER_WAITING", "prompt_encoder"),
        ("ENCODER_RUNNING", "image_encoder"),
        ("DONE", ""),
    ]
    assert [role_of(RequestEvent("r", s, role=r)) for s, r in events] == [None, "prompt_encoder", "image_encoder", None]
    assert message_of("r", RequestEvent("r", "DENOISING_RUNNING", step=3, total_steps=8)).event == "step"


def test_a_suspension_and_a_resumption_are_events_of_their_own_with_the_state_and_role():
    suspended = RequestEvent("r", "DENOISING_WAITING", role="denoiser", preemption="suspended")
    resumed = RequestEvent("r", "DENOISING_RUNNING", role="denoiser", preemption="resumed")
    assert (message_of("r", suspended).event, message_of("r", suspended).data) == (
        "suspended", {"id": "r", "state": "DENOISING_WAITING", "role": "denoiser"},
    )  # fmt: skip
    assert message_of("r", resumed).event == "resumed"


def test_a_subscriber_holds_at_most_its_byte_bound_of_previews_but_always_the_newest_message():
    async def run() -> list[tuple[str, dict]]:
        feed = ProgressFeed("r3")
        sub = Subscriber(limit=1000, max_bytes=10_000)
        feed.subscribers.add(sub)
        for step in range(1, 11):  # ~4 KB each as base64
            feed.on_event(RequestEvent("r3", "DENOISING_RUNNING", step=step, total_steps=10, preview=bytes(3000)))
        feed.publish(SSEMessage("completed", {"id": "r3", "big": "x" * 20_000}))  # alone over the bound
        return await read_all(feed, sub)

    got = asyncio.run(run())
    assert got == [("dropped", {"id": "r3", "dropped": 10}), ("completed", {"id": "r3", "big": "x" * 20_000})]


def test_an_image_stream_s_history_goes_with_its_end():
    async def run() -> list:
        feed = ProgressFeed("r9")  # an image stream: its POST is its only subscriber
        feed.on_event(RequestEvent("r9", "DENOISING_RUNNING", 1, 1, preview=b"\x89PNG", role="denoiser"))
        feed.publish(SSEMessage("completed", {"id": "r9"}))
        return await read_all(feed, feed.subscribe())

    assert [e for e, _ in asyncio.run(run())] == ["completed"]


def preview_steps(got: list[tuple[str, dict]]) -> list[int]:
    return [d["step"] for e, d in got if e == "step" and "preview" in d]


def test_a_subscriber_that_never_reads_holds_only_the_newest_previews_and_still_gets_the_end():
    """Previews have a bound of their own: a queued step whose preview newer ones replaced keeps its
    step but loses its image. Under the queue's byte bound alone a stalled client held ~30 of these
    (4 MiB); now MAX_PREVIEWS."""

    async def run() -> tuple[list, list, Subscriber]:
        feed = ProgressFeed("r5", linger_s=0.2)
        sub = feed.subscribe()
        for step in range(1, 201):  # ~133 KB each as base64
            feed.on_event(RequestEvent("r5", "DENOISING_RUNNING", step, 200, preview=bytes(100_000), role="denoiser"))
            assert sub.queued_bytes < (MAX_PREVIEWS + 1) * 140_000 and sub.queued <= QUEUE_LIMIT
        late = feed.subscribe()
        feed.publish(SSEMessage("completed", {"id": "r5"}))
        return await read_all(feed, sub), await read_all(feed, late), sub

    got, late, sub = asyncio.run(run())
    assert got[0] == ("dropped", {"id": "r5", "dropped": 201 - QUEUE_LIMIT})  # the steps the queue's bound lost
    assert [d["step"] for e, d in got if e == "step"] == list(range(202 - QUEUE_LIMIT, 201))
    assert preview_steps(got) == list(range(201 - MAX_PREVIEWS, 201))  # only the newest images
    newest = preview_steps(late)  # the history's: its 1 MiB holds fewer of these
    assert 0 < len(newest) <= MAX_PREVIEWS and newest == list(range(201 - len(newest), 201))
    assert got[-1] == late[-1] == ("completed", {"id": "r5"})
    assert sub.previews_dropped == 200 - MAX_PREVIEWS  # each replaced while queued


def test_a_slow_reader_gets_every_step_the_newest_previews_and_the_end():
    """A reader slower than the previews arrive: its queue never holds more than MAX_PREVIEWS previews,
    it sees every step in order (none lost: it falls under 64 behind), and the result arrives."""

    async def run() -> tuple[list, int]:
        feed = ProgressFeed("r6")
        sub = feed.subscribe()
        most = 0

        async def produce() -> None:
            nonlocal most
            for step in range(1, 61):
                feed.on_event(RequestEvent("r6", "DENOISING_RUNNING", step, 60, preview=bytes(50_000), role="denoiser"))
                most = max(most, sub.queued_bytes)
                await asyncio.sleep(0)  # the loop turns: the reader may take one message
            feed.publish(SSEMessage("completed", {"id": "r6"}))

        async def consume() -> list[bytes]:
            out = []
            async for chunk in sub.messages("r6"):
                out.append(chunk)
                for _ in range(3):  # slower than the producer: three turns of the loop per message
                    await asyncio.sleep(0)
            return out

        _, chunks = await asyncio.gather(produce(), consume())
        return parse(chunks), most

    got, most = asyncio.run(run())
    assert [d["step"] for e, d in got if e == "step"] == list(range(1, 61))
    assert len(preview_steps(got)) < 60 and preview_steps(got)[-MAX_PREVIEWS:] == list(range(61 - MAX_PREVIEWS, 61))
    assert most < (MAX_PREVIEWS + 1) * 70_000, most  # previews (~67 KB as base64), the steps' few hundred bytes each
    assert got[-1] == ("completed", {"id": "r6"})


def test_a_late_subscriber_gets_every_preview_of_a_short_run_from_the_history():
    """A video's events asked for after its POST: a short job's previews are all in the history (up to
    MAX_PREVIEWS of them), not only the newest, as docs/progress.md promises."""

    async def run() -> list:
        feed = ProgressFeed("r7", linger_s=0.2)
        for step in range(1, 7):
            preview = b"\x89PNG" if step % 2 == 0 else b""
            feed.on_event(RequestEvent("r7", "DENOISING_RUNNING", step, 6, preview=preview, role="denoiser"))
        late = feed.subscribe()
        feed.publish(SSEMessage("completed", {"id": "r7"}))
        return await read_all(feed, late)

    assert preview_steps(asyncio.run(run())) == [2, 4, 6]
