"""Each pod's requests and limits, checked as the API server checks a container's (ValidateResourceRequirements in
kubernetes pkg/apis/core/validation), so that a bad one makes the pipeline Invalid naming its CR field rather than
the API server refusing the child Deployment. Each quantity's grammar is the declaration's (fields.QUANTITY_PATTERN);
here, each resource's name, and each resource against its limit and the rules of its kind:

    any resource        a name a container may ask for (validateContainerResourceName): cpu, memory,
                        ephemeral-storage, hugepages-<size>, or a domain/name: the domain a lowercase DNS name, the
                        name at most 63 letters, digits, '-', '_' or '.' between a letter or digit at each end;
                        and its request at most its limit
    extended resource   a name in a domain other than kubernetes.io (nvidia.com/gpu, rdma/ib), not beginning with
                        requests. (a ResourceQuota's names, requests.nvidia.com/gpu): a whole number, and
                        never overcommitted: its request equal to its limit, and none without one (a limit alone is
                        the request too)
    huge pages          hugepages-<page size>: a whole number of pages, never overcommitted either, and only beside
                        a cpu or memory request or limit
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Set
from decimal import MAX_EMAX, ROUND_CEILING, Decimal, localcontext
from typing import Any

from triptych_operator.fields import QUANTITY_PATTERN, key_path, quantity_value
from triptych_operator.spec.model import SpecError

HUGE_PAGES = "hugepages-"
NATIVE_DOMAIN = "kubernetes.io/"  # a name without a domain is in it too
STANDARD = frozenset({"cpu", "memory", "ephemeral-storage"})  # and HUGE_PAGES<size> (IsStandardContainerResourceName)
QUOTA_PREFIX = "requests."  # a ResourceQuota's; the API server reads requests.<extended name> as one of them
# A qualified name's parts (IsQualifiedName in k8s.io/apimachinery): the domain a DNS-1123 subdomain of at most
# 253 characters, the name at most 63.
DOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
WRITE_A_NAME = (
    "write a standard name (cpu, memory, ephemeral-storage, hugepages-<size>) or a device plugin's domain/name "
    "such as nvidia.com/gpu"
)


def check_resources(resources: Mapping[str, Any] | None, where: str, owned: Collection[str] = ()) -> None:
    """`where`.resources as the API server checks a container's; `owned`: the names whose counts the operator sets
    itself on the pod, whatever the spec says (manifests/parts.container_resources), left out."""
    given = resources or {}
    requests = {name: q for name, q in (given.get("requests") or {}).items() if name not in owned}
    limits = {name: q for name, q in (given.get("limits") or {}).items() if name not in owned}
    for kind, quantities in (("limits", limits), ("requests", requests)):
        for name, quantity in quantities.items():
            path = key_path(f"{where}.resources.{kind}", name)
            check_resource_name(name, path)
            _check_quantity(name, quantity, path)
    for name, request in requests.items():
        _check_against_limit(name, request, limits.get(name), where)
    _check_huge_pages_beside_cpu_or_memory(requests.keys() | limits.keys(), where)


def _extended(name: str) -> bool:
    """A name outside Kubernetes' own (not helper.IsNativeResource), e.g. a device plugin's."""
    return "/" in name and NATIVE_DOMAIN not in name


def _never_overcommitted(name: str) -> str | None:
    """Why `name` may not be overcommitted (not helper.IsOvercommitAllowed), or None where it may."""
    if name.startswith(HUGE_PAGES):
        return "huge pages"
    return "an extended resource" if _extended(name) else None


def check_resource_name(name: str, path: str) -> None:
    """A name the API server takes for a container's resource (validateContainerResourceName)."""
    if "/" not in name:  # in kubernetes.io: one of its standard names
        if not (name in STANDARD or name.startswith(HUGE_PAGES)) or not _name_part(name):
            raise SpecError(path, f"is {name!r}, not a resource a container may ask for: {WRITE_A_NAME}")
        return
    domain, _, local = name.partition("/")
    # an extended name must still be a qualified name as requests.<name>, so its domain is that much shorter
    longest_domain = 253 - len(QUOTA_PREFIX) if _extended(name) else 253
    if not (len(domain) <= longest_domain and DOMAIN.fullmatch(domain) and _name_part(local)):
        raise SpecError(
            path,
            f"is {name!r}, not a resource name: a domain/name has a lowercase DNS domain (letters, digits, '-' and "
            "'.') and a name of at most 63 letters, digits, '-', '_' or '.' that begins and ends with a letter or "
            f"digit; {WRITE_A_NAME}",
        )
    if _extended(name) and name.startswith(QUOTA_PREFIX):
        raise SpecError(
            path,
            f"is {name!r}; the {QUOTA_PREFIX} prefix makes it a ResourceQuota's name, not a container's: "
            f"write {name.removeprefix(QUOTA_PREFIX)}",
        )


