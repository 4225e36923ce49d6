"""Where each rank sits in a role's parallel degrees, as pure arithmetic (no torch).

A role with `--num-gpus N = cfg x sp x tp` and `sp = ulysses x ring` numbers its ranks so that the
TP degree is innermost, then Ulysses: rank = (cfg_index * sp + shard) * tp + tp_index, where a
rank's sequence shard is `ring_index * ulysses + ulysses_index`, so a Ulysses all-to-all joins
neighbouring shards into one contiguous block, and the ring passes whole blocks around. The ranks
of a TP group (the most traffic: an all-reduce per layer) are neighbours. With tp 1 a rank's
number is `cfg_index * sp + shard`.
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
        return rank // (self.degrees.sp * self.degrees.tp)

    def shard(self, rank: int) -> int:
        """Which sequence shard `rank` holds (0..sp-1)."""
        return (rank // self.degrees.tp) % self.degrees.sp

    def tp_index(self, rank: int) -> int:
        """Which shard of the heads and MLPs `rank` holds (0..tp-1)."""
        return rank % self.degrees.tp

    def _rank(self, cfg_index: int, shard: int, tp_index: int) -> int:
        return (cfg_index * self.degrees.sp + shard) * self.degrees.tp + tp_index

    def ring_index(self, rank: int) -> int:
        return self.shard(rank) // self.degrees.ulysses

    def ulysses_index(self, rank: int) -> int:
        return self.shard(rank) % self.degrees.ulysses

    def sp_groups(self) -> list[list[int]]:
        """Ranks that share one sequence (one CFG branch, one TP shard), in shard order."""
        d = self.degrees
        return [[self._rank(c, s, t) for s in range(d.sp)] for c in range(d.cfg) for t in range(d.tp)]

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
        d = self.degrees
        return [[self._rank(c, s, t) for c in range(d.cfg)] for s in range(d.sp) for t in range(d.tp)]

    def tp_groups(self) -> list[list[int]]:
        """Ranks that split one shard's heads and MLPs between them, in TP order."""
        d = self.degrees
        return [[self._rank(c, s, t) for t in range(d.tp)] for c in range(d.cfg) for s in range(d.sp)]
