"""A TEST-NET address put on this machine for a test: something to bind other than loopback that no
other host is dialled through (project rule: tests reach 127.0.0.0/8, 192.0.2.0/24 and 198.18.0.0/15
only, never a real interface's address).

Sessions that run at once (two pytest runs, xdist workers) may want the same address: its users in
one network namespace are counted in a state file under a lock (fcntl.flock), so the address stays
while any of them runs and the last one to leave removes it, if one of them added it. An address
that was there before any of them (someone else's) is used and left.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

IP_TIMEOUT_S = 10
LOCK_DIR_ENV = "TRIPTYCH_ADDRESS_LOCK_DIR"  # where the state files are (default: /run/lock, else /tmp)
ALREADY_THERE = ("Address already assigned", "File exists")  # iproute2's words, new and old


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)


def _held(address: str) -> bool:
    return any(f" {address}/" in line for line in _ip("-o", "addr", "show").stdout.splitlines())


def _said(result: subprocess.CompletedProcess[str]) -> str:
    return (result.stderr or result.stdout).strip() or f"exit status {result.returncode}"


def _add(address: str, device: str) -> list[str] | None:
    """Put `address` on a new dummy interface `device`, or (no dummy driver, or `device` exists) on lo.
    The `ip` arguments that undo this call's own add; None when the address was there already (an
    add that fails so: someone else's, added since we looked); pytest.fail with `ip`'s own words
    when it cannot be added."""
    made = _ip("link", "add", device, "type", "dummy")
    if made.returncode == 0:
        added = _ip("addr", "add", f"{address}/32", "dev", device)
        if added.returncode == 0:
            added = _ip("link", "set", device, "up")
        if added.returncode == 0:
            return ["link", "del", device]
        _ip("link", "del", device)  # ours, and of no use
        if any(words in added.stderr for words in ALREADY_THERE):
            return None
        pytest.fail(f"cannot put {address} on {device}: `ip addr add` said: {_said(added)}", pytrace=False)
    added = _ip("addr", "add", f"{address}/32", "dev", "lo")
    if added.returncode == 0:
        return ["addr", "del", f"{address}/32", "dev", "lo"]
    if any(words in added.stderr for words in ALREADY_THERE):
        return None
    pytest.fail(
        f"cannot put {address} on this machine: `ip addr add {address}/32 dev lo` said: {_said(added)} "
        f"(and `ip link add {device} type dummy`: {_said(made)})",
        pytrace=False,
    )


def _lock_dir() -> Path:
    if os.environ.get(LOCK_DIR_ENV):
        return Path(os.environ[LOCK_DIR_ENV])
    run_lock = Path("/run/lock")
    return run_lock if os.access(run_lock, os.W_OK) else Path("/tmp")


def _state_file(address: str) -> Path:
    """The state of `address`'s users in this network namespace (another namespace's address is
    another address)."""
    namespace = os.stat("/proc/self/ns/net").st_ino
    return _lock_dir() / f"triptych-test-address-{address}-net{namespace}.json"


@contextlib.contextmanager
def _locked(address: str) -> Iterator[dict[str, Any]]:
    """The users' state ({"users": ["<pid>:<token>", ...], "undo": ip args or None}), read and written
    back under an exclusive lock on its file."""
    path = _state_file(address)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with os.fdopen(os.dup(fd), "r+") as f:
            text = f.read()
            try:
                state = json.loads(text) if text.strip() else {}
            except ValueError:
                state = {}
            state.setdefault("users", [])
            state.setdefault("undo", None)
            state["users"] = [user for user in state["users"] if _alive(user)]  # a session killed on the way
            yield state
            f.seek(0)
            f.truncate()
            json.dump(state, f)
    finally:
        os.close(fd)  # and with it the lock


def _alive(user: str) -> bool:
    try:
        os.kill(int(user.partition(":")[0]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


@contextlib.contextmanager
def local_address(address: str, device: str) -> Iterator[str]:
    """`address` (a /32 of 192.0.2.0/24 or 198.18.0.0/15) on this machine while the block runs: on a
    dummy interface `device`, or (no dummy driver in this kernel) on lo; reachable from this machine
    only. One already there is used; it is removed when the last of its users here leaves, and only
    if one of them added it. Adding it needs CAP_NET_ADMIN, which the suite has (CI runs it as root):
    without it the test fails, naming what `ip` said, it does not skip."""
    me = f"{os.getpid()}:{uuid.uuid4().hex}"
    with _locked(address) as state:
        if not _held(address):
            undo = _add(address, device)  # pytest.fail leaves the state as it was: no user counted
            if undo is not None:
                state["undo"] = undo
        # Else: held by a user of ours (its undo recorded, kept: a crashed one's too), or there before
        # any of them (no undo: someone else's, left as it is).
        state["users"].append(me)
    try:
        yield address
    finally:
        with _locked(address) as state:
            state["users"] = [user for user in state["users"] if user != me]
            if not state["users"]:
                if state["undo"] is not None:
                    _ip(*state["undo"])
                state["undo"] = None
