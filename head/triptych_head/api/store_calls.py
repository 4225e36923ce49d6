"""The shared result store as the API calls it: a store that does not answer (an S3 error, an
unreachable endpoint, a full disk) is a 503 `store_unavailable` with Retry-After, naming what was
asked of it, never a bare 500. An object that is not there is the caller's to answer (a 404)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from triptych_head.api.errors import APIError
from triptych_head.objects import ObjectMissing

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_AFTER_S = 1
PASSED_ON = (APIError, ObjectMissing, FileNotFoundError)  # answers of their own, not the store failing


def store_unavailable(what: str) -> APIError:
    """The answer when the result store did not answer `what` ("for video X", ...)."""
    return APIError(
        503,
        f"the result store did not answer {what}; retry",
        code="store_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def from_store(what: str, call: Callable[..., T], *args: Any) -> T:
    """`call(*args)` on a thread: its answer; a failure of the store a 503 naming `what` (logged)."""
    try:
        return await asyncio.to_thread(call, *args)
    except PASSED_ON:
        raise
    except Exception as exc:
        log.warning("the result store failed %s: %s", what, exc)
        raise store_unavailable(what) from None
