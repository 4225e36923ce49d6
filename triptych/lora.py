"""LoRA adapters: the catalogue a deployment declares, and what a request may ask of it (pure Python).

A deployment declares its adapters by name; a request names up to MAX_ADAPTERS of them, each with
a weight (`loras: [{"name": "ink", "weight": 0.8}]`). The head checks the names against its
catalogue at its door; the denoiser loads an adapter the first time a request names it (the
prompt encoder its text-encoder part, if it has one), keeps it in a cache bounded in bytes, and
activates a request's set for its denoising (its text encoding) only (triptych_worker/lora.py).

    --lora NAME=SOURCE      repeatable, on the head, the denoisers and the encoders (and monolithic mode)
    --lora-catalog PATH     a file of NAME=SOURCE lines (# comments), re-read when it changes:
                            adding a line adds an adapter without a restart

SOURCE is what diffusers' `load_lora_weights` takes: a folder holding pytorch_lora_weights.safetensors,
a .safetensors file, or a hub id (downloaded on first use; a gated one with the token in HF_TOKEN or in the
file HF_TOKEN_PATH names).

A process that loads adapters (a denoiser, a prompt encoder: `LoraCatalog.check_sources`) refuses to
start when a SOURCE that is a path on this machine (`is_path`) is missing or holds no adapter
weights (`source_problem`); a hub id is not looked up. A catalogue file re-read later with such an
entry keeps serving: the entry is logged as a warning and kept (its files may arrive after the
line, and the file is re-read only when it changes), and a request naming it fails as before, a 400.
A multi-device worker logs it on rank 0, the rank that resolves names (parallel/ranks.py).
The head checks names only: its pod need not hold the adapters' files.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

FIELD = "loras"
MAX_ADAPTERS = 4  # per request: each active adapter adds a low-rank product to every layer it targets
MIN_WEIGHT, MAX_WEIGHT = -8.0, 8.0  # a LoRA's scale; beyond a few either way the image is noise
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # it becomes a peft adapter name: no dots
# The weights files diffusers' load_lora_weights reads (safetensors first, then pickled torch tensors).
WEIGHT_SUFFIXES = (".safetensors", ".bin")
WEIGHTS_FILE = "pytorch_lora_weights.safetensors"  # what it looks for first in a folder
SOURCE_HELP = f"give a folder holding {WEIGHTS_FILE}, a .safetensors file or a hub id such as owner/name"
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own bound on its JSON header


class NamedAdapter(Protocol):
    """One adapter a request names (triptych.params.LoraWeight: a msgspec Struct; this module stays
    standard-library only, as the contract, the CLI and the operator import it)."""

    @property
    def name(self) -> str: ...
    @property
    def weight(self) -> float: ...


class BadAdapter(ValueError):
    """An adapter a request cannot have (unknown, missing, incompatible, too large): a 400 naming `loras`."""

    param = FIELD


def check_request(loras: Iterable[NamedAdapter]) -> str | None:
    """Why a request's adapters are refused whatever the catalogue holds (count, duplicates,
    weights), or None."""
    chosen = list(loras)
    if len(chosen) > MAX_ADAPTERS:
        return f"{FIELD}: {len(chosen)} adapters given, at most {MAX_ADAPTERS} per request"
    seen: set[str] = set()
    for i, lora in enumerate(chosen):
        if lora.name in seen:
            return f"{FIELD}[{i}].name {lora.name!r} is given twice; name each adapter once"
        seen.add(lora.name)
        if not (math.isfinite(lora.weight) and MIN_WEIGHT <= lora.weight <= MAX_WEIGHT):
            return f"{FIELD}[{i}].weight {lora.weight} must be between {MIN_WEIGHT:g} and {MAX_WEIGHT:g}"
    return None


def choice_option(text: str) -> dict[str, object]:
    """`triptych generate --lora NAME[=WEIGHT]`: one adapter of a request's `loras`."""
    name, sep, weight = text.partition("=")
    if not sep:
        return {"name": name}
    try:
        return {"name": name, "weight": float(weight)}
    except ValueError:
        raise ValueError(f"--lora {text!r}: the weight after '=' must be a number, e.g. {name}=0.8") from None


