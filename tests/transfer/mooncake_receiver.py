"""Receiving peer for the Mooncake tests, run as its own process; talks JSON lines on stdin/stdout.

Prints {"session", "slot_addr", "slot_nbytes"} once its pool and slot are ready, then waits for
one line: a manifest to load out of the slot (answered with each tensor's dtype, shape and sha256
of its bytes), or null to exit without loading. Mooncake's own logging goes to stderr.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from triptych_worker.transfer import MooncakeTransport, TransferPool, load_tensors


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    pool_bytes, slot_bytes = int(sys.argv[1]), int(sys.argv[2])
    with MooncakeTransport("127.0.0.1", None) as transport:
        pool = TransferPool(pool_bytes, "denoiser", transport)
        slot = pool.allocate(slot_bytes, "req-1")
        assert slot is not None
        hello = {"session": transport.session_id, "slot_addr": slot.addr, "slot_nbytes": slot.nbytes}
        print(json.dumps(hello), flush=True)
        manifest = json.loads(sys.stdin.readline() or "null")
        if manifest is None:
            return
        tensors = load_tensors(pool, slot, manifest, "cpu")
        pool.free(slot)
        report = {
            name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": digest(t)}
            for name, t in tensors.items()
        }
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
