"""Outputs sent in place (stage_in_place): real Mooncake TCP engines, the receiver's slot gets the
bytes a pool staging would have written, and every case that must copy into the pool does."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.setup_check import missing
from triptych_worker.transfer import (
    MooncakeTransport,
    TransferError,
    TransferPool,
    stage_in_place,
    stage_tensors,
    view_tensors,
)

try:
    import mooncake.engine  # noqa: F401
except ImportError:
    missing(
        "Mooncake (mooncake.engine)", "`make setup` installs its wheel and Debian's libibverbs1, librdmacm1, libnuma1"
    )

MIB = 1024 * 1024
POOL = 16 * MIB  # a sender pool with room for every output set here


@pytest.fixture
def peers() -> Iterator[tuple[MooncakeTransport, TransferPool, MooncakeTransport, TransferPool]]:
    """A sender and a receiver transport, each with its pool (the receiver's slots are written into)."""
    sender, receiver = MooncakeTransport("127.0.0.1"), MooncakeTransport("127.0.0.1")
    try:
        yield sender, TransferPool(4 * MIB, "encoder", sender), receiver, TransferPool(8 * MIB, "denoiser", receiver)
    finally:
        sender.close()
        receiver.close()


def outputs(seed: int) -> dict[str, torch.Tensor]:
    """A FLUX-like set: bf16 embeddings, a pooled vector of odd length (padding before the next), latents."""
    g = torch.Generator().manual_seed(seed)
    return {
        "prompt_embeds": torch.randn(1, 64, 96, generator=g).to(torch.bfloat16),
        "pooled": torch.randn(1, 77, generator=g),
        "latents": torch.randn(1, 256, 16, generator=g),
    }


def send(sender: MooncakeTransport, staged, receiver_pool: TransferPool, receiver: MooncakeTransport):
    slot = receiver_pool.allocate(staged.nbytes, "r")
    assert slot is not None
    if hasattr(staged, "submit_write"):
        staged.submit_write(receiver.session_id, slot.addr).wait()
    else:
        sender.submit_write(receiver.session_id, staged.allocation.addr, slot.addr, staged.nbytes).wait()
    return view_tensors(receiver_pool, slot, staged.manifest, torch_tensors=True)


def test_the_receiver_gets_the_bytes_and_manifest_a_pool_staging_gives(peers) -> None:
    sender, pool, receiver, receiver_pool = peers
    tensors = outputs(0)
    in_place = stage_in_place(sender, tensors, POOL)
    assert in_place is not None
    copied = stage_tensors(pool, tensors, "r")
    assert copied is not None
    assert (in_place.manifest, in_place.nbytes) == (copied.manifest, copied.nbytes)
    assert pool.free_bytes == pool.pool_bytes - copied.allocation.nbytes  # in place took nothing from the pool
    got, want = send(sender, in_place, receiver_pool, receiver), send(sender, copied, receiver_pool, receiver)
    for name, tensor in tensors.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name
    in_place.release()


def test_numpy_outputs_of_simulated_stages_go_in_place_too(peers) -> None:
    sender, _, receiver, receiver_pool = peers
    arrays = {"latents": np.arange(4096, dtype=np.float32).reshape(64, 64), "mask": np.ones(7, np.bool_)}
    in_place = stage_in_place(sender, arrays, POOL)
    assert in_place is not None
    got = send(sender, in_place, receiver_pool, receiver)
    assert np.array_equal(got["latents"].numpy(), arrays["latents"]) and bool(got["mask"].all())
    in_place.release()


def test_what_cannot_go_in_place_is_left_to_the_pool_copy(peers) -> None:
    sender, pool, _, _ = peers
    strided = {"latents": torch.randn(32, 64).t()}
    assert stage_in_place(sender, strided, POOL) is None
    # A view on the pool: an input passed through, whose slot is freed after the stage.
    staged = stage_tensors(pool, {"x": torch.randn(256)}, "input")
    assert staged is not None
    on_pool = view_tensors(pool, staged.allocation, staged.manifest, torch_tensors=True)
    assert stage_in_place(sender, {"embeds": torch.randn(128), **on_pool}, POOL) is None
    # A tensor another request is sending (a shared cache entry) until that one is released.
    shared = outputs(1)
    first = stage_in_place(sender, shared, POOL)
    assert first is not None
    assert stage_in_place(sender, shared, POOL) is None
    first.release()
    again = stage_in_place(sender, shared, POOL)
    assert again is not None
    again.release()
    # Outputs larger than the sender's pool: the pool copy refuses them, naming the flag (as over RDMA).
    assert stage_in_place(sender, outputs(4), pool_bytes=1024) is None
    # A transport that pins memory per registration (RDMA) copies into its pool.
    sender.sends_in_place = False
    assert stage_in_place(sender, outputs(2), POOL) is None


def test_a_released_send_can_no_longer_be_written_and_holds_nothing(peers) -> None:
    sender, _, receiver, receiver_pool = peers
    in_place = stage_in_place(sender, outputs(3), POOL)
    assert in_place is not None
    in_place.release()
    in_place.release()  # idempotent
    assert in_place.tensors == []
    slot = receiver_pool.allocate(in_place.nbytes, "r")
    assert slot is not None
    with pytest.raises(TransferError, match="not inside memory registered"):
        in_place.submit_write(receiver.session_id, slot.addr)


def test_writes_to_a_peer_that_recent_writes_measured_expect_their_end_and_land(peers) -> None:
    """After one write of a rate-worthy size, the next to the same peer knows when it should end
    (transfer/waiting.py: it spins around that end instead of sleeping past it); the bytes land
    either way."""
    sender, pool, receiver, receiver_pool = peers
    for i in range(3):
        tensors = {"latents": torch.randn(MIB // 4, generator=torch.Generator().manual_seed(i))}  # 1 MiB
        staged = stage_tensors(pool, tensors, f"r{i}")
        assert staged is not None
        slot = receiver_pool.allocate(staged.nbytes, f"r{i}")
        assert slot is not None
        pending = sender.submit_write(receiver.session_id, staged.allocation.addr, slot.addr, staged.nbytes)
        if i == 0:
            assert pending.expected_s is None, "nothing was measured to this peer yet"
        else:
            assert pending.expected_s is not None and 0 < pending.expected_s < 5.0
        pending.wait()
        got = view_tensors(receiver_pool, slot, staged.manifest, torch_tensors=True)
        assert torch.equal(got["latents"], tensors["latents"])
        pool.free(staged.allocation)
        receiver_pool.free(slot)
