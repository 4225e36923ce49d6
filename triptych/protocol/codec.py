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
    cls: type = type(msg)
    body = {name: getattr(msg, name) for name, _ in _plan(cls)}
    header = msgpack.packb({"v": PROTOCOL_VERSION, "type": msg.TYPE, **body}, use_bin_type=True)
    return [header, *frames]


def decode(parts: typing.Sequence[Any]) -> tuple[Any, list[Any]]:
    """Decode [header, *frames] into (message, frames); raises ProtocolError."""
    if not parts:
        raise ProtocolError("empty message")
    header = memoryview(parts[0])
    if header.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {header.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
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
    kwargs = {}
    for name, field in _plan(cls):
        value = raw.get(name, _ABSENT)
        if value is _ABSENT:
            if field.required:
                raise ProtocolError(f"{type_name}: missing field {name!r}", request_id)
            continue  # the dataclass fills in its own default
        if not field.check(value):
            raise ProtocolError(
                f"{type_name}: field {name!r} has {type(value).__name__} {_short(value)}, expected {field.hint}",
                request_id,
            )
        kwargs[name] = value
    return cls(**kwargs), list(parts[1:])


# --- per-class decoding plans, built once ------------------------------------------------------

_ABSENT = object()
Check = typing.Callable[[Any], bool]


@dataclasses.dataclass(frozen=True)
class _Field:
    hint: Any
    check: Check
    required: bool


@functools.cache
def _plan(cls: type) -> tuple[tuple[str, _Field], ...]:
    """Each field of a message class with a checker compiled from its type hint (resolved once)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (
            f.name,
            _Field(
                hints[f.name],
                _checker(hints[f.name]),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            ),
        )
        for f in dataclasses.fields(cls)
    )


def _any(value: Any) -> bool:
    return True


def _checker(hint: Any) -> Check:
    """A predicate for values of type `hint`, as msgpack produces them (bool is not an int)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return _any
    if origin in (typing.Union, types.UnionType):
        options = [_checker(h) for h in typing.get_args(hint)]
        return lambda v: any(check(v) for check in options)
    if hint is type(None):
        return lambda v: v is None
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if origin is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        item = _checker(item_hint)
        return lambda v: isinstance(v, list) and all(map(item, v))
    if origin is dict:
        key_hint, val_hint = typing.get_args(hint) or (Any, Any)
        key, val = _checker(key_hint), _checker(val_hint)
        if val is _any:
            return lambda v: isinstance(v, dict) and all(map(key, v))
        return lambda v: isinstance(v, dict) and all(key(k) and val(x) for k, x in v.items())
    if isinstance(hint, type):
        return lambda v: isinstance(v, hint)
    raise TypeError(f"message field type {hint!r} has no wire check")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
