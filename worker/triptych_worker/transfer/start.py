"""A worker's transfer layer started: its Mooncake engine and its registered pool, or one line saying
why not.

Both start after the model loads. What Mooncake refuses then (its engine's start; the pool's
registration, which RDMA pins: the memlock limit) is a ConfigError with Mooncake's words, which
`triptych serve` prints as one line, not a traceback.
"""

from __future__ import annotations

from triptych.config import ConfigError, ServeArgs

from .engine import MooncakeTransport
from .errors import TransferError
from .pool import PoolMemory, TransferPool


def start_transfer(args: ServeArgs, memory: PoolMemory) -> tuple[MooncakeTransport, TransferPool]:
    """The engine on --disagg-p2p-hostname (--disagg-ib-device) and the pool of --disagg-transfer-pool-size
    registered with it; the engine is closed again when the pool cannot be registered."""
    try:
        transport = MooncakeTransport(args.disagg_p2p_hostname, args.disagg_ib_device)
    except TransferError as exc:
        raise ConfigError(str(exc)) from None
    try:
        role = args.disagg_role.value
        return transport, TransferPool(args.disagg_transfer_pool_size, role=role, transport=transport, memory=memory)
    except TransferError as exc:
        transport.close()
        raise ConfigError(str(exc)) from None
