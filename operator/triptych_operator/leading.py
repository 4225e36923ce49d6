"""Which operator replica acts, for the loops of its own that kopf does not pause.

With several replicas (`--peering NAME`) kopf pauses every replica but the one with the highest
priority among the live peers of the peering object NAME: it stops their watches and handlers. The
scale-to-zero loop (wake.py) is this operator's own task, which kopf neither knows of nor pauses, so
a replica that lost the lead would go on scaling Deployments from its frozen watch and the spec it
last saw. Before each pass the loop asks `Leadership.leads`: the peering object read now, and kopf's
own rule applied to it (`leads`): any other live peer with a priority as high as this one's (kopf
pauses both of an equal pair) means this replica stands by. A standalone operator (no peering)
always leads.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triptych_operator import kube

log = logging.getLogger(__name__)

# kopf's default lifetime of a peer's keep-alive when the peering object does not say.
DEFAULT_LIFETIME_S = 60


def leads(
    peers: Mapping[str, Mapping[str, Any]], identity: str, priority: int, now: datetime.datetime | None = None
) -> bool:
    """Whether the replica `identity` of `priority` works, as kopf decides it from the peering object's
    status (`peers`: identity -> {priority, lifetime, lastseen}): no other live peer has a priority as
    high. A peer is live until `lifetime` seconds after `lastseen`."""
    now = now or datetime.datetime.now(datetime.UTC)
    for peer, info in peers.items():
        if peer == identity or not isinstance(info, Mapping):
            continue
        lifetime = datetime.timedelta(seconds=int(info.get("lifetime") or DEFAULT_LIFETIME_S))
        seen = info.get("lastseen")
        try:
            last = datetime.datetime.fromisoformat(str(seen)) if seen else now
        except ValueError:
            last = now  # unreadable: taken for live, as kopf takes a peer without one
        if last.tzinfo is None:
            last = last.replace(tzinfo=datetime.UTC)
        if last + lifetime > now and int(info.get("priority") or 0) >= priority:
            return False
    return True


@dataclass
class Leadership:
    """This replica's place among its peers: `peering` (the peering object's name; None: standalone),
    its kopf `identity` and `priority`; `clusterwide`: a ClusterKopfPeering, else each namespace's
    KopfPeering."""

    peering: str | None = None
    identity: str = ""
    priority: int = 0
    clusterwide: bool = True
    _said: dict[str, str] = field(default_factory=dict)  # per scope: the last reason logged

    async def leads(self, namespace: str) -> bool:
        """Whether this replica acts on `namespace`'s pipelines now; False when the peering object cannot
        be read (two replicas acting on a guess could fight over a Deployment's replicas)."""
        if self.peering is None:
            return True
        scope = "" if self.clusterwide else namespace
        try:
            peers = await kube.run(kube.peering_status, self.peering, scope or None)
        except Exception as exc:  # an API error: nothing this pass; the next reads again
            self._note(scope, f"cannot read the peering object {self.peering}: {exc}; standing by")
            return False
        if peers is None:
            self._note(scope, f"no peering object {self.peering}; standing by")
            return False
        leading = leads(peers, self.identity, self.priority)
        self._note(scope, "this replica leads" if leading else "another replica leads; standing by")
        return leading

    def _note(self, scope: str, why: str) -> None:
        """A log line when the reason for `scope` changes, not every pass."""
        if self._said.get(scope) != why:
            self._said[scope] = why
            log.info("scale to zero%s: %s", f" in {scope}" if scope else "", why)
