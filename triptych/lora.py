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
a .safetensors file, or a hub id (downloaded on first use, with HF_TOKEN for a gated one).
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Protocol

log = logging.getLogger(__name__)

FIELD = "loras"
MAX_ADAPTERS = 4  # per request: each active adapter adds a low-rank product to every layer it targets
MIN_WEIGHT, MAX_WEIGHT = -8.0, 8.0  # a LoRA's scale; beyond a few either way the image is noise
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # it becomes a peft adapter name: no dots


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
                self._from_file = read_catalog_file(self._path)
            except (OSError, ValueError) as exc:  # half-written or removed: keep what was read last
                log.warning(
                    "LoRA catalogue %s not read (%s); keeping %d adapters", self._path, exc, len(self._from_file)
                )

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


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
