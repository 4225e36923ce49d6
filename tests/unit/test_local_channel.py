"""The head's own API reaches its DiffusionServer through the in-process channel (local_channel.py).

The channel's wake-up and order, then the API's client (backend.LocalClient) against a real
DiffusionServer whose workers are scripted over real ZMQ sockets (scripted.py): a request's pixels,
a refusal, and a client that goes away, all without the frontend socket.
"""

from __future__ import annotations

import asyncio
import select
import threading
import time

import numpy as np
import pytest
import zmq

from tests.unit.scripted import PARAMS, finish_request, forgotten, scripted_head
from triptych.params import GenerationParams
from triptych.protocol import CancelWork, RequestEvent, Submit, Work, encode, tensors_to_frames
from triptych.roles import Role
from triptych_head.backend import GenerationFailed, LocalClient
from triptych_head.local_channel import LOCAL_CLIENT, ChannelClosed, LocalChannel


async def started(client: LocalClient) -> LocalClient:
    await client.start()  # connects it to its loop, as the HTTP server's startup does
    return client


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_the_channel_wakes_its_reader_keeps_order_and_never_loses_a_wake_up() -> None:
    channel = LocalChannel()
    try:
        assert not _readable(channel.fd)
        for i in range(5):
            channel.put(i)
        assert _readable(channel.fd)
        assert channel.take(3) == [0, 1, 2]
        assert _readable(channel.fd), "two messages are left: the reader must be woken for them"
        assert channel.take(3) == [3, 4]
        assert not _readable(channel.fd)
        channel.put(5)  # after a take: wakes the next poll
        assert _readable(channel.fd) and channel.take(10) == [5]
    finally:
        channel.close()


def test_puts_from_many_threads_all_arrive() -> None:
    channel = LocalChannel()
    try:
        threads = [threading.Thread(target=lambda t=t: [channel.put((t, i)) for i in range(500)]) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = channel.take(10_000)
        assert sorted(got) == sorted((t, i) for t in range(4) for i in range(500))
        for t in range(4):  # each thread's own messages in the order it put them
            assert [i for who, i in got if who == t] == list(range(500))
    finally:
        channel.close()


def test_an_answer_without_a_connected_api_is_dropped() -> None:
    channel = LocalChannel()
    try:
        channel.reply(RequestEvent("r", "FAILED", error="x"))  # nobody to tell: no error
        heard: list[object] = []
        channel.connect(lambda msg, frames: heard.append(msg))
        channel.reply(RequestEvent("r", "FAILED", error="x"))
        assert len(heard) == 1
    finally:
        channel.close()


def test_the_apis_request_gets_its_pixels_from_the_decoder_through_the_channel() -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (1, 1, 16, 16, 3), dtype=np.uint8)
    with scripted_head() as (server, frontend, workers):
        w = {role: ws[0] for role, ws in workers.items()}

        async def main() -> np.ndarray:
            client = await started(LocalClient(server.local))
            generation = asyncio.ensure_future(client.generate("r", GenerationParams(**PARAMS)))
            await asyncio.to_thread(w[Role.ENCODER].wait_for, Work)
            await asyncio.to_thread(finish_request, w, "r", tensors_to_frames({"pixels": pixels}))
            out = await asyncio.wait_for(generation, 10)
            await client.close()
            assert out.server_timing and "total" in out.server_timing
            return out.pixels

        np.testing.assert_array_equal(asyncio.run(main()), pixels)
        assert not frontend.poll(100), "the frontend socket's client heard of a request that was not its own"
        assert forgotten(server, "r")


def test_a_refusal_reaches_the_api_as_its_status() -> None:
    with scripted_head() as (server, _, workers):
        encoder = workers[Role.ENCODER][0]

        async def main() -> None:
            client = await started(LocalClient(server.local))
            # A request held on the encoder keeps the drain going: with nothing held the loop may
            # end first, and the late request then meets a stopped server (also a 503, other words).
            held = asyncio.ensure_future(client.generate("held", GenerationParams(**PARAMS)))
            await asyncio.to_thread(encoder.wait_for, Work)
            server.drain(30)
            with pytest.raises(GenerationFailed) as refused:
                await asyncio.wait_for(client.generate("late", GenerationParams(**PARAMS)), 10)
            assert refused.value.status_code == 503 and "shutting down" in str(refused.value)
            held.cancel()

        asyncio.run(main())