def parse_entry(text: str, where: str = "--lora") -> tuple[str, str]:
    """(name, source) of a NAME=SOURCE entry; ValueError naming `where` when it is malformed."""
    name, sep, source = text.partition("=")
    name, source = name.strip(), source.strip()
    if not sep or not source:
        raise ValueError(f"{where} {text!r} is not NAME=SOURCE (a folder, a .safetensors file or a hub id)")
    if not NAME.fullmatch(name):
        raise ValueError(f"{where} {text!r}: the name must be 1-64 letters, digits, '_' or '-', starting with one")
    return name, source


def parse_entries(entries: Iterable[str], where: str = "--lora") -> dict[str, str]:
    """Name -> source of NAME=SOURCE entries; ValueError for a malformed one or a name given twice."""
    out: dict[str, str] = {}
    for entry in entries:
        name, source = parse_entry(entry, where)
        if name in out:
            raise ValueError(f"{where}: adapter {name!r} is declared twice")
        out[name] = source
    return out


def is_path(source: str) -> bool:
    """Whether an adapter SOURCE names a file or folder on this machine rather than a hub id (`owner/name`:
    at most one '/', downloaded on first use): it starts with '/', '.' or '~', has more than one '/',
    ends with a weights file's suffix, or exists (diffusers, too, reads what exists as a path)."""
    return (
        source.startswith(("/", ".", "~"))
        or source.count("/") > 1
        or source.endswith(WEIGHT_SUFFIXES)
        or os.path.lexists(source)
    )


def source_problem(source: str) -> str | None:
    """What keeps diffusers' `load_lora_weights(source)` from reading adapter weights at a SOURCE that is
    a path (missing, unreadable, a folder without a weights file, a file that is no safetensors file or
    holds no tensors), or None: a hub id (not looked up here), or a path that holds weights."""
    if not is_path(source):
        return None
    path = Path(source)
    try:
        if path.is_dir():
            found = _weights_in(path)
            if found is None:
                return f"{source} is a folder without a {' or '.join(WEIGHT_SUFFIXES)} adapter weights file in it"
            path = found
        elif not path.exists():
            return f"{source} does not exist"
        elif not path.is_file():
            return f"{source} is neither a folder nor a file"
        return _weights_file_problem(path)
    except OSError as exc:
        return f"{source} cannot be read ({exc.strerror or exc})"


def _weights_in(folder: Path) -> Path | None:
    """The weights file diffusers would read in `folder` (its _best_guess_weight_name: a top-level
    .safetensors, pytorch_lora_weights.safetensors first, else a .bin; none named for a scheduler,
    an optimizer or a checkpoint), or None."""
    names = sorted(os.listdir(folder))
    for suffix in WEIGHT_SUFFIXES:
        found = [n for n in names if n.endswith(suffix) and not any(w in n for w in _NOT_WEIGHTS)]
        preferred = [n for n in found if n.endswith("pytorch_lora_weights" + suffix)]
        if preferred or found:
            return folder / (preferred or found)[0]
    return None


_NOT_WEIGHTS = ("scheduler", "optimizer", "checkpoint")


def _weights_file_problem(path: Path) -> str | None:
    """Why the file at `path` holds no adapter weights, or None. A .safetensors file's header is read (8 bytes
    of length, then JSON naming each tensor and its bytes); another file is taken as diffusers takes it (it
    tries it as safetensors, then as pickled torch tensors) once it is not empty."""
    size = path.stat().st_size
    if size == 0:
        return f"{path} is empty"
    if path.suffix != ".safetensors":
        return None
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            return f"{path} is not a safetensors file (its header length does not fit the file)"
        try:
            header = json.loads(f.read(length))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"{path} is not a safetensors file (its header is not the format's JSON)"
    if not ends:
        return f"{path} holds no tensors"
    if 8 + length + max(ends) > size:
        return f"{path} is cut short: its header names {8 + length + max(ends)} bytes, the file has {size}"
    return None


