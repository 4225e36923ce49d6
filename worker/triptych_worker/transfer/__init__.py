"""Tensor transfer between workers: a registered pool, staging into it, Mooncake writes out of it.

Flow: the sender stages its output tensors into its pool (stage_tensors; on TCP, CPU outputs are
registered where they are instead: stage_in_place), the head reserves a
slot in the receiver's pool and tells the sender the receiver's session and slot address, the
sender writes the staged bytes there (MooncakeTransport.submit_write), and the receiver loads the
tensors out of its slot (load_tensors) and frees it, or uses them in place (view_tensors, the slot
held until the stage is done: TransferPool.hold).
"""

from .allocator import ALIGNMENT
from .engine import MooncakeTransport, NoTransport, PendingWrite, check_rdma_device
from .errors import MooncakeNotInstalled, PayloadTooLarge, TransferError, TransferStalled
from .in_place import InPlaceTensors, stage_in_place
from .pool import Allocation, MemoryRegistrar, TransferPool
from .tensors import StagedTensors, check_manifest, layout, load_tensors, stage_tensors, view_tensors
from .waiting import precise_sleeps

__all__ = [
    "ALIGNMENT",
    "Allocation",
    "InPlaceTensors",
    "MemoryRegistrar",
    "MooncakeNotInstalled",
    "MooncakeTransport",
    "NoTransport",
    "PayloadTooLarge",
    "PendingWrite",
    "StagedTensors",
    "TransferError",
    "TransferPool",
    "TransferStalled",
    "check_manifest",
    "check_rdma_device",
    "layout",
    "load_tensors",
    "precise_sleeps",
    "stage_in_place",
    "stage_tensors",
    "view_tensors",
]