def test_an_api_request_whose_client_went_away_is_cancelled_on_the_workers() -> None:
    with scripted_head() as (server, _, workers):
        encoder = workers[Role.ENCODER][0]

        async def main() -> None:
            client = await started(LocalClient(server.local))
            generation = asyncio.ensure_future(client.generate("gone", GenerationParams(**PARAMS)))
            await asyncio.to_thread(encoder.wait_for, Work)
            generation.cancel()  # what the HTTP handler does when its client disconnects
            with pytest.raises(asyncio.CancelledError):
                await generation

        asyncio.run(main())
        assert encoder.wait_for(CancelWork).request_id == "gone"
        assert forgotten(server, "gone")


def test_an_answer_after_the_apis_loop_closed_is_dropped_not_raised() -> None:
    channel = LocalChannel()
    try:

        async def main() -> LocalClient:
            client = await started(LocalClient(channel))
            return client

        asyncio.run(main())  # the loop is closed now, as when the HTTP server has stopped
        channel.reply(RequestEvent("r", "FAILED", error="late"))  # no RuntimeError on the server's thread
        assert isinstance(channel.take(1), list)
    finally:
        channel.close()


def test_a_submit_is_handed_over_as_built() -> None:
    channel = LocalChannel()
    try:

        async def main() -> None:
            client = await started(LocalClient(channel))
            params = GenerationParams(**PARAMS)
            generation = asyncio.ensure_future(client.generate("r", params, priority=2))
            await asyncio.sleep(0)
            (submit,) = channel.take(10)
            assert isinstance(submit, Submit) and submit.params is params and submit.priority == 2
            generation.cancel()
            with pytest.raises(asyncio.CancelledError):
                await generation

        asyncio.run(main())
    finally:
        channel.close()


def test_a_closed_channel_refuses_puts_and_tells_the_api_once() -> None:
    channel = LocalChannel()
    closed: list[bool] = []
    channel.connect(lambda msg, frames: None, lambda: closed.append(True))
    channel.put("queued")
    channel.close()
    channel.close()  # idempotent: the fd is released once, the API told once
    assert closed == [True]
    with pytest.raises(ChannelClosed):
        channel.put("late")  # never written to a released fd (its number may be another file's by now)


def test_requests_of_a_server_whose_loop_ended_fail_with_503_not_hang() -> None:
    with scripted_head() as (server, _, workers):

        async def main() -> None:
            client = await started(LocalClient(server.local))
            held = asyncio.ensure_future(client.generate("held", GenerationParams(**PARAMS)))
            await asyncio.to_thread(workers[Role.ENCODER][0].wait_for, Work)
            server.stop()  # the loop ends with the request in flight, as if it had crashed
            with pytest.raises(GenerationFailed) as failed:
                await asyncio.wait_for(held, 10)
            assert failed.value.status_code == 503 and "stopped" in str(failed.value)
            with pytest.raises(GenerationFailed) as refused:  # a new request is refused at once
                await asyncio.wait_for(client.generate("new", GenerationParams(**PARAMS)), 10)
            assert refused.value.status_code == 503
            await client.cancel("held")  # nothing to cancel any more: no error

        asyncio.run(main())


def test_a_frontend_peer_naming_itself_as_the_local_client_is_not_heard() -> None:
    """ZMQ lets a peer choose its routing id; answers to the local client's id go to the channel, so
    a frontend peer claiming it could only lose its own: its messages are dropped instead."""
    with scripted_head() as (server, frontend, _workers):
        impostor = zmq.Context.instance().socket(zmq.DEALER)
        try:
            impostor.setsockopt(zmq.ROUTING_ID, LOCAL_CLIENT)
            impostor.setsockopt(zmq.LINGER, 0)
            impostor.connect(server.frontend_endpoint)
            impostor.send_multipart(encode(Submit("spoof", GenerationParams(**PARAMS))))
            frontend.send_multipart(encode(Submit("honest", GenerationParams(**PARAMS))))  # sent after it
            deadline = time.monotonic() + 10
            while "honest" not in server.requests:
                assert time.monotonic() < deadline, "the honest request never arrived"
                time.sleep(0.01)
            time.sleep(0.3)  # and a while more, should the impostor's connection have been the slower
            assert "spoof" not in server.requests
        finally:
            impostor.close()
