"""ZMQ socket helpers that the head and the workers share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

from triptych.protocol import encode
from triptych.protocol.codec import Message


def send_message(sock: zmq.Socket[Any], msg: Message, frames: Sequence[Any] = (), flags: int = 0) -> None:
    """Encode and send one message. A control message is one part, sent without send_multipart's
    per-part loop (it is on the path of every request); tensor frames go zero-copy, small headers
    are cheaper copied."""
    parts = encode(msg, frames)
    if len(parts) == 1:
        sock.send(parts[0], flags=flags)
    else:
        sock.send_multipart(parts, flags=flags, copy=False)


def has_queued_message(sock: zmq.Socket[Any]) -> bool:
    """Whether a receive would return at once: ends a drain loop without the zmq.Again a
    non-blocking receive on an empty socket raises (an exception costs more than asking)."""
    return bool(int(sock.get(zmq.EVENTS)) & zmq.POLLIN)
