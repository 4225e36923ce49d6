"""ZMQ socket helpers that the head and the workers share."""

from __future__ import annotations

import select
from collections.abc import Sequence
from typing import Any

import zmq

from triptych.protocol import encode
from triptych.protocol.codec import Message

# A connect attempt that gets no answer at all is given up after this long and tried again. Without
# it the kernel's SYN retries decide (~2 min): a worker that first dials its head's Service before
# kube-proxy has programmed the new ClusterIP sends its SYN nowhere (and conntrack keeps the retries
# of that attempt on the same path), so it stays invisible to the head for two minutes after the
# rule exists (the likely cause of a real-node test failure: a video failed for want of an encoder
# whose pod was Ready).
CONNECT_TIMEOUT_MS = 2000


def connect(sock: zmq.Socket[Any], url: str) -> None:
    """Connect `sock` to `url`, an attempt without an answer retried after CONNECT_TIMEOUT_MS."""
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
    sock.connect(url)


def send_message(sock: zmq.Socket[Any], msg: Message, frames: Sequence[Any] = (), flags: int = 0) -> None:
    """Encode and send one message. A control message is one part, sent without send_multipart's
    per-part loop (it is on the path of every request); tensor frames go zero-copy, small headers
    are cheaper copied."""
    parts = encode(msg, frames)
    if len(parts) == 1:
        sock.send(parts[0], flags=flags)
    else:
        sock.send_multipart(parts, flags=flags, copy=False)


def recv_message(sock: zmq.Socket[Any], flags: int = 0, copied: int = 1) -> list[Any]:
    """One message's parts: the first `copied` (a control message's header, a ROUTER's client id too)
    as bytes, the rest (tensor frames) as zero-copy buffers. Raises zmq.Again as a receive does.

    A zero-copy receive builds a zmq.Frame per part, which costs more than copying a header of a
    few hundred bytes (on the path of every message at every end); only tensor frames are worth it.
    """
    parts: list[Any] = [sock.recv(flags)]
    while sock.get(zmq.RCVMORE):
        if len(parts) < copied:
            parts.append(sock.recv(flags))
        else:
            parts.append(sock.recv(flags, copy=False).buffer)
    return parts


def has_queued_message(sock: zmq.Socket[Any]) -> bool:
    """Whether a receive would return at once: ends a drain loop without the zmq.Again a
    non-blocking receive on an empty socket raises (an exception costs more than asking)."""
    return bool(int(sock.get(zmq.EVENTS)) & zmq.POLLIN)


def wait_for_message(sock: zmq.Socket[Any], timeout_s: float) -> bool:
    """Block until a message is queued on `sock` or `timeout_s` has passed (sub-millisecond: a
    zmq poll counts whole milliseconds); True if one is queued.

    Sleeps in select() on the socket's ZMQ_FD, which becomes readable when the socket's state may
    have changed; reading ZMQ_EVENTS first (has_queued_message) re-arms it, so a message arriving
    after that check wakes the wait at once. Other state changes (a peer connecting) signal it too:
    then it returns False before `timeout_s`, and the caller polls again as after a timeout.
    """
    if has_queued_message(sock):
        return True
    readable, _, _ = select.select([int(sock.get(zmq.FD))], [], [], timeout_s)
    return bool(readable) and has_queued_message(sock)


class SocketSet:
    """Waits on several ZMQ sockets and plain file descriptors at once, asking a socket whether it
    has a message only when it may: its descriptor fired, or the caller used it since.

    zmq_poll (zmq.Poller) asks every socket for ZMQ_EVENTS before it sleeps and again after it
    wakes, and each ask is a poll() and a getpid() system call in libzmq (its mailbox's fork
    check): ~20 system calls a wait over the head's five sockets, most of them on a message's path
    (docs/benchmarks.md, "The head's wait and its metrics"). A ZMQ socket's ZMQ_FD becomes
    readable when the socket's state may have changed, and asking for ZMQ_EVENTS consumes that
    signal; so a socket that was asked and said "nothing queued" needs no asking until its
    descriptor fires again, unless a send or receive on it (which may consume the signal too) came
    in between: the caller says so with `recheck`. Plain descriptors (an eventfd) are
    level-triggered and returned as they fire.
    """

    def __init__(self) -> None:
        self._poll = select.poll()
        self._by_fd: dict[int, Any] = {}
        self._recheck: set[zmq.Socket[Any]] = set()

    def add_socket(self, sock: zmq.Socket[Any]) -> None:
        fd = int(sock.get(zmq.FD))
        self._poll.register(fd, select.POLLIN)
        self._by_fd[fd] = sock
        self._recheck.add(sock)  # never asked yet

    def add_fd(self, fd: int) -> None:
        self._poll.register(fd, select.POLLIN)
        self._by_fd[fd] = fd

    def recheck(self, sock: zmq.Socket[Any]) -> None:
        """`sock` was used (a send, or a receive that left messages queued): ask it at the next wait."""
        self._recheck.add(sock)

    def wait(self, timeout_s: float) -> set[Any]:
        """The sockets with a message queued and the descriptors readable, waiting up to `timeout_s`
        for one (not at all if one is ready at once)."""
        ready = {sock for sock in self._recheck if has_queued_message(sock)}
        self._recheck.clear()
        for fd, _ in self._poll.poll(0 if ready else max(0, round(timeout_s * 1000))):
            key = self._by_fd[fd]
            if key not in ready and (isinstance(key, int) or has_queued_message(key)):
                ready.add(key)
        return ready
