"""ZMQ socket helpers that the head and the workers share."""

from __future__ import annotations

from typing import Any

import zmq


def has_queued_message(sock: zmq.Socket[Any]) -> bool:
    """Whether a receive would return at once: ends a drain loop without the zmq.Again a
    non-blocking receive on an empty socket raises (an exception costs more than asking)."""
    return bool(int(sock.get(zmq.EVENTS)) & zmq.POLLIN)
