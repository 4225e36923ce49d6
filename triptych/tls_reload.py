"""An HTTPS certificate, reloaded when its files change: a renewed certificate (a mounted Secret the
kubelet updates, cert-manager's renewal) takes effect without a restart. New connections get the new
pair, open ones keep theirs. Shared by the head (triptych_head.shutdown, --ssl-certfile) and the
custom metrics API server (triptych_operator.metrics_api.main, --tls-cert-file), each checking every
RECHECK_S seconds.

A changed pair is loaded into a scratch context first: a key of another certificate, a half-written
file or a missing one is logged and the pair in use kept. Only a pair that loads is loaded into the
live context, whose next handshakes use it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl

log = logging.getLogger(__name__)

RECHECK_S = 5.0  # how often the files are looked at (two stat calls)

Stamp = tuple[tuple[int, int, int], ...]
MISSING = "missing"  # the stamp of files that cannot be read


class CertificateReloader:
    """Keeps `context` serving the pair in `certfile` and `keyfile` as they are on disk."""

    def __init__(self, context: ssl.SSLContext, certfile: str, keyfile: str) -> None:
        self.context = context
        self.certfile = certfile
        self.keyfile = keyfile
        self._loaded = self._stamp()  # the pair loaded at start (by uvicorn, or server_tls just after this)
        self._refused: Stamp | str | None = None  # a changed pair that did not load (logged once)

    def _stamp(self) -> Stamp:
        # os.stat follows the symlinks a mounted Secret swaps on update.
        return tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in map(os.stat, (self.certfile, self.keyfile)))

    def check(self) -> bool:
        """Load the pair if its files changed and it loads; whether it was loaded."""
        try:
            stamp = self._stamp()
        except OSError as exc:
            return self._refuse(MISSING, f"cannot be read ({exc.strerror or exc})")
        if stamp == self._loaded or stamp == self._refused:
            return False
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError, ValueError) as exc:
            return self._refuse(stamp, f"it does not load as a certificate and its key ({exc})")
        try:
            self.context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError, ValueError) as exc:
            # The files changed again between the two loads: the next check loads what they hold then.
            log.warning("HTTPS certificate %s changed while it was reloaded (%s); trying again", self.certfile, exc)
            self._loaded = ()
            return False
        self._loaded, self._refused = stamp, None
        log.info("HTTPS certificate %s and key %s reloaded: new connections use them", self.certfile, self.keyfile)
        return True

    def _refuse(self, stamp: Stamp | str, why: str) -> bool:
        if stamp != self._refused:
            log.error(
                "HTTPS certificate %s / key %s changed but %s; still serving the pair loaded before",
                self.certfile,
                self.keyfile,
                why,
            )
        self._refused = stamp
        return False

    async def run(self, every_s: float = RECHECK_S) -> None:
        """Check every `every_s` seconds until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            self.check()
