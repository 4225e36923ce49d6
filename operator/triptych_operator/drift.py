"""Whether a child must be applied: `(desired manifest, live object, what we last applied) -> bool`.

The API server fills defaults and normalizes values (quantities, int-or-string), so a live object
never equals the manifest it came from. What is compared instead is the live object *projected*
onto the manifest's shape: only the fields the operator sets, lists compared by position and
length. Right after an apply the operator records two digests: of the manifest, and of the
projection of the server's answer. Later, the child needs an apply only when the manifest changed
(a new spec) or its projection changed (someone edited a field the operator owns). A status update,
a controller's annotation or a field the operator never sets changes neither, so they cost nothing.

Every manifest carries its own digest as an annotation (`stamp`), so a field the new manifest no
longer sets (a removed nodeSelector, an Ingress's TLS) still makes the projection differ: a server-side
apply of the new manifest is what removes it.

Without a record (the operator restarted), a child whose projection equals the manifest exactly is
taken as applied; one that differs, even only by server normalization or by the digest of an older
manifest, is applied once and recorded. So a restart re-applies at most what normalization hides,
and catches spec and hand edits made while the operator was down.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triptych_operator.constants import MANIFEST_ANNOTATION


def projection(desired: Any, live: Any) -> Any:
    """`live` restricted to the keys `desired` sets, recursively; list lengths always count."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return live
        return {key: projection(value, live.get(key)) for key, value in desired.items()}
    if isinstance(desired, list):
        if not isinstance(live, list):
            return live
        return [projection(d, item) for d, item in zip(desired, live, strict=False)] + live[len(desired) :]
    return live


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def stamp(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with its digest in an annotation (in place): the live object tells which manifest
    was applied last, also to an operator that has no record of it."""
    annotations = manifest["metadata"].setdefault("annotations", {})
    annotations.pop(MANIFEST_ANNOTATION, None)
    annotations[MANIFEST_ANNOTATION] = digest(manifest)[:32]
    return manifest


@dataclass(frozen=True)
class Applied:
    """What one child looked like the last time the operator applied (or verified) it."""

    desired: str  # digest of the manifest
    live: str  # digest of the server's answer, projected onto the manifest
    resource_version: str = ""  # of that answer: the same version later cannot have drifted


def record(desired: Mapping[str, Any], live: Mapping[str, Any], desired_digest: str | None = None) -> Applied:
    """The record to keep after applying `desired` (its digest, if the caller has it) and getting `live` back."""
    return Applied(
        desired=desired_digest or digest(desired),
        live=digest(projection(desired, live)),
        resource_version=str(live["metadata"].get("resourceVersion") or ""),
    )


def unchanged(applied: Applied | None, desired_digest: str, live: Mapping[str, Any] | None) -> bool:
    """True when `live` is the very version recorded for this manifest: no comparison needed.

    A pipeline's reconcile looks at all its children on any child's event; this keeps the others free.
    """
    return (
        applied is not None
        and live is not None
        and applied.desired == desired_digest
        and bool(applied.resource_version)
        and live["metadata"].get("resourceVersion") == applied.resource_version
    )


def needs_apply(desired: Mapping[str, Any], live: Mapping[str, Any] | None, applied: Applied | None) -> bool:
    """True when the child is missing, its manifest changed, or a field the operator sets was edited."""
    if live is None:
        return True
    if applied is not None:  # the manifest changed since the record: applied, whatever the live object holds
        return applied.desired != digest(desired) or digest(projection(desired, live)) != applied.live
    return projection(desired, live) != desired