def _name_part(name: str) -> bool:
    return len(name) <= 63 and NAME.fullmatch(name) is not None


def _whole(number: Decimal) -> bool:
    return number == number.to_integral_value()


def _check_quantity(name: str, quantity: int | str, path: str) -> None:
    if _extended(name) and not _whole(quantity_value(quantity)):
        raise SpecError(
            path,
            f"is {quantity!r}, not a whole number; {name} is an extended resource, counted in whole units (a device "
            "plugin's devices): write a whole number such as 1",
        )
    if name.startswith(HUGE_PAGES):
        _check_whole_pages(name, quantity, path)


def _check_whole_pages(name: str, quantity: int | str, path: str) -> None:
    """A whole number of the pages the name sizes (helper.IsHugePageResourceValueDivisible)."""
    size = name.removeprefix(HUGE_PAGES)
    page = quantity_value(size) if re.fullmatch(QUANTITY_PATTERN, size, re.ASCII) else Decimal(0)
    if page <= 0 or not _whole(page):
        raise SpecError(
            path, f"{name!r} names no page size: write hugepages-<size> with a size the nodes offer, e.g. hugepages-2Mi"
        )
    byte_count = quantity_value(quantity).to_integral_value(ROUND_CEILING)  # as Quantity.Value() reads it
    with localcontext() as ctx:
        ctx.Emax = MAX_EMAX  # a quantity may be as large as 1e999999999
        pages = byte_count / page
    if not _whole(pages):
        raise SpecError(path, f"is {quantity!r}, not a whole number of {size} pages: write a multiple of {size}")


def _check_against_limit(name: str, request: int | str, limit: int | str | None, where: str) -> None:
    path, limit_path = key_path(f"{where}.resources.requests", name), key_path(f"{where}.resources.limits", name)
    why = _never_overcommitted(name)
    if limit is None:
        if why is not None:
            raise SpecError(
                path,
                f"is {request!r} without a limit; {name} may not be overcommitted ({why}), so it needs a limit "
                f"equal to its request: set {limit_path} to {request!r}, or write only the limit (the request "
                "defaults to it)",
            )
        return
    if why is not None and quantity_value(request) != quantity_value(limit):
        raise SpecError(
            path,
            f"is {request!r}, not its limit {limit!r} ({limit_path}); {name} may not be overcommitted ({why}), so its "
            "request must equal its limit: write the same value, or only the limit (the request defaults to it)",
        )
    if quantity_value(request) > quantity_value(limit):
        raise SpecError(
            path,
            f"is {request!r}, above its limit {limit!r} ({limit_path}); "
            "a pod's request may not exceed its limit: lower the request or raise the limit",
        )


def _check_huge_pages_beside_cpu_or_memory(names: Set[str], where: str) -> None:
    huge_pages = sorted(name for name in names if name.startswith(HUGE_PAGES))
    if huge_pages and not names & {"cpu", "memory"}:
        raise SpecError(
            f"{where}.resources",
            f"asks for {', '.join(huge_pages)} but for neither cpu nor memory; a pod with huge pages must also "
            "request or limit cpu or memory: add e.g. limits.memory",
        )
