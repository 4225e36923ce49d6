"""Files that hold secrets must not be open to every user of the host.

The control plane's secret keys are refused when others may read or write them, as ssh refuses such
a private key: `triptych keys generate` writes them 0600 and the operator mounts them 0440, so
another mode is a copy that went wrong. The HTTP side's secrets (--api-keys-file,
--webhook-secret-file, --ssl-keyfile) and the files the environment names for the hub token and the
S3 credentials (HF_TOKEN_PATH, AWS_*_FILE: triptych.env_secrets) are the operator's own files: a
warning at start-up names each one that is open, and the chmod that closes it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

OTHERS = stat.S_IRWXO


def open_to_others(path: str | os.PathLike[str]) -> str | None:
    """Why `path` is open to every user ("mode 0644"), or None: closed, or not there (its reader says that)."""
    try:
        mode = os.stat(path).st_mode  # through the symlinks a Kubernetes Secret volume is made of
    except OSError:
        return None
    return f"mode {stat.S_IMODE(mode):04o}" if mode & OTHERS else None


def problem(path: str | os.PathLike[str], what: str) -> str | None:
    """What is wrong with the secret file `path` (named `what`, e.g. its flag), or None."""
    why = open_to_others(path)
    if why is None:
        return None
    return (
        f"{what} {Path(path)} is open to every user of this host ({why}): it holds a secret; "
        f"`chmod 600 {Path(path)}` (640 to share it with the group)"
    )
