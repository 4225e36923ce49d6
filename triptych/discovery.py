"""Where the workers (for a head) or the heads (for a worker) are: static tcp:// endpoints, dns://
names or file:// lists, re-read periodically.

`dns://NAME:PORT` stands for every address NAME resolves to (a Kubernetes headless Service
lists its ready pods), each as tcp://ADDRESS:PORT; instances come and go as the role scales.
The same forms name a head's workers (--encoder-urls, ...) and a worker's heads (--disagg-server-addr).
`file:///PATH` stands for the tcp:// endpoints listed in that file, one per line (`#` starts a
comment): for deployments without DNS-based discovery, where a tool rewrites the file as workers
come and go.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from triptych.ports import parse_tcp_endpoint, tcp_url

log = logging.getLogger(__name__)

Resolver = Callable[[str], list[str]]
DYNAMIC = ("dns://", "file://")  # entries whose endpoints change: re-read every interval


# The resolver's answers that a name has no address (a headless Service with no ready pod is one);
# any other failure (EAI_AGAIN: the DNS server restarting or timing out) says nothing about the pods.
NO_ADDRESS = frozenset(e for e in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if e is not None)


class DiscoveryFailed(OSError):
    """The endpoints could not be read this time (not: there are none); the last list stands."""


def resolve_addresses(host: str) -> list[str]:
    """All addresses `host` resolves to, sorted; [] when it has none (yet). DiscoveryFailed when
    the resolver could not say (a temporary failure)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in NO_ADDRESS:
            return []
        raise DiscoveryFailed(f"resolving {host}: {exc.strerror or exc}") from None
    return sorted({str(info[4][0]) for info in infos})


def read_endpoint_file(path: str) -> list[str]:
    """The tcp:// endpoints listed in a file (one per line); [] when it is missing. DiscoveryFailed
    when it is there but could not be read."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise DiscoveryFailed(f"reading {path}: {exc.strerror or exc}") from None
    urls = []
    for line in lines:
        url = line.split("#", 1)[0].strip()
        if not url:
            continue
        try:
            parse_tcp_endpoint(url)
        except ValueError as exc:
            log.warning("discovery: %s: skipped %r: %s", path, url, exc)
            continue
        urls.append(url)
    return urls


def expand(spec: str, resolver: Resolver = resolve_addresses) -> list[str]:
    """The tcp:// endpoints a --*-urls or --disagg-server-addr entry stands for right now."""
    if spec.startswith("file://"):
        return read_endpoint_file(spec.removeprefix("file://"))
    if not spec.startswith("dns://"):
        return [spec]
    name, port = parse_tcp_endpoint(spec, "dns")
    return [tcp_url(address, port) for address in resolver(name)]


class EndpointDirectory:
    """The current endpoints of a list of entries; dns:// and file:// ones are re-read in a background thread."""

    def __init__(self, specs: list[str], interval_s: float = 5.0, resolver: Resolver = resolve_addresses):
        self._specs = list(specs)
        self._resolver = resolver
        self._interval = interval_s
        try:
            self._urls = self._resolve()
        except DiscoveryFailed as exc:  # nothing known yet: none until a re-read succeeds
            log.warning("discovery: %s; no endpoints of %s until it answers", exc, self._specs)
            self._urls = []
        self._failing = ""  # the last failure logged, so that one that lasts is logged once
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if any(s.startswith(DYNAMIC) for s in specs):
            self._thread = threading.Thread(target=self._refresh_loop, name="discovery", daemon=True)
            self._thread.start()

    @property
    def urls(self) -> list[str]:
        return self._urls

    def _resolve(self) -> list[str]:
        seen: dict[str, None] = {}
        for spec in self._specs:
            for url in expand(spec, self._resolver):
                seen[url] = None
        return list(seen)

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                urls = self._resolve()
            except DiscoveryFailed as exc:  # a DNS server restarting, a file being replaced: try again
                if str(exc) != self._failing:
                    log.warning("discovery: %s; keeping %s", exc, self._urls)
                    self._failing = str(exc)
                continue
            except Exception:  # the resolver failing in a way it should not: keep the last list, try again
                log.exception("discovery: re-reading %s failed; keeping %s", self._specs, self._urls)
                continue
            self._failing = ""
            if urls != self._urls:
                log.info("discovery: %s -> %s", self._specs, urls)
                self._urls = urls

    def close(self) -> None:
        self._stop.set()
