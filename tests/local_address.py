"""A TEST-NET address put on this machine for a test: something to bind other than loopback that no
other host is dialled through (project rule: tests reach 127.0.0.0/8, 192.0.2.0/24 and 198.18.0.0/15
only, never a real interface's address)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

import pytest

IP_TIMEOUT_S = 10


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)


def _held(address: str) -> bool:
    return any(f" {address}/" in line for line in _ip("-o", "addr", "show").stdout.splitlines())


@contextlib.contextmanager
def local_address(address: str, device: str) -> Iterator[str]:
    """`address` (a /32 of 192.0.2.0/24 or 198.18.0.0/15) on this machine while the block runs: on a
    dummy interface `device`, or (no dummy driver in this kernel) on lo; reachable from this machine
    only. One already there (left by someone else) is used and left. Adding it needs CAP_NET_ADMIN,
    which the suite has (CI runs it as root): without it the test fails, it does not skip."""
    if _held(address):
        yield address
        return
    if _ip("link", "add", device, "type", "dummy").returncode == 0:
        undo = ["link", "del", device]
        added = _ip("addr", "add", f"{address}/32", "dev", device)
        if added.returncode == 0:
            added = _ip("link", "set", device, "up")
    else:
        undo = ["addr", "del", f"{address}/32", "dev", "lo"]
        added = _ip("addr", "add", f"{address}/32", "dev", "lo")
    try:
        if added.returncode != 0:
            pytest.fail(f"cannot put {address} on this machine (needs CAP_NET_ADMIN): {added.stderr}", pytrace=False)
        yield address
    finally:
        _ip(*undo)
