"""stage_tensors / load_tensors: what comes out is bit-identical to what went in."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from triptych.protocol.tensors import TensorSpec
from triptych_worker.transfer import (
    ALIGNMENT,
    PayloadTooLarge,
    TransferPool,
    load_tensors,
    stage_tensors,
    view_tensors,
)

MIB = 1024 * 1024


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor whose bytes are uniformly random, so NaN payloads and denormals are covered too."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def round_trip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pool = TransferPool(4 * MIB, "encoder")
    staged = stage_tensors(pool, tensors, "req-1")
    assert staged is not None
    out = load_tensors(pool, staged.allocation, staged.manifest, "cpu")
    # The same bytes used in place (what a CPU receiver does): views of the right dtype and shape.
    views = view_tensors(pool, staged.allocation, staged.manifest, torch_tensors=True)
    assert views.keys() == out.keys()
    for name, view in views.items():
        assert same_bytes(view, out[name]), name
        assert view.numel() == 0 or in_pool(pool, view), f"{name} is a view on the slot, not a copy"
    assert pool.free(staged.allocation)
    return out


def in_pool(pool: TransferPool, tensor: torch.Tensor) -> bool:
    return pool.base_addr <= tensor.data_ptr() < pool.base_addr + pool.pool_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    original = random_bits((3, 77, 5), dtype, seed=1) if dtype is not torch.bool else torch.rand(3, 77, 5) > 0.5
    out = round_trip({"x": original})
    assert same_bytes(out["x"], original)


def test_bfloat16_nan_payloads_survive() -> None:
    nans = torch.tensor([0x7FC1, 0x7F81, -1, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    out = round_trip({"nans": nans})
    assert torch.equal(out["nans"].view(torch.int16), nans.view(torch.int16))


def test_non_contiguous_tensors_arrive_contiguous_with_the_same_values() -> None:
    base = random_bits((16, 12), torch.float32, seed=2)
    views = {"transposed": base.t(), "strided": base[::3, 1::2], "expanded": base[0:1].expand(4, 12)}
    out = round_trip(views)
    for name, view in views.items():
        assert out[name].is_contiguous()
        assert same_bytes(out[name], view), name


def test_zero_size_and_zero_dim_tensors_keep_their_shapes() -> None:
    tensors = {
        "empty": torch.empty(0, 4096, dtype=torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "after": random_bits((33,), torch.uint8, seed=3),
    }
    out = round_trip(tensors)
    assert out["empty"].shape == (0, 4096) and out["empty"].dtype == torch.bfloat16
    assert out["scalar"].shape == () and out["scalar"].item() == 7
    assert same_bytes(out["after"], tensors["after"])


def test_only_zero_size_tensors_still_stage() -> None:
    out = round_trip({"empty": torch.empty(0)})
    assert out["empty"].shape == (0,)


def test_flux_like_set_round_trips_with_aligned_offsets() -> None:
    tensors = {
        "prompt_embeds": random_bits((1, 512, 4096), torch.bfloat16, seed=4),
        "pooled_prompt_embeds": random_bits((1, 768), torch.bfloat16, seed=5),
        "text_ids": torch.zeros(512, 3, dtype=torch.int64),
        "latents": random_bits((1, 4096, 64), torch.float32, seed=6),
    }
    pool = TransferPool(16 * MIB, "encoder")
    staged = stage_tensors(pool, tensors, "req-1")
    assert staged is not None
    assert all(spec["offset"] % ALIGNMENT == 0 for spec in staged.manifest)
    out = load_tensors(pool, staged.allocation, staged.manifest, "cpu")
    pool.free(staged.allocation)
    pool.allocate(16 * MIB, "overwrite-the-slot")  # loaded tensors must not alias the pool
    for name, tensor in tensors.items():
        assert same_bytes(out[name], tensor), name


def test_stage_returns_none_when_the_pool_is_full() -> None:
    pool = TransferPool(MIB, "encoder")
    assert pool.allocate(MIB // 2 + 1, "other") is not None
    assert stage_tensors(pool, {"x": torch.zeros(MIB // 2, dtype=torch.uint8)}, "req-1") is None


def test_stage_raises_payload_too_large_naming_the_role() -> None:
    pool = TransferPool(MIB, "encoder")
    with pytest.raises(PayloadTooLarge, match="raise the flag on the encoder workers"):
        stage_tensors(pool, {"x": torch.zeros(MIB + 1, dtype=torch.uint8)}, "req-1")


def test_stage_rejects_a_dtype_that_cannot_travel_without_leaking_pool_space() -> None:
    pool = TransferPool(MIB, "encoder")
    with pytest.raises(ValueError, match=r"'bad'.*complex64"):
        stage_tensors(pool, {"ok": torch.zeros(8), "bad": torch.zeros(8, dtype=torch.complex64)}, "req-1")
    assert pool.free_bytes == MIB


def test_stage_rejects_a_tensor_of_too_high_rank_naming_it() -> None:
    pool = TransferPool(MIB, "encoder")
    with pytest.raises(ValueError, match="'deep'"):
        stage_tensors(pool, {"deep": torch.zeros((1,) * 9)}, "req-1")
    assert pool.free_bytes == MIB


def test_load_rejects_a_manifest_that_overruns_the_allocation_naming_the_tensor() -> None:
    pool = TransferPool(MIB, "decoder")
    slot = pool.allocate(1000, "req-1")
    assert slot is not None
    manifest = [
        {"name": "fits", "dtype": "float32", "shape": [10], "offset": 0},
        {"name": "latents", "dtype": "float32", "shape": [250], "offset": 256},
    ]
    with pytest.raises(ValueError, match=r"'latents'.*1000-byte allocation"):
        load_tensors(pool, slot, manifest, "cpu")


def test_load_rejects_duplicate_names() -> None:
    pool = TransferPool(MIB, "decoder")
    slot = pool.allocate(1000, "req-1")
    assert slot is not None
    spec = {"name": "x", "dtype": "uint8", "shape": [4], "offset": 0}
    with pytest.raises(ValueError, match="'x' appears twice"):
        load_tensors(pool, slot, [spec, spec], "cpu")


# --- numpy arrays and numpy pools (simulated workers, which never import torch) ---------------


@pytest.mark.parametrize("memory", ["torch", "numpy"])
def test_numpy_arrays_round_trip_bit_exact_through_either_pool(memory: str) -> None:
    rng = np.random.default_rng(7)
    arrays = {
        "f16": rng.integers(0, 256, size=(2, 77 * 2 * 3), dtype=np.uint8).view(np.float16).reshape(2, 77, 3),
        "i64": rng.integers(-(2**62), 2**62, size=(5,), dtype=np.int64),
        "mask": rng.random((3, 4)) > 0.5,
        "strided": rng.random((6, 8), dtype=np.float32)[::2, 1::3],
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.empty((0, 16), dtype=np.float32),
    }
    pool = TransferPool(4 * MIB, "encoder", memory=memory)  # type: ignore[arg-type]
    staged = stage_tensors(pool, arrays, "req-1")
    assert staged is not None
    out = load_tensors(pool, staged.allocation, staged.manifest, None)
    pool.free(staged.allocation)
    pool.allocate(4 * MIB, "overwrite-the-slot")  # loaded arrays must not alias the pool
    for name, array in arrays.items():
        assert isinstance(out[name], np.ndarray) and out[name].flags.c_contiguous, name
        assert out[name].dtype == array.dtype and out[name].shape == array.shape, name
        assert out[name].tobytes() == np.ascontiguousarray(array).tobytes(), name


def test_a_numpy_sender_and_a_torch_receiver_see_the_same_bytes() -> None:
    """A simulated worker's output loads as the same tensor a model worker would have staged."""
    original = random_bits((3, 40, 5), torch.float32, seed=8)
    pool = TransferPool(MIB, "encoder", memory="numpy")
    staged = stage_tensors(pool, {"x": original.numpy()}, "req-1")
    assert staged is not None
    from_numpy = load_tensors(pool, staged.allocation, staged.manifest, "cpu")["x"]
    assert same_bytes(from_numpy, original)
    staged_torch = stage_tensors(TransferPool(MIB, "encoder"), {"x": original}, "req-2")
    assert staged_torch is not None and staged_torch.manifest == staged.manifest


