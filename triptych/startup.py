"""Where a process's start-up time goes: each phase's end, in seconds since the process started.

    from triptych import startup
    startup.mark("loaded")        # the first time only; later marks of a phase are ignored
    startup.done("registered")    # the last phase: logs the one start-up line

The start is the kernel's start time of the process (/proc/self/stat), so the interpreter's own
start and a worker's re-execution under the bind shim (same pid: triptych_worker.transfer.listeners)
are counted. The phases, in the order a request's path needs them (docs/benchmarks.md "Cold start"):

- reexec: the first image of a worker replaced itself under the bind shim (workers with Mooncake only)
- started: the interpreter is up and `triptych serve` has parsed its flags
- imported: torch, diffusers and the family's pipeline module are imported (model processes only)
- loaded: the role's weights are on its device
- transfer: the Mooncake engine runs and the transfer pool is registered (workers with Mooncake only)
- listening: the work socket (a worker) or the HTTP port (a head, monolithic) takes connections
- registered: the worker's first heartbeat went to a head (workers only)
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

PHASES = ("reexec", "started", "imported", "loaded", "transfer", "listening", "registered")
REEXEC_ENV = "TRIPTYCH_STARTUP_REEXEC"  # set by the image that re-executes: when it did, since the start
LINE_PREFIX = "start-up, seconds since the process started:"
_PHASE_FIELD = re.compile(r"(\w+)=([0-9.]+)")


def since_process_start() -> float:
    """Seconds since the kernel started this process (10 ms resolution); since this module was first
    imported where /proc is not there to say."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rpartition(")")[2].split()[19])  # field 22, counted after the command name
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


class StartupClock:
    """The phases one process has reached, each at the first time it was marked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phases: dict[str, float] = {}
        reexec = os.environ.pop(REEXEC_ENV, None)  # popped: the ranks a worker starts are processes of their own
        if reexec is not None:
            try:
                self._phases["reexec"] = float(reexec)
            except ValueError:
                pass

    def mark(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; one of {', '.join(PHASES)}")
        with self._lock:
            if phase in self._phases:
                return  # marked on every ping, say: no /proc read after the first
        now = since_process_start()
        with self._lock:
            self._phases.setdefault(phase, now)

    def phases(self) -> dict[str, float]:
        """Each phase reached, in PHASES order, with its seconds since the process started."""
        with self._lock:
            return {phase: self._phases[phase] for phase in PHASES if phase in self._phases}

    def line(self) -> str:
        return f"{LINE_PREFIX} " + " ".join(f"{phase}={at:.3f}" for phase, at in self.phases().items())


CLOCK = StartupClock()
"""This process's clock."""

_logged = threading.Event()


def mark(phase: str) -> None:
    """Record that this process reached `phase` now (once: the first mark counts)."""
    CLOCK.mark(phase)


def done(phase: str) -> None:
    """Mark the last phase and log the start-up line (once per process)."""
    if _logged.is_set():
        return
    CLOCK.mark(phase)
    _logged.set()
    log.info("%s", CLOCK.line())


def parse_line(text: str) -> dict[str, float] | None:
    """The phases of the first start-up line in `text` (a process's log), None when it has none."""
    for line in text.splitlines():
        _, found, fields = line.partition(LINE_PREFIX)
        if found:
            return {name: float(value) for name, value in _PHASE_FIELD.findall(fields)}
    return None
