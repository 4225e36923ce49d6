"""Request priority: the named levels a request may carry and the number the head schedules by.

A request says `priority` in its body: low, normal (the default) or high. The head dispatches a
waiting request of a higher level before lower ones and, with --disagg-preemption on, suspends the
lowest-priority running denoise for it when every denoiser is busy (head/triptych_head/preemption.py;
docs/serving.md#priority-and-preemption). An API key may carry a ceiling (`max_priority=` in
--api-keys-file); a request above its key's ceiling is refused with 403, naming both.
"""

from __future__ import annotations

LOW, NORMAL, HIGH = "low", "normal", "high"
LEVELS: tuple[str, ...] = (LOW, NORMAL, HIGH)  # in increasing order: the level is the index
DEFAULT = NORMAL
FIELD = "priority"


def level(name: str) -> int:
    """The number a named level schedules by (low 0, normal 1, high 2); ValueError for another name."""
    try:
        return LEVELS.index(name)
    except ValueError:
        raise ValueError(f"{FIELD} {name!r} is not one of {', '.join(LEVELS)}") from None


def name(value: int) -> str:
    """The named level of `value` (levels past the highest, reached by aging, are named high)."""
    return LEVELS[min(max(value, 0), len(LEVELS) - 1)]


DEFAULT_LEVEL = level(DEFAULT)
