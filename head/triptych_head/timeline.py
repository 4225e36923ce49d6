"""Where one request's time went, as the head saw it: the parts of its path, for the `Server-Timing`
header of its answer and for its trace (tracing.py).

The head adds each part as it ends (docs/serving.md, "Where the time goes"):

- `queue-<role>`: waiting in the role's queue for an instance (queues.py), summed over the waits;
- `<role>`: the role's stages, the seconds the worker reports spending on them (at most the time the
  head saw the hop take, from its Work or TransferReady to its output);
- `transfer-<source>-<destination>`: a hand-off between roles, from the receiver being chosen (its
  slot reserved, the push sent, the write done) to the sender reporting the write (transfers.py).

The parts of one attempt never overlap, so their sum is at most the request's total.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SERVER_TIMING = "Server-Timing"  # the header's name
# A finished request's timings entry: its stages' seconds times the devices they ran on, every hop that
# ran for it counted (one run again after a worker failed too): what API keys' device-second quotas count.
DEVICE_SECONDS = "device_seconds"


@dataclass(frozen=True)
class Part:
    name: str
    start: float  # the head's clock (monotonic seconds)
    end: float
    seconds: float  # what the header reports: end - start, or the worker's own time for a stage


@dataclass
class Timeline:
    parts: list[Part] = field(default_factory=list)

    def add(self, name: str, start: float, end: float, seconds: float | None = None) -> None:
        """A part from `start` to `end` on the head's clock; `seconds`: a stage's worker-reported time,
        bounded by what the head saw."""
        span = max(end - start, 0.0)
        self.parts.append(Part(name, start, end, span if seconds is None else min(max(seconds, 0.0), span)))

    def durations(self) -> dict[str, float]:
        """Seconds per part name, in the order the parts first happened (a second wait adds to the first)."""
        out: dict[str, float] = {}
        for part in self.parts:
            out[part.name] = out.get(part.name, 0.0) + part.seconds
        return out

    def spans(self, now: float, now_ns: int) -> list[tuple[str, int, int, dict[str, float]]]:
        """The parts as trace spans (name, start, end in epoch nanoseconds, attributes), given the head's
        clock `now` and the wall clock's `now_ns` at the same moment."""
        out = []
        for part in self.parts:
            start, end = now_ns - round((now - part.start) * 1e9), now_ns - round((now - part.end) * 1e9)
            out.append((part.name, start, end, {"triptych.seconds": part.seconds}))
        return out


def server_timing(durations: dict[str, float], total: float) -> str:
    """The `Server-Timing` header value: each part and `total`, in milliseconds."""
    entries = [*durations.items(), ("total", total)]
    return ", ".join(f"{name};dur={seconds * 1000:.3f}" for name, seconds in entries)


def parse_server_timing(header: str) -> dict[str, float]:
    """A `Server-Timing` value back to milliseconds per name (the tests and the bench read it)."""
    out: dict[str, float] = {}
    for entry in header.split(","):
        name, _, params = entry.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur":
                out[name] = float(value)
    return out
