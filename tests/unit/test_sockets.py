"""triptych.sockets.connect: a connect attempt that gets no answer is given up and retried within
seconds, as for a Service whose ClusterIP kube-proxy had not programmed when the first SYN left.
triptych.sockets.wait_for_message: a worker's leader sleeps in it between polls of its writes, so a
message arriving during the wait must end it at once, and an idle socket must not hold it longer.
triptych.sockets.SocketSet: the head's loop waits on its sockets and its API's eventfd with it; it
must report every socket with a message and every readable descriptor, asking only the sockets
that may have one."""

from __future__ import annotations

import os
import socket
import threading
import time
from unittest import mock

import zmq
from zmq.utils.monitor import recv_monitor_message

from triptych import sockets
from triptych.sockets import CONNECT_TIMEOUT_MS, SocketSet, connect, recv_message, wait_for_message


def test_a_connect_attempt_without_an_answer_is_retried_within_seconds():
    # A listener whose accept queue is full: the kernel drops further SYNs, so a connect gets no answer
    # (neither SYN-ACK nor RST), like one sent to an address nothing routes.
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    port = blackhole.getsockname()[1]
    fillers = [socket.socket() for _ in range(4)]
    for f in fillers:
        f.setblocking(False)
        f.connect_ex(("127.0.0.1", port))
    time.sleep(0.3)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    monitor = push.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED)
    try:
        timeout_s = CONNECT_TIMEOUT_MS / 1000
        t0 = time.monotonic()
        connect(push, f"tcp://127.0.0.1:{port}")
        retried = []
        # Two fresh attempts (new source ports, which a newly programmed rule would route), one per
        # timeout. Without the timeout the kernel retries the SYN on its own for over a minute
        # (tcp_syn_retries) before ZMQ tries again: bounds of 2 and 5 timeouts hold under load too.
        while time.monotonic() - t0 < 5 * timeout_s and len(retried) < 2:
            if monitor.poll(100):
                recv_monitor_message(monitor)
                retried.append(time.monotonic() - t0)
        assert len(retried) == 2, f"retries {retried} s after the connect, {5 * timeout_s:g} s allowed"
        assert retried[0] < 2 * timeout_s, f"the first retry came {retried[0]:.1f} s after the connect"
    finally:
        push.disable_monitor()
        monitor.close()
        push.close()
        ctx.term()
        for s in (*fillers, blackhole):
            s.close()


def test_wait_for_message_ends_when_a_message_arrives_and_times_out_without_one():
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        t0 = time.monotonic()
        assert not wait_for_message(pull, 0.05), "nothing was sent"
        assert time.monotonic() - t0 < 2.0, "an idle wait outlasted its 50 ms timeout by far"
        for i in range(3):  # each wait re-arms the socket's FD: a later message wakes a later wait
            sender = threading.Timer(0.05, push.send, args=(b"work %d" % i,))
            sender.start()
            t0 = time.monotonic()
            wakes = 0  # a wait may also end early, on another state change (the peer connecting)
            while not wait_for_message(pull, 10.0) and wakes < 100:
                wakes += 1
            took = time.monotonic() - t0
            sender.join()
            assert took < 5.0, f"message {i} ended a 10 s wait only after {took:.1f} s"
            assert recv_message(pull, zmq.NOBLOCK) == [b"work %d" % i]
        push.send(b"queued")
        deadline = time.monotonic() + 5
        while not wait_for_message(pull, 0.01):  # one already queued returns at once
            assert time.monotonic() < deadline, "a queued message was never seen"
        assert wait_for_message(pull, 0.0)
    finally:
        pull.close()
        push.close()
        ctx.term()


def test_a_socket_set_reports_what_is_queued_asks_only_sockets_that_may_have_a_message_and_wakes_on_arrival():
    ctx = zmq.Context()
    pulls = [ctx.socket(zmq.PULL) for _ in range(4)]
    pushes = [ctx.socket(zmq.PUSH) for _ in range(4)]
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    asked: list[zmq.Socket] = []
    real = sockets.has_queued_message

    def counted(sock: zmq.Socket) -> bool:
        asked.append(sock)
        return real(sock)

    try:
        for pull, push in zip(pulls, pushes, strict=True):
            for sock in (pull, push):
                sock.setsockopt(zmq.LINGER, 0)
            push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
        waiting = SocketSet()
        for pull in pulls:
            waiting.add_socket(pull)
        waiting.add_fd(efd)
        for pull, push in zip(pulls, pushes, strict=True):  # connected and handshaken: a probe goes through
            push.send(b"probe")
            assert pull.poll(5000) and pull.recv() == b"probe"
        deadline, quiet = time.monotonic() + 5, 0
        while quiet < 3:  # what the connects signalled is asked once and done with
            quiet = 0 if waiting.wait(0.01) else quiet + 1
            assert time.monotonic() < deadline
        with mock.patch.object(sockets, "has_queued_message", counted):
            t0 = time.monotonic()
            assert waiting.wait(0.05) == set(), "nothing was sent"
            assert time.monotonic() - t0 < 2.0
            assert asked == [], "an idle wait asked sockets whose descriptors never fired"
            pushes[1].send(b"a")
            pushes[3].send(b"b")
            os.eventfd_write(efd, 1)
            seen: set[object] = set()
            while seen != {pulls[1], pulls[3], efd}:
                seen |= waiting.wait(5.0)
                assert time.monotonic() - t0 < 5.0, f"only {seen} reported"
            assert set(asked) <= {pulls[1], pulls[3]}, "asked a socket whose descriptor did not fire"
            os.eventfd_read(efd)
            assert recv_message(pulls[1], zmq.NOBLOCK) == [b"a"]
            assert recv_message(pulls[3], zmq.NOBLOCK) == [b"b"]
            sender = threading.Timer(0.05, pushes[2].send, args=(b"c",))  # arrives during the wait
            sender.start()
            t0 = time.monotonic()
            seen = set()
            while pulls[2] not in seen:
                seen |= waiting.wait(10.0)
                assert time.monotonic() - t0 < 5.0, "a message arriving during a 10 s wait did not end it"
            sender.join()
            assert recv_message(pulls[2], zmq.NOBLOCK) == [b"c"]
            # A socket read only in part (the head stops at READ_LIMIT) may not signal again for what is
            # left: recheck() has the next wait ask it, and it is reported at once.
            for i in range(3):
                pushes[0].send(b"%d" % i)
            got: list[list[bytes]] = []
            t0 = time.monotonic()
            while len(got) < 3:  # one message a turn, as if READ_LIMIT were 1
                assert time.monotonic() - t0 < 2.0, f"a rechecked socket with messages queued was slept on: {got}"
                if pulls[0] in waiting.wait(5.0):
                    got.append(recv_message(pulls[0], zmq.NOBLOCK))
                    waiting.recheck(pulls[0])
            assert got == [[b"0"], [b"1"], [b"2"]]
    finally:
        os.close(efd)
        for sock in (*pulls, *pushes):
            sock.close()
        ctx.term()
