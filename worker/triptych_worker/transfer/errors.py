"""Errors the transfer layer raises; each message says what to change."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A Mooncake engine call failed (initialize, register or write)."""


class TransferStalled(TransferError):
    """A write did not finish in time; Mooncake may still be reading its source bytes."""


class MooncakeNotInstalled(ImportError):
    """The mooncake package is missing from this environment."""

    def __init__(self, cause: str) -> None:
        super().__init__(
            "disaggregated serving needs the Mooncake transfer engine, which failed to import "
            f"({cause}). Install it with `pip install mooncake-transfer-engine` (CUDA hosts) or "
            "`pip install mooncake-transfer-engine-non-cuda` (CPU/TCP only), plus the system libraries "
            "`apt-get install libibverbs1 librdmacm1 libnuma1 libcurl4`."
        )


class PayloadTooLarge(ValueError):
    """A payload can never fit in the transfer pool, however much of it is free."""

    def __init__(self, nbytes: int, pool_bytes: int, role: str) -> None:
        super().__init__(
            f"payload of {nbytes} bytes exceeds --disagg-transfer-pool-size ({pool_bytes} bytes); "
            f"raise the flag on the {role} workers"
        )
        self.nbytes = nbytes
        self.pool_bytes = pool_bytes
        self.role = role
