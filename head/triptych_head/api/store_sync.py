"""How a head's periodic exchange with the shared store is going, for the exchanges that keep running
through an outage with what they know (key quotas, key limits over every head).

    health = SyncHealth(errors, "key quotas", "sync the counts")
    try: ...exchange...
    except Exception as exc: health.failed(exc, objects.description); return
    health.succeeded(objects.description)

Every failure is counted (`errors`, a Prometheus counter); the first of a run of them is logged as a
warning and the recovery after it once, so an outage is two lines in the log, not one per sync.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class SyncHealth:
    def __init__(self, errors: Any, subject: str, action: str):
        self.errors = errors
        self.subject = subject  # whose exchange: "key quotas"
        self.action = action  # what it does: "sync the counts"
        self.failing = False

    def failed(self, exc: Exception, store: str) -> None:
        self.errors.inc()
        if not self.failing:
            log.warning("%s: cannot %s with %s (%s); going on with those known", self.subject, self.action, store, exc)
        self.failing = True

    def succeeded(self, store: str) -> None:
        if self.failing:
            log.info("%s: can %s with %s again", self.subject, self.action, store)
        self.failing = False
