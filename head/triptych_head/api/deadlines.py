"""A request's deadline as the client gives it, and the estimate an accepted request is told.

The deadline is seconds from the request's arrival: the body's `deadline_seconds` (the request
contract) or the `X-Deadline-Seconds` header (for clients that cannot add a body field); with both,
the earlier counts. Without either it is the request timeout (--disagg-timeout), and neither can be
later than it: the head gives no request more time than that. admission.py decides with it.

An accepted request's estimate (seconds until it completes, from its arrival) comes back in the
`X-Estimated-Completion-Seconds` response header (images, edits, the POST of a video job) and in
the video job's `estimated_completion_seconds`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import overload

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from triptych.contract import MAX_DEADLINE_S, MIN_DEADLINE_S
from triptych_head.api.errors import APIError
from triptych_head.deadline import Estimate

FIELD = "deadline_seconds"
HEADER = "X-Deadline-Seconds"
ESTIMATE_HEADER = "X-Estimated-Completion-Seconds"


@dataclass(frozen=True)
class Deadline:
    seconds: float  # from the request's arrival
    param: str | None  # the field or header it came from (a 429 names it); None: the request timeout


def requested_deadline(request: Request, body_value: float | None, timeout_s: float) -> Deadline:
    """The request's deadline; 400 naming the header for one outside the body field's limits (the
    contract's, checked with the rest of the body for the field)."""
    given: list[Deadline] = []
    if body_value is not None:
        given.append(Deadline(body_value, FIELD))
    raw = request.headers.get(HEADER)
    if raw is not None:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and MIN_DEADLINE_S <= seconds <= MAX_DEADLINE_S):
            raise APIError(
                400,
                f"{HEADER} {raw[:80]!r} must be a number of seconds from {MIN_DEADLINE_S:g} to "
                f"{MAX_DEADLINE_S:g}, e.g. 30",
                HEADER,
            )
        given.append(Deadline(seconds, HEADER))
    earliest = min(given, key=lambda d: d.seconds, default=Deadline(timeout_s, None))
    return Deadline(min(earliest.seconds, timeout_s), earliest.param)


def estimate_seconds(estimate: Estimate | None) -> float | None:
    """What an admission's estimate says for the header (None without one)."""
    return None if estimate is None else estimate.seconds


@overload
def with_estimate(answer: Response, seconds: float | None, more: dict[str, str] | None = None) -> Response: ...
@overload
def with_estimate(
    answer: BaseModel | Response, seconds: float | None, more: dict[str, str] | None = None
) -> BaseModel | Response: ...
def with_estimate(
    answer: BaseModel | Response, seconds: float | None, more: dict[str, str] | None = None
) -> BaseModel | Response:
    """`answer` carrying the estimate header (none without an estimate: monolithic mode, a replay) and
    the `more` headers given."""
    headers = {**(more or {}), **({} if seconds is None else {ESTIMATE_HEADER: f"{seconds:.3f}"})}
    if not headers:
        return answer
    if isinstance(answer, Response):
        answer.headers.update(headers)
        return answer
    return JSONResponse(answer.model_dump(mode="json"), headers=headers)
