"""A request's priority as the client asks for it, checked against its API key's ceiling.

The body's `priority` (triptych.priority: low, normal or high; default normal) orders the
DiffusionServer's queues and lets a request suspend a lower one's denoising (preemption.py). With
--api-keys-file, each key has a ceiling (`max_priority=` after the key; normal for a key without
one, auth.py): a request asking for more gets 403 `priority_not_allowed`, naming `priority` and the
ceiling; it is refused rather than lowered, so that a client never believes it got what it asked.
Without --api-keys-file the API is open and any level is taken.
"""

from __future__ import annotations

from fastapi import Request

from triptych import priority
from triptych_head.api.auth import MAX_PRIORITY
from triptych_head.api.errors import APIError


def requested_priority(request: Request, body_value: str | None) -> int:
    """The request's priority level; 403 when its API key's ceiling is lower (the body's value
    itself is one of the levels: the contract checks it with the rest of the body)."""
    asked = body_value or priority.DEFAULT
    ceiling = getattr(request.state, MAX_PRIORITY, None)  # None: no API keys, no ceiling
    if ceiling is not None and priority.level(asked) > priority.level(ceiling):
        raise APIError(
            403,
            f"priority {asked!r} is above this API key's ceiling {ceiling!r} ({MAX_PRIORITY} in --api-keys-file); "
            f"ask for {ceiling!r} or lower, or for a key allowed more",
            priority.FIELD,
            code="priority_not_allowed",
        )
    return priority.level(asked)
