"""A small file a process reads again when it changes: a Kubernetes Secret or ConfigMap mounted as
files is updated in place (the kubelet swaps a `..data` symlink within a minute or two), and a
credential rotated there must take effect without a restart.

The file is looked at (one stat, following the symlinks) at most every `recheck_s`, on the caller's
thread; when it changed it is read and parsed again. A read or parse that fails keeps what was read
before (logged once per change), so a half-written or wrong update never leaves the process without
a value.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
RECHECK_S = 1.0
MISSING = "missing"  # the file could not even be looked at


class WatchedFile(Generic[T]):
    """`parse(text)` of the file at `path`, kept current. The first read's OSError or ValueError
    (parse's) propagates: a file that cannot be used at start is the caller's error to report."""

    def __init__(
        self,
        path: str | Path,
        parse: Callable[[str], T],
        what: str,
        recheck_s: float = RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self._parse = parse
        self._what = what  # how the log names it: "--webhook-secret-file /etc/..."
        self._recheck_s = recheck_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._value = self._read()
        self._checked = clock()
        self._failed: object = None  # the change whose read failed, or MISSING (logged once)

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)  # follows the symlinks a mounted Secret swaps on update
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _read(self) -> T:
        return self._parse(self.path.read_text(encoding="utf-8"))

    def get(self) -> T:
        now = self._clock()
        if now - self._checked >= self._recheck_s:
            with self._lock:
                if now - self._checked >= self._recheck_s:
                    self._checked = now
                    self._refresh()
        return self._value

    def _refresh(self) -> None:
        stamp: object = MISSING
        try:
            stamp = self._stat()
            if stamp in (self._stamp, self._failed):
                return
            value = self._read()
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            if stamp != self._failed:
                log.error("cannot re-read %s (%s); keeping what was read before", self._what, exc)
            self._failed = stamp
            return
        self._stamp, self._value, self._failed = stamp, value, None
        log.info("%s changed: read again", self._what)
