"""msgpack encoding of the typed messages in `messages.py`, with strict decoding (msgspec).

A ZMQ message is [header, *raw_frames]. The header is a msgpack map
{"type": <message type>, ...fields, "v": PROTOCOL_VERSION}; raw frames carry tensor bytes
described by a `tensors` field (a header without "v" is read as version 1; a peer of another
version sends its own and is refused). msgspec decodes a header straight into its message class and
checks the type of every field on the way (in C: a control message costs a few microseconds
at each end, on the path of every request), so a garbage frame becomes a ProtocolError, never
an arbitrary object. msgspec builds only the classes in `messages.py` and plain maps, lists and
scalars: nothing on the wire can name code to run.

A header is at most MAX_HEADER_BYTES at both ends: `decode` refuses a longer one, and `encode` raises
HeaderTooLarge rather than build one, so an over-long message fails its request where it is made
(naming its size) instead of being dropped unread at the other end.
"""

from __future__ import annotations

import functools
import operator
import re
import typing
from typing import Any

import msgspec

PROTOCOL_VERSION = 1
# An edit's reference image travels inlined in its Work / TransferReady (at most 16 MiB,
# triptych.reference.MAX_REFERENCE_BYTES), with room for its prompts and the rest.
MAX_HEADER_BYTES = 20 << 20
_TOO_DEEP = "header nests maps or lists too deeply"


class ProtocolError(ValueError):
    """A message that cannot be decoded. `request_id` is set when one could be recovered."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


class UnknownMessageType(ProtocolError):
    """A message of a type this process does not know: a peer of a newer release sent something it
    added. Dropped with a warning, never its request's failure: a new message adds to a flow that
    goes on without it (docs/design.md, "Wire protocol")."""


class HeaderTooLarge(ProtocolError):
    """A message `encode` refused to build: its header is over MAX_HEADER_BYTES, so its peer would
    drop it unread (decode). `message_type`, `nbytes`: which message, how long its header was."""

    def __init__(self, message_type: str, nbytes: int, request_id: str | None = None):
        what = f"{message_type} for request {request_id}" if request_id else message_type
        super().__init__(
            f"{what} is {nbytes} bytes, over the {MAX_HEADER_BYTES}-byte ({MAX_HEADER_BYTES >> 20} MiB) "
            "control header limit",
            request_id,
        )
        self.message_type = message_type
        self.nbytes = nbytes


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every wire message; a subclass names its wire type: `class Ping(Message, tag="ping")`."""

    v: int = PROTOCOL_VERSION

    @property
    def TYPE(self) -> str:  # one constant per message class: its wire type name
        return typing.cast(str, self.__struct_config__.tag)


_encoder = msgspec.msgpack.Encoder()


def message_types() -> dict[str, type[Message]]:
    """Every wire message class by its type name."""
    return {typing.cast(str, cls.__struct_config__.tag): cls for cls in Message.__subclasses__()}


@functools.cache
def _decoder() -> msgspec.msgpack.Decoder[Any]:
    """One decoder for the union of all message types (built once every class is defined)."""
    return msgspec.msgpack.Decoder(functools.reduce(operator.or_, message_types().values()))


def encode(msg: Message, frames: typing.Sequence[Any] = ()) -> list[Any]:
    """[header, *frames] ready for `socket.send_multipart`; HeaderTooLarge for a header that `decode`
    would refuse (one length check on the bytes already encoded: nothing more on the common path)."""
    header = _encoder.encode(msg)
    if len(header) > MAX_HEADER_BYTES:
        raise HeaderTooLarge(msg.TYPE, len(header), getattr(msg, "request_id", None))
    return [header, *frames]


def decode(parts: typing.Sequence[Any]) -> tuple[Any, list[Any]]:
    """Decode [header, *frames] into (message, frames); raises ProtocolError."""
    if not parts:
        raise ProtocolError("empty message")
    header = parts[0]
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        msg = _decoder().decode(header)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise _explain(header, exc) from None
    except RecursionError:  # maps and lists nested thousands deep: refused, never a crash
        raise ProtocolError(_TOO_DEEP) from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.v!r} is not {PROTOCOL_VERSION}", getattr(msg, "request_id", None))
    return msg, list(parts[1:])


def _explain(header: Any, exc: msgspec.DecodeError) -> ProtocolError:
    """What is wrong with a header the typed decoder refused, with its request id if it has one."""
    try:
        raw = msgspec.msgpack.decode(header)
    except msgspec.DecodeError:  # not msgpack at all
        return ProtocolError(f"header is not msgpack: {exc}")
    except RecursionError:
        return ProtocolError(_TOO_DEEP)
    if not isinstance(raw, dict):
        return ProtocolError(f"header must be a map, got {type(raw).__name__}")
    request_id = raw.get("request_id") if isinstance(raw.get("request_id"), str) else None
    if raw.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        return ProtocolError(f"protocol version {raw.get('v')!r} is not {PROTOCOL_VERSION}", request_id)
    type_name = raw.get("type")
    if not isinstance(type_name, str) or type_name not in message_types():
        return UnknownMessageType(f"unknown message type {type_name!r}", request_id)
    return ProtocolError(f"{type_name}: {_field_problem(str(exc))}", request_id)


def _field_problem(text: str) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.params.width`" as "field 'params.width': expected int, got str"."""
    if absent := re.fullmatch(r"Object (missing required|contains unknown) field `(\w+)`(?: - at `\$\.?(.*)`)?", text):
        problem = "missing" if absent[1].startswith("missing") else "unknown"
        return f"{problem} field {'.'.join(filter(None, (absent[3], absent[2])))!r}"
    if at := re.fullmatch(r"(.*) - at `(?:.* in `)?\$\.(.+)`", text):
        return f"field {at[2]!r}: {at[1].replace('`', '').lower()}"
    return text