def test_a_numpy_pool_is_aligned_and_registers_its_whole_buffer() -> None:
    calls: list[tuple[int, int]] = []

    class Registrar:
        def register(self, ptr: int, nbytes: int) -> None:
            calls.append((ptr, nbytes))

    pool = TransferPool(MIB + 100, "decoder", Registrar(), memory="numpy")
    assert pool.base_addr % ALIGNMENT == 0 and isinstance(pool.buffer, np.ndarray)
    assert calls == [(pool.base_addr, MIB + 100)] and pool.buffer.ctypes.data == pool.base_addr


def test_loading_bfloat16_as_numpy_says_to_load_it_as_torch() -> None:
    pool = TransferPool(MIB, "decoder", memory="numpy")
    slot = pool.allocate(64, "req-1")
    assert slot is not None
    with pytest.raises(ValueError, match="'emb' is bfloat16"):
        load_tensors(pool, slot, [{"name": "emb", "dtype": "bfloat16", "shape": [4], "offset": 0}], None)


def test_numpy_staging_and_loading_never_import_torch() -> None:
    code = (
        "import sys, numpy as np\n"
        "from triptych_worker.transfer import TransferPool, load_tensors, stage_tensors\n"
        "from triptych.protocol import tensors_to_frames\n"
        "pool = TransferPool(1 << 20, 'encoder', memory='numpy')\n"
        "s = stage_tensors(pool, {'x': np.arange(10, dtype=np.float32)}, 'r')\n"
        "assert load_tensors(pool, s.allocation, s.manifest, None)['x'].tolist() == list(range(10))\n"
        "tensors_to_frames({'pixels': np.zeros((1, 1, 2, 2, 3), dtype=np.uint8)})\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr


# --- inputs used in place (view_tensors) ------------------------------------------------------


def test_views_see_the_slot_and_nothing_is_copied() -> None:
    pool = TransferPool(MIB, "denoiser")
    original = random_bits((4, 64), torch.bfloat16, seed=5)
    staged = stage_tensors(pool, {"latents": original, "flag": torch.tensor(True)}, "req-1")
    assert staged is not None
    views = view_tensors(pool, staged.allocation, staged.manifest, torch_tensors=True)
    slot = pool.view(staged.allocation)
    assert views["latents"].data_ptr() == staged.allocation.addr  # the first tensor starts the slot
    assert views["flag"].dtype == torch.bool and views["flag"].shape == () and bool(views["flag"])
    slot[:2] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)  # bf16 1.0, little-endian
    assert views["latents"][0, 0].item() == 1.0, "a view reads the slot as it is now"


