"""Hop trace: when each control message of a request was encoded, sent, received and decoded, in
every process of a local deployment (bench/hop_bench.py).

`install(directory)` wraps the protocol's encode/decode and the socket helpers' send/receive in this
process, each appending (perf_counter_ns, event, message type, request id) to a file of its own in
`directory` ("enc": a message is about to be encoded; "sent": its send returned; "recvd": a receive
returned the parts a later "dec" decoded). perf_counter is CLOCK_MONOTONIC, one clock for every
process of a host, so the events of a request line up across processes. The processes of a
deployment get it through `site_dir()` on their PYTHONPATH with TRIPTYCH_HOP_TRACE set; nothing in
triptych itself knows of it. About 1.4 µs per event in a tight loop (an encode: 0.45 µs plain, 1.86
µs traced), so some 60 µs over a request's 46 events, spread over its five processes.

`hops(directory, roles, clients)` lines up the events of each request and names every gap between
two consecutive ones: the sender's encode and send, the wire (ZMQ's I/O threads, TCP, the wake-up
of the receiver), the receiver's decode, and each process's own work between a decode and its next
encode.
"""

from __future__ import annotations

import atexit
import itertools
import os
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "TRIPTYCH_HOP_TRACE"
FLUSH_EVERY = 64


def site_dir() -> Path:
    """The folder whose sitecustomize.py installs the trace in a process started with ENV set."""
    return Path(__file__).resolve().parent / "hops_site"


class _Recorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[tuple[int, str, str, str]] = []
        self.local = threading.local()
        self.lock = threading.Lock()
        atexit.register(self.flush)

    def add(self, ns: int, event: str, msg: Any) -> None:
        with self.lock:
            self.events.append((ns, event, msg.TYPE, getattr(msg, "request_id", "")))
            if len(self.events) >= FLUSH_EVERY:
                self._write()

    def flush(self) -> None:
        with self.lock:
            self._write()

    def _write(self) -> None:
        if self.events:
            with self.path.open("a") as f:
                f.write("".join(f"{ns} {event} {kind} {rid}\n" for ns, event, kind, rid in self.events))
            self.events = []


def install(directory: Path) -> None:
    """Record this process's message events into `directory`/<pid>.txt (see the module docstring)."""
    import triptych.protocol as protocol
    import triptych.protocol.codec as codec
    import triptych.sockets as sockets

    rec = _Recorder(directory / f"{os.getpid()}.txt")
    encode, decode = codec.encode, codec.decode
    send_message, recv_message = sockets.send_message, sockets.recv_message

    def traced_encode(msg: Any, frames: Any = ()) -> list[Any]:
        rec.add(time.perf_counter_ns(), "enc", msg)
        return encode(msg, frames)

    def traced_decode(parts: Any) -> tuple[Any, list[Any]]:
        msg, frames = decode(parts)
        now = time.perf_counter_ns()
        received = getattr(rec.local, "received", 0)
        if received:
            rec.local.received = 0
            rec.add(received, "recvd", msg)
        rec.add(now, "dec", msg)
        return msg, frames

    def traced_send(sock: Any, msg: Any, frames: Any = (), flags: int = 0) -> None:
        send_message(sock, msg, frames, flags)  # its encode is traced_encode (patched below)
        rec.add(time.perf_counter_ns(), "sent", msg)

    def traced_recv(sock: Any, flags: int = 0, copied: int = 1) -> list[Any]:
        parts = recv_message(sock, flags, copied)
        rec.local.received = time.perf_counter_ns()
        return parts

    for module in (protocol, codec, sockets):
        if hasattr(module, "encode"):
            module.encode = traced_encode  # type: ignore[attr-defined]
        if hasattr(module, "decode"):
            module.decode = traced_decode  # type: ignore[attr-defined]
    sockets.send_message = traced_send  # type: ignore[assignment]
    sockets.recv_message = traced_recv  # type: ignore[assignment]


@dataclass(frozen=True)
class Segment:
    """One gap of a request's path: from event `start` to event `end` ("role:event:type")."""

    start: str
    end: str
    median_us: float

    @property
    def kind(self) -> str:
        """send, wire, receive, or "<role> work" (a process between a decode and its next encode)."""
        (a_role, a_event, _), (b_role, b_event, _) = self.start.split(":"), self.end.split(":")
        if a_role != b_role:
            return "wire"
        if (a_event, b_event) == ("enc", "sent"):
            return "send"
        if (a_event, b_event) == ("recvd", "dec"):
            return "receive"
        return f"{a_role} work"


def hops(directory: Path, roles: Mapping[int, str], clients: Mapping[str, tuple[int, int]]) -> list[Segment]:
    """Median of each gap along the path the most requests took, from the events in `directory`.

    `roles`: process id -> role name; `clients`: request id -> (ns before its submit was sent, ns
    after its result was received), the client's two events (this process is not traced)."""
    events: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for path in directory.glob("*.txt"):
        role = roles.get(int(path.stem), path.stem)
        for line in path.read_text().splitlines():
            ns, event, kind, rid = [*line.split(), ""][:4]
            if rid in clients:
                events[rid].append((int(ns), f"{role}:{event}:{kind}"))
    paths: dict[str, tuple[list[str], list[int]]] = {}
    for rid, (sent, received) in clients.items():
        timeline = sorted([*events.get(rid, []), (sent, "client:enc:submit"), (received, "client:dec:result")])
        paths[rid] = ([name for _, name in timeline], [ns for ns, _ in timeline])
    common = Counter(tuple(names) for names, _ in paths.values()).most_common(1)
    if not common:
        return []
    names = list(common[0][0])
    gaps: list[list[float]] = [[] for _ in names[1:]]
    for seq, stamps in paths.values():
        if seq == names:
            for i, (a, b) in enumerate(itertools.pairwise(stamps)):
                gaps[i].append((b - a) / 1e3)
    return [Segment(a, b, statistics.median(g)) for a, b, g in zip(names, names[1:], gaps, strict=False)]


def totals(segments: list[Segment]) -> dict[str, float]:
    """Microseconds per request by kind of gap (Segment.kind), and the number of wire crossings."""
    out: dict[str, float] = defaultdict(float)
    for seg in segments:
        out[seg.kind] += seg.median_us
    out["messages"] = sum(1 for seg in segments if seg.kind == "wire")
    return dict(out)
