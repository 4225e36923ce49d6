"""Tensors on the wire: a dtype/shape header plus the raw bytes, never pickle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

Array: TypeAlias = "torch.Tensor | np.ndarray"
"""A tensor as the transfer layer takes it: a torch tensor, or a numpy array where torch is not loaded."""

# Wire names -> torch dtype attribute names. Only plain numeric dtypes travel. numpy names the
# same dtypes the same way, except bfloat16, which it lacks.
WIRE_DTYPES: dict[str, str] = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float64": "float64",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
}
ITEMSIZE: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip

MAX_TENSOR_RANK = 8

PIXELS = "pixels"
"""The decoder's output tensor: uint8 [num_outputs, frames, height, width, 3]."""


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor sits in a byte buffer (a ZMQ frame or a transfer slot)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset}

    @classmethod
    def from_wire(cls, raw: Any) -> TensorSpec:
        if not isinstance(raw, dict):
            raise ValueError(f"tensor spec must be a map, got {type(raw).__name__}")
        name, dtype, shape, offset = raw.get("name"), raw.get("dtype"), raw.get("shape"), raw.get("offset", 0)
        if not isinstance(name, str) or not name:
            raise ValueError("tensor spec 'name' must be a non-empty string")
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        if type(shape) is not list or len(shape) > MAX_TENSOR_RANK or not _sizes(shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} must be a list of at most {MAX_TENSOR_RANK} ints >= 0")
        if type(offset) is not int or offset < 0:
            raise ValueError(f"tensor {name!r}: offset {offset!r} must be an int >= 0")
        return cls(name, dtype, tuple(shape), offset)


def _sizes(shape: list[Any]) -> bool:
    """Every entry an int >= 0 (not a bool: `type(...) is int` excludes it); every receiver parses
    each input's shape, so this runs on every hop."""
    for d in shape:
        if type(d) is not int or d < 0:
            return False
    return True


def wire_dtype(tensor: Array) -> str:
    """The wire name of a torch tensor's or numpy array's dtype; ValueError if it cannot travel."""
    dtype = tensor.dtype
    name = _WIRE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        if name not in WIRE_DTYPES:
            raise ValueError(f"dtype {dtype} cannot travel; supported: {sorted(WIRE_DTYPES)}")
        _WIRE_NAMES[dtype] = name  # str() of a torch dtype costs ~1 us, on every output of every hop
    return name


_WIRE_NAMES: dict[Any, str] = {}  # torch or numpy dtype -> its wire name, as wire_dtype found it


def tensor_bytes(tensor: Array) -> memoryview:
    """The bytes of a torch tensor or numpy array as a zero-copy view where possible (CPU, contiguous)."""
    if isinstance(tensor, np.ndarray):  # numpy arrays (simulated workers) never need torch imported
        return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data
    t = tensor.detach().to("cpu").contiguous()
    return t.reshape(-1).view(__import__("torch").uint8).numpy().data


def tensors_to_frames(tensors: dict[str, Array]) -> tuple[list[dict[str, Any]], list[memoryview]]:
    """One raw frame per tensor, plus the specs that describe them (offset 0 in each frame)."""
    specs, frames = [], []
    for name, tensor in tensors.items():
        specs.append(TensorSpec(name, wire_dtype(tensor), tuple(tensor.shape)).to_wire())
        frames.append(tensor_bytes(tensor))
    return specs, frames


def frames_to_tensors(specs: list[Any], frames: list[Any]) -> dict[str, torch.Tensor]:
    """Rebuild tensors from frames; raises ValueError naming the tensor that does not fit."""

    if len(specs) != len(frames):
        raise ValueError(f"{len(specs)} tensor specs but {len(frames)} frames")
    out: dict[str, torch.Tensor] = {}
    for raw, frame in zip(specs, frames, strict=True):
        spec = TensorSpec.from_wire(raw)
        buf = memoryview(frame)
        if buf.nbytes != spec.nbytes:
            raise ValueError(f"tensor {spec.name!r}: frame has {buf.nbytes} bytes, spec says {spec.nbytes}")
        out[spec.name] = bytes_to_tensor(spec, buf)
    return out


def bytes_to_tensor(spec: TensorSpec, buf: Any) -> torch.Tensor:
    """Copy `spec.nbytes` bytes at `spec.offset` of `buf` into a new tensor."""
    import torch

    dtype = getattr(torch, WIRE_DTYPES[spec.dtype])
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(memoryview(buf)[spec.offset : spec.offset + spec.nbytes]), dtype=torch.uint8)
    return raw.view(dtype).reshape(spec.shape)
