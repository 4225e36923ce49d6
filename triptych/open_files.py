"""A process's limit on open files, raised at start-up to what its container allows.

Container runtimes commonly start a process with a soft limit of 1024 open files under a hard limit
of 524288 or more (containerd 2's default). A head holds a socket per HTTP client and stream, and
every process a ZMQ connection per peer; a worker also holds Mooncake's pooled TCP connections,
up to 4 per peer it writes to, and Mooncake 0.3.13 keeps those to a peer that went away (a scaled-in
or restarted pod) for the writer's lifetime (docs/transfer.md, "Known limit"). At 1024, a
long-lived denoiser behind a churning decoder pool would run out after a few hundred departures and
fail its writes with "Too many open files". The soft limit is raised to the hard one, which only
the container's or the node's configuration sets: nothing beyond what the deployment allows.
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger(__name__)

# Where the hard limit is unlimited: what the soft one is raised to (Linux's default nr_open).
UNLIMITED_TARGET = 1 << 20


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (UNLIMITED_TARGET under none); return
    the soft limit it now has (resource.RLIM_INFINITY: none, left as it is).

    A limit that cannot be raised (a sandbox that refuses setrlimit) is logged and kept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("open-files limit kept at %d (could not raise it to %d: %s)", soft, target, exc)
        return soft
    why = "no hard limit" if hard == resource.RLIM_INFINITY else "its hard limit"
    log.info("open-files limit raised from %d to %d (%s)", soft, target, why)
    return target


def open_files() -> int:
    """How many descriptors this process has open (0 where /proc cannot say)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listing them
    except OSError:
        return 0


def open_files_limit() -> int:
    """This process's soft open-file limit; 0 for none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 0 if soft == resource.RLIM_INFINITY else soft
