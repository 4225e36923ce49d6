"""A head's own output folder for a test, removed after it."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REMOVE_WITHIN_S = 30.0


@contextlib.contextmanager
def head_folder(prefix: str) -> Iterator[Path]:
    """A folder of its own (a video job left in a shared one would be taken over, run again, by the
    next head), removed after. A job whose frames were being written when its head stopped goes on
    writing in its thread (a thread cannot be cancelled), so removing is tried again until the
    folder is gone: a single rmtree failed on a loaded machine with "Directory not empty"."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    finally:
        until = time.monotonic() + REMOVE_WITHIN_S
        shutil.rmtree(folder, ignore_errors=True)
        while folder.exists() and time.monotonic() < until:
            time.sleep(0.2)
            shutil.rmtree(folder, ignore_errors=True)
