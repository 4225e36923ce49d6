"""Whose video jobs a request may see: with --api-keys-file, a key sees the jobs made with a key of its
tenant (`tenant=NAME` on its line) or, without the option, with itself; the API open (no keys file),
every request sees every job.

A job another owner made answers as a job that does not exist (404, never 403: its id tells nothing),
on every route that names one (its status, events, content and DELETE), and `GET /v1/videos` lists
the caller's own. The owner is saved with the job in the result store every head shares, so every
head, and a head that takes the job over, keeps it. A job with no owner (made while the API was
open, or saved before owners were kept) is every key's, as it was then. `GET /v1/pipeline` lists
the caller's own requests in flight (the pools' load, everyone's).

An image's `url` answer (`/v1/files/images/<name>`) is not checked per key: its name holds 128
random bits besides the request id, so, like an object store's presigned URL, it reaches whoever
was given it. A video's MP4 is served by its job's content route alone.
"""

from __future__ import annotations

import re

from starlette.requests import Request

OWNER = "owner"  # request.state: whose jobs the request sees (auth.py sets it from the key)
TENANT = "tenant"  # the keys file's option naming a key's tenant
TENANT_OWNER = f"{TENANT}:"  # how a tenant's name starts as an owner (and as what its keys' limits count)
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_tenant(name: str) -> str | None:
    """Why `name` cannot be a tenant's name, or None."""
    if TENANT_NAME.fullmatch(name):
        return None
    return "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


def owner_of_key(key_id: str, tenant: str | None) -> str:
    """The owner a key's requests make their jobs for: its tenant, else the key itself (by its id)."""
    return f"{TENANT_OWNER}{tenant}" if tenant is not None else f"key:{key_id}"


def owner_of(request: Request) -> str | None:
    """Whose jobs `request` sees; None when the API is open (no --api-keys-file): everyone's."""
    return getattr(request.state, OWNER, None)


def may_see(job_owner: str | None, caller: str | None) -> bool:
    """Whether a caller sees a job: the API is open, the job has no owner, or it is the caller's."""
    return caller is None or job_owner is None or job_owner == caller
