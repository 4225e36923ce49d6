"""Where each rank sits in a role's parallel degrees, as pure arithmetic (no torch).

A role with `--num-gpus N = cfg x sp` and `sp = ulysses x ring` numbers its ranks so that the
Ulysses degree is innermost: rank = cfg_index * sp + ring_index * ulysses + ulysses_index.
A rank's sequence shard is `ring_index * ulysses + ulysses_index`, so a Ulysses all-to-all joins
neighbouring shards into one contiguous block, and the ring passes whole blocks around.
"""

from __future__ import annotations

from dataclasses import dataclass

from triptych.parallelism import Parallelism


@dataclass(frozen=True)
class RankLayout:
    degrees: Parallelism

    @property
    def world_size(self) -> int:
        d = self.degrees
        return d.cfg * d.sp * d.tp

    def cfg_index(self, rank: int) -> int:
        return rank // self.degrees.sp

    def shard(self, rank: int) -> int:
        """Which sequence shard `rank` holds (0..sp-1)."""
        return rank % self.degrees.sp

    def ring_index(self, rank: int) -> int:
        return self.shard(rank) // self.degrees.ulysses

    def ulysses_index(self, rank: int) -> int:
        return self.shard(rank) % self.degrees.ulysses

    def sp_groups(self) -> list[list[int]]:
        """Ranks that share one sequence (one CFG branch), in shard order."""
        sp = self.degrees.sp
        return [[c * sp + s for s in range(sp)] for c in range(self.degrees.cfg)]

    def ulysses_groups(self) -> list[list[int]]:
        """Ranks whose shards an all-to-all joins into one block of the sequence."""
        d = self.degrees
        return [[g[r * d.ulysses + u] for u in range(d.ulysses)] for g in self.sp_groups() for r in range(d.ring)]

    def ring_groups(self) -> list[list[int]]:
        """Ranks that pass key/value blocks around a ring, in ring order."""
        d = self.degrees
        return [[g[r * d.ulysses + u] for r in range(d.ring)] for g in self.sp_groups() for u in range(d.ulysses)]

    def cfg_groups(self) -> list[list[int]]:
        """Ranks that hold the same shard of different guidance branches, in branch order."""
        sp = self.degrees.sp
        return [[c * sp + s for c in range(self.degrees.cfg)] for s in range(sp)]
