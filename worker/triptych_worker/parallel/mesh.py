"""A role's ranks joined with torch.distributed: the process groups each kind of parallelism uses.

Every rank of a role runs on one host (one pod), so the rendezvous is on loopback at
`--master-port` (rank 0 serves torch.distributed's store there, bound to 127.0.0.1 only:
rendezvous_store): gloo on CPU, NCCL on CUDA, whose own listeners stay on loopback too
(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME). Collectives are timed, so that a job can report how
much of its time went to communication.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from triptych.parallelism import Parallelism
from triptych_worker.parallel.layout import RankLayout

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    import torch.distributed as dist

# Idle followers wait for the next job in a broadcast on the default group, for as long as the
# worker lives; dead peers are noticed by the rank watchdog (process exit) and by gloo/NCCL
# connection errors, not by this timeout. Nothing else uses the default group.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# A collective inside a job that waits this long has lost a peer that is still alive (hung): every
# group a job uses has it, the world group included (RankMesh.world_group).
STEP_TIMEOUT = datetime.timedelta(seconds=300)


def rendezvous_store(rank: int, world_size: int, master_port: int) -> dist.Store:
    """torch.distributed's store, served by rank 0 at 127.0.0.1:`master_port`: its listening socket is
    bound here, on loopback, and handed over (`init_method="tcp://..."` makes the store bind every
    address, whatever host it names, where anyone who reaches the port could read and write the
    ranks' keys). The other ranks connect to it, waiting for it as long as the idle timeout."""
    import torch.distributed as dist

    listen_fd = None
    if rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", master_port))
            sock.listen(world_size * 4)
        except OSError as exc:
            sock.close()
            raise OSError(
                exc.errno, f"--master-port {master_port} on 127.0.0.1 (the ranks' rendezvous): {exc.strerror}"
            ) from None
        listen_fd = sock.detach()  # the store owns it from here
    return dist.TCPStore(
        "127.0.0.1", master_port, world_size, rank == 0, timeout=IDLE_TIMEOUT, master_listen_fd=listen_fd
    )


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


# A point-to-point operation: dist.isend or dist.irecv, its tensor, the peer's (global) rank, a tag.
P2P = tuple["Callable[..., Any]", "torch.Tensor", int, int]


def exchange(ops: list[P2P], group: dist.ProcessGroup | None) -> None:
    """Run sends and receives as one batch and wait for them all. NCCL runs a batch's operations together;
    issued one by one, a send larger than its buffer (4 MiB) waits for the peer's receive, which two ranks
    that each send first queue behind their own send: a ring of two, or neighbours swapping halos, hang.
    Gloo (the CPU) runs them one by one either way."""
    import torch.distributed as dist

    if not ops:
        return
    for work in dist.batch_isend_irecv([dist.P2POp(op, t, peer, group, tag) for op, t, peer, tag in ops]):
        work.wait()


@dataclass
class CommTimer:
    """Seconds spent in collectives since the last reset (this rank's view)."""

    seconds: float = 0.0

    def reset(self) -> None:
        self.seconds = 0.0


@dataclass
class RankMesh:
    """This rank's place among the role's ranks and the groups it communicates in."""

    rank: int
    layout: RankLayout
    device: str
    world_group: dist.ProcessGroup | None = None  # every rank, STEP_TIMEOUT: what a job's world-wide collectives use
    sp_group: dist.ProcessGroup | None = None
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    cfg_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    sp_ranks: list[int] = field(default_factory=list)
    ring_ranks: list[int] = field(default_factory=list)
    comm: CommTimer = field(default_factory=CommTimer)

    @property
    def degrees(self) -> Parallelism:
        return self.layout.degrees

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @classmethod
    def join(cls, rank: int, degrees: Parallelism, device: str, master_port: int) -> RankMesh:
        """Rendezvous with the role's other ranks on loopback and build the groups (every rank calls this)."""
        import torch.distributed as dist

        layout = RankLayout(degrees)
        # All ranks share one host: talk over loopback unless the deployment chose an interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        if device.startswith("cuda"):
            import torch

            torch.cuda.set_device(device)
        dist.init_process_group(
            backend_for(device),
            store=rendezvous_store(rank, layout.world_size, master_port),
            rank=rank,
            world_size=layout.world_size,
            timeout=IDLE_TIMEOUT,
        )
        mesh = cls(rank=rank, layout=layout, device=device)
        # Every rank creates every group, in the same order (torch.distributed requires it).
        world = dist.new_group(list(range(layout.world_size)), timeout=STEP_TIMEOUT)
        mesh.world_group = cast("dist.ProcessGroup", world)  # every rank is a member
        for name, groups in (
            ("sp", layout.sp_groups()),
            ("ulysses", layout.ulysses_groups()),
            ("ring", layout.ring_groups()),
            ("cfg", layout.cfg_groups()),
            ("tp", layout.tp_groups()),
        ):
            for ranks in groups:
                group = dist.new_group(ranks, timeout=STEP_TIMEOUT)
                if rank in ranks:
                    setattr(mesh, f"{name}_group", group)
                    if name == "sp":
                        mesh.sp_ranks = ranks
                    if name == "ring":
                        mesh.ring_ranks = ranks
        return mesh

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # --- collectives (timed) ---------------------------------------------------------------

    def _in_job(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The group a job's collective runs in: None is every rank, the world group (never the
        default group, whose timeout is the idle wait's)."""
        return group if group is not None else self.world_group

    def all_gather_cat(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
        """Concatenate every group member's `tensor` along `dim`, in group order (None: every rank's)."""
        import torch
        import torch.distributed as dist

        started = time.perf_counter()
        tensor = tensor.contiguous()
        group = self._in_job(group)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        self.comm.seconds += time.perf_counter() - started
        return torch.cat(parts, dim=dim)

    def all_reduce_sum(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The sum of every group member's `tensor` (a new tensor; None: every rank's)."""
        import torch.distributed as dist

        started = time.perf_counter()
        total = tensor.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._in_job(group))
        self.comm.seconds += time.perf_counter() - started
        return total

    def all_to_all(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Exchange the first-dimension chunks of `tensor`: chunk j goes to member j, which sends back its chunk."""
        import torch
        import torch.distributed as dist

        started = time.perf_counter()
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor, group=self._in_job(group))
        self.comm.seconds += time.perf_counter() - started
        return out

    def ring_shift(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send `tensors` to the next rank of this rank's ring and return what the previous one sent."""
        import torch
        import torch.distributed as dist

        started = time.perf_counter()
        ring = self.ring_ranks
        me = ring.index(self.rank)
        to, frm = ring[(me + 1) % len(ring)], ring[(me - 1) % len(ring)]
        received = [torch.empty_like(t) for t in tensors]
        sends = [(dist.isend, t.contiguous(), to, 0) for t in tensors]
        exchange(sends + [(dist.irecv, r, frm, 0) for r in received], self.ring_group)
        self.comm.seconds += time.perf_counter() - started
        return received

    def exchange_edges(
        self, first: torch.Tensor, last: torch.Tensor, ranks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Along the chain `ranks`: send `first` to the previous rank and `last` to the next one; return
        (the previous rank's `last`, the next rank's `first`), zeros where the chain ends."""
        import torch
        import torch.distributed as dist

        started = time.perf_counter()
        me = ranks.index(self.rank)
        before = torch.zeros_like(last)
        after = torch.zeros_like(first)
        ops: list[P2P] = []
        if me > 0:
            ops += [(dist.isend, first.contiguous(), ranks[me - 1], 1), (dist.irecv, before, ranks[me - 1], 2)]
        if me < len(ranks) - 1:
            ops += [(dist.isend, last.contiguous(), ranks[me + 1], 2), (dist.irecv, after, ranks[me + 1], 1)]
        exchange(ops, self.world_group)
        self.comm.seconds += time.perf_counter() - started
        return before, after