def read_catalog_file(path: str) -> dict[str, str]:
    """The NAME=SOURCE lines of a catalogue file (blank lines and # comments skipped)."""
    with open(path, encoding="utf-8") as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    return parse_entries((line for line in lines if line), f"--lora-catalog {path}:")


class LoraCatalog:
    """The adapters a process may load: its --lora flags and its --lora-catalog file, re-read when
    the file changes (a file that cannot be read or parsed keeps the last good entries; missing at
    start-up, it is an empty catalogue until it appears: a mounted ConfigMap may come later)."""

    def __init__(self, entries: Mapping[str, str] | None = None, path: str | None = None):
        self._flags = dict(entries or {})
        self._path = path
        self._stamp: tuple[int, int] | None = None
        self._from_file: dict[str, str] = {}
        self._lock = threading.Lock()
        self._place: str | None = None  # the role that loads its adapters, once check_sources ran
        self._refresh()  # a file missing or malformed now is an empty catalogue until it changes

    @classmethod
    def from_flags(cls, lora: Iterable[str], lora_catalog: str | None) -> LoraCatalog:
        return cls(parse_entries(lora), lora_catalog)

    def _refresh(self) -> None:
        if self._path is None:
            return
        with self._lock:
            stamp = _stamp(self._path)
            if stamp is None or stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                before, self._from_file = self._from_file, read_catalog_file(self._path)
            except (OSError, ValueError) as exc:  # half-written or removed: keep what was read last
                log.warning(
                    "LoRA catalogue %s not read (%s); keeping %d adapters", self._path, exc, len(self._from_file)
                )
                return
            if self._place is None:
                return
            changed = {name: source for name, source in self._from_file.items() if before.get(name) != source}
            for problem in _problems(changed, self._file_where(), self._place):
                # Kept: its files may come after its line, and the file is re-read only when it changes.
                log.warning("%s; kept: requests naming it fail until it holds adapter weights", problem)

    def check_sources(self, place: str) -> str | None:
        """One line naming each --lora flag and catalogue entry whose SOURCE is a path without adapter
        weights on this `place` (what is wrong, and what to give instead), or None when every one holds
        them; a process that loads adapters refuses to start on it. From now on each re-read of the
        catalogue file logs such an entry as a warning and keeps it (module docstring)."""
        self._refresh()
        self._place = place
        problems = _problems(self._flags, "--lora", place) + _problems(self._from_file, self._file_where(), place)
        if not problems:
            return None
        shown = problems[:MAX_SHOWN] + ([f"and {len(problems) - MAX_SHOWN} more"] if len(problems) > MAX_SHOWN else [])
        return f"{'; '.join(shown)} ({SOURCE_HELP}, or remove the entry)"

    def _file_where(self) -> str:
        return f"--lora-catalog {self._path}:"

    def entries(self) -> dict[str, str]:
        """Name -> source, the file's entries over the flags' (the file is the one that changes)."""
        self._refresh()
        return {**self._flags, **self._from_file}

    def source(self, name: str) -> str | None:
        return self.entries().get(name)

    def check(self, loras: Iterable[NamedAdapter]) -> None:
        """Raise BadAdapter naming the first adapter the catalogue does not hold."""
        known = self.entries()
        for i, lora in enumerate(loras):
            if lora.name not in known:
                choices = (
                    f"choose one of {', '.join(sorted(known))}" if known
                    else "it serves none (its operator declares them with --lora NAME=SOURCE)"
                )  # fmt: skip
                raise BadAdapter(f"{FIELD}[{i}].name {lora.name!r} is not an adapter of this deployment; {choices}")

    def __bool__(self) -> bool:
        return bool(self._flags) or self._path is not None


MAX_SHOWN = 3  # bad sources one start-up error names


def _problems(entries: Mapping[str, str], where: str, place: str) -> list[str]:
    """`where NAME=SOURCE: what is wrong on this <place>` for each entry whose SOURCE is a path without weights."""
    out = []
    for name, source in entries.items():
        problem = source_problem(source)
        if problem is not None:
            out.append(f"{where} {name}={source}: {problem} on this {place}")
    return out


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
