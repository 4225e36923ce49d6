"""The control plane's authentication: CURVE keys, and the one place head<->worker sockets are secured.

Every head<->worker ZMQ socket is CURVE (libzmq's: mutual authentication and encryption) when
`--disagg-keys-dir` is given. A key set is two key pairs, in zmq.auth's certificate format:

    head.key    head.key_secret     the head's pair
    worker.key  worker.key_secret   the pair every worker of the pipeline shares

A worker's work socket is a CURVE server that lets in only clients holding the head's key; the
head's result sockets are CURVE servers that let in only clients holding the worker key. The
check is a ZAP handler (zmq.auth.thread.ThreadAuthenticator) on the process's context, started
before any socket binds. A process needs its own pair and the other side's public key, no more:
the operator mounts exactly those files into each pod.

`triptych keys generate DIR` writes a key set; secret files are created with mode 0600.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from triptych import private_files
from triptych.config import ConfigError, ServeArgs

Side = Literal["head", "worker"]
SIDES: tuple[Side, Side] = ("head", "worker")
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
ZAP_DOMAIN = "triptych"
REFUSAL_LOG_S = 10.0

log = logging.getLogger(__name__)


def public_file(side: Side) -> str:
    return side + PUBLIC_SUFFIX


def secret_file(side: Side) -> str:
    return side + SECRET_SUFFIX


def key_files(side: Side) -> tuple[str, str, str]:
    """The files a process of `side` reads: its own public and secret files and the other side's public file."""
    other: Side = "worker" if side == "head" else "head"
    return public_file(side), secret_file(side), public_file(other)


def _cert_text(public: bytes, secret: bytes | None) -> str:
    """One certificate in zmq.auth's format (zmq.auth.load_certificate reads it)."""
    kind = "Secret" if secret is not None else "Public"
    lines = [f"#   ZeroMQ CURVE {kind} Certificate (triptych)", "metadata", "curve"]
    lines.append(f'    public-key = "{public.decode()}"')
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def new_key_set() -> dict[str, str]:
    """A fresh key set: file name -> certificate text (what `generate_keys` writes; the operator's Secret holds)."""
    files: dict[str, str] = {}
    for side in SIDES:
        public, secret = zmq.curve_keypair()
        files[public_file(side)] = _cert_text(public, None)
        files[secret_file(side)] = _cert_text(public, secret)
    return files


def generate_keys(keys_dir: str | os.PathLike[str]) -> list[Path]:
    """Write a head and a worker key pair into `keys_dir` (created 0700 if missing); refuses to overwrite.
    Secret files are created 0600, never readable by others even for a moment."""
    if not str(keys_dir).strip():
        raise ConfigError("DIR is empty: give the folder to write the keys into")
    directory = Path(keys_dir)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{directory}: not a folder the keys can be written into ({exc.strerror or exc})") from None
    files = new_key_set()
    existing = [name for name in files if (directory / name).exists()]
    if existing:
        raise ConfigError(f"{directory} already holds {', '.join(existing)}; remove them first to make new keys")
    for name, text in files.items():
        mode = 0o600 if name.endswith(SECRET_SUFFIX) else 0o644
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return [directory / name for name in files]


def public_fingerprint(files: dict[str, str]) -> str:
    """A short digest of a key set's public keys: changes when the keys do (the operator rolls pods on it)."""
    digest = hashlib.sha256("".join(files.get(public_file(side), "") for side in SIDES).encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class ControlKeys:
    """What one process needs: its own key pair and the public key of the only peers it accepts."""

    public: bytes
    secret: bytes
    peer_public: bytes


def load_keys(keys_dir: str | os.PathLike[str], side: Side) -> ControlKeys:
    """Read `side`'s keys from `keys_dir`; ConfigError names the file that is missing or unreadable."""
    directory = Path(keys_dir)
    _, own_secret, peer = key_files(side)
    try:
        public, secret = zmq.auth.load_certificate(directory / own_secret)
        peer_public, _ = zmq.auth.load_certificate(directory / peer)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--disagg-keys-dir {directory}: cannot read the {side}'s keys ({exc}); it needs {own_secret} and {peer} "
            "(`triptych keys generate DIR` writes them)"
        ) from None
    if secret is None:
        raise ConfigError(f"--disagg-keys-dir {directory}: {own_secret} holds no secret key")
    if (problem := private_files.problem(directory / own_secret, "--disagg-keys-dir:")) is not None:
        raise ConfigError(problem)
    return ControlKeys(public=public, secret=secret, peer_public=peer_public)


class ControlPlane:
    """Secures the head<->worker sockets of one process: CURVE with a ZAP check when keys are given.

    `server(sock)` before binding a socket peers connect to; `client(sock, ...)` before connecting
    one. Without keys (--disagg-insecure, or loopback only) both leave the socket as it is.
    """

    def __init__(self, ctx: zmq.Context[Any], keys: ControlKeys | None):
        self.keys = keys
        self._auth: ThreadAuthenticator | None = None
        if keys is not None:
            # The ZAP handler must run before a CURVE server binds: without one, libzmq lets in any
            # client that knows the server's public key.
            self._auth = ThreadAuthenticator(ctx, log=None)
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN, _OnlyKey(keys.peer_public))

    @property
    def authenticated(self) -> bool:
        return self.keys is not None

    def server(self, sock: zmq.Socket[Any], max_message_bytes: int | None = None) -> None:
        """A socket that binds: only the peer key may connect, everything is encrypted.
        `max_message_bytes`: the largest frame a peer may send; a peer that announces a larger one
        is disconnected at once, before it is read. libzmq reads a handshake's frames before it can
        refuse their sender's key, so without it a peer holding no key could make this process hold
        as much memory as it sends for the handshake's timeout (set where every frame is bounded: a
        worker's work socket, whose messages are headers of at most MAX_HEADER_BYTES)."""
        if max_message_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if self.keys is None:
            return
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()

    def client(self, sock: zmq.Socket[Any]) -> None:
        """A socket that connects to the peer side's server, whose public key it must present."""
        if self.keys is None:
            return
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_serverkey = self.keys.peer_public

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class _OnlyKey:
    """ZAP credentials check: exactly one client public key (z85, as certificates hold it) is let in.
    Refusals are logged at most every REFUSAL_LOG_S (a peer with old keys after a rotation retries
    its handshake all the time)."""

    def __init__(self, public: bytes):
        self._allowed = z85.decode(public)
        self._refused = 0
        self._logged_at = -REFUSAL_LOG_S

    def callback(self, domain: str, z85_key: bytes) -> bool:
        if hmac.compare_digest(z85.decode(z85_key), self._allowed):
            return True
        self._refused += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_S:
            log.warning(
                "refused %d control-plane connection(s) from a key that is not this pipeline's (latest %s...); "
                "a peer with other or old --disagg-keys-dir keys?",
                self._refused, z85_key[:8].decode(errors="replace"),
            )  # fmt: skip
            self._refused, self._logged_at = 0, now
        return False


def control_plane(args: ServeArgs, ctx: zmq.Context[Any], side: Side) -> ControlPlane:
    """The control-plane security `args` ask for (ServeArgs.validate has refused an unprotected
    non-loopback bind already); ConfigError when the keys cannot be read."""
    keys = load_keys(args.disagg_keys_dir, side) if args.disagg_keys_dir else None
    return ControlPlane(ctx, keys)