def test_numpy_views_are_read_only_and_bfloat16_needs_torch() -> None:
    pool = TransferPool(MIB, "decoder", memory="numpy")
    original = np.arange(12, dtype=np.float32).reshape(3, 4)
    staged = stage_tensors(pool, {"x": original}, "req-1")
    assert staged is not None
    views = view_tensors(pool, staged.allocation, staged.manifest, torch_tensors=False)
    assert np.array_equal(views["x"], original) and views["x"].dtype == np.float32
    assert np.shares_memory(views["x"], pool.buffer)
    with pytest.raises(ValueError, match="read-only"):
        views["x"][0, 0] = 1.0
    bf16 = [{"name": "b", "dtype": "bfloat16", "shape": [2], "offset": 0}]
    with pytest.raises(ValueError, match="load it as torch"):
        view_tensors(pool, staged.allocation, bf16, torch_tensors=False)


def test_views_reject_a_manifest_that_overruns_the_allocation() -> None:
    pool = TransferPool(MIB, "denoiser")
    alloc = pool.allocate(1000, "req-1")
    assert alloc is not None
    with pytest.raises(ValueError, match=r"'x'.*does not fit"):
        view_tensors(pool, alloc, [{"name": "x", "dtype": "float32", "shape": [300], "offset": 0}], torch_tensors=True)
    with pytest.raises(ValueError, match="'y' at offset 2 is not aligned for float32"):
        view_tensors(pool, alloc, [{"name": "y", "dtype": "float32", "shape": [3], "offset": 2}], torch_tensors=True)


def test_staging_a_strided_tensor_copies_once_into_the_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """No contiguous() first: a strided tensor is copied straight into the slot, once."""
    base = random_bits((64, 48), torch.float32, seed=6)
    strided = base.t()[::2]
    calls: list[str] = []
    real = torch.Tensor.contiguous

    def counting(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append("contiguous")
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "contiguous", counting)
    pool = TransferPool(MIB, "encoder")
    staged = stage_tensors(pool, {"x": strided}, "req-1")
    monkeypatch.undo()
    assert staged is not None and calls == []
    out = load_tensors(pool, staged.allocation, staged.manifest, "cpu")
    assert same_bytes(out["x"], strided)


def test_views_deep_in_the_pool_are_contiguous_tensors_of_their_dtype_and_shape() -> None:
    """Views are windows on the pool's typed buffer: right address, strides and bytes for every
    dtype, in a slot that does not start the pool, zero-size and zero-dim included."""
    pool = TransferPool(MIB, "denoiser")
    assert pool.allocate(1000, "someone-else") is not None  # the slot below starts past it
    tensors = {
        "bf16": random_bits((1, 3, 5), torch.bfloat16, seed=7),
        "f64": random_bits((2, 1, 3), torch.float64, seed=8),
        "i8": random_bits((7,), torch.int8, seed=9),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3, dtype=torch.int32),
    }
    staged = stage_tensors(pool, tensors, "req-1")
    assert staged is not None and staged.allocation.offset > 0
    views = view_tensors(pool, staged.allocation, staged.manifest, torch_tensors=True)
    for spec in staged.manifest:
        assert TensorSpec.from_wire(spec).to_wire() == spec  # layout writes what TensorSpec reads
        view, original = views[spec["name"]], tensors[spec["name"]]
        assert view.is_contiguous() and view.stride() == original.contiguous().stride(), spec
        assert same_bytes(view, original), spec
        if view.numel():
            assert view.data_ptr() == staged.allocation.addr + spec["offset"], spec
