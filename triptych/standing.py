"""Standing receive slots: how many a receiver keeps, the one rule head and worker share.

A receiver keeps a slot as standing (reused for its later transfers, assigned by the head without
a transfer_alloc round trip) while it holds fewer than its capacity and its pool still has room,
after them, to stage outputs and take one more slot (docs/design.md, "Standing receive slots").
"""

from __future__ import annotations


def room_for_standing(held: int, capacity: int, pool_bytes: int, nbytes: int) -> bool:
    """Whether a receiver holding `held` standing slots keeps one more of `nbytes`."""
    return held < capacity and pool_bytes >= (held + 2) * nbytes
