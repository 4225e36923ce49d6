"""msgpack encoding of the typed messages in `messages.py`, with strict decoding.

A ZMQ message is [header, *raw_frames]. The header is a msgpack map
{"v": PROTOCOL_VERSION, "type": <message type>, ...fields}; raw frames carry tensor bytes
described by a `tensors` field. Decoding checks the version, the type and every field's
type, so a garbage frame becomes a ProtocolError, never an arbitrary object.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20

_REGISTRY: dict[str, type] = {}
T = typing.TypeVar("T")


class ProtocolError(ValueError):
    """A message that cannot be decoded. `request_id` is set when one could be recovered."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


@typing.dataclass_transform(frozen_default=True)
def message(type_name: str) -> typing.Callable[[type[T]], type[T]]:
    """Class decorator: register a frozen dataclass as the message `type_name`."""

    def register(cls: type[T]) -> type[T]:
        cls = dataclasses.dataclass(frozen=True)(cls)
        cls.TYPE = type_name  # type: ignore[attr-defined]
        if type_name in _REGISTRY:
            raise RuntimeError(f"message type {type_name!r} registered twice")
        _REGISTRY[type_name] = cls
        return cls

    return register


def encode(msg: Any, frames: typing.Sequence[Any] = ()) -> list[Any]:
    """[header, *frames] ready for `socket.send_multipart`."""
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    header = msgpack.packb({"v": PROTOCOL_VERSION, "type": msg.TYPE, **body}, use_bin_type=True)
    return [header, *frames]


def decode(parts: typing.Sequence[Any]) -> tuple[Any, list[Any]]:
    """Decode [header, *frames] into (message, frames); raises ProtocolError."""
    if not parts:
        raise ProtocolError("empty message")
    header = bytes(parts[0])
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        raw = msgpack.unpackb(header, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"header must be a map, got {type(raw).__name__}")
    request_id = raw.get("request_id") if isinstance(raw.get("request_id"), str) else None
    if raw.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {raw.get('v')!r} is not {PROTOCOL_VERSION}", request_id)
    type_name = raw.get("type")
    cls = _REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {raw.get('type')!r}", request_id)
    hints = _hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name in raw:
            value = raw[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            raise ProtocolError(f"{type_name}: missing field {field.name!r}", request_id)
        if not _conforms(value, hints[field.name]):
            raise ProtocolError(
                f"{type_name}: field {field.name!r} has {type(value).__name__} {_short(value)}, "
                f"expected {hints[field.name]}",
                request_id,
            )
        kwargs[field.name] = value
    return cls(**kwargs), list(parts[1:])


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Field types of a message class, resolved once (get_type_hints re-evaluates them every call)."""
    return typing.get_type_hints(cls)


def _conforms(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if origin is dict:
        key, val = typing.get_args(hint) or (Any, Any)
        return isinstance(value, dict) and all(_conforms(k, key) and _conforms(v, val) for k, v in value.items())
    if isinstance(hint, type):
        return isinstance(value, hint)
    return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
