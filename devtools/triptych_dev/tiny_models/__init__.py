"""Tiny random-weight diffusers packages for tests and demos: `triptych models tiny --out DIR`.

Each package is a complete diffusers folder (model_index.json plus one subfolder per component)
that the stock `DiffusionPipeline.from_pretrained` loads, with the real model's component classes
and configuration keys but a few thousand parameters, so one generation runs on a CPU in about a
second. Weights come from fixed seeds and tokenizers are trained from a built-in corpus, so the
files are the same on every write and nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

STAMP_FILE = "triptych-tiny.stamp"
"""Written last into each package; holds the content stamp that lets a later write skip it."""

# Changing anything below that alters the files must change the stamp: the stamp hashes the
# source of these modules, so editing a recipe regenerates cached packages automatically.
_RECIPE_MODULES = ("__init__.py", "text_tokenizers.py", "flux.py", "wan.py")
_LIBRARIES = ("torch", "diffusers", "transformers", "tokenizers", "sentencepiece", "safetensors")


def _build_flux() -> DiffusionPipeline:
    from triptych_dev.tiny_models.flux import build_flux

    return build_flux(kontext=False)


def _build_flux_kontext() -> DiffusionPipeline:
    from triptych_dev.tiny_models.flux import build_flux

    return build_flux(kontext=True)


def _build_wan() -> DiffusionPipeline:
    from triptych_dev.tiny_models.wan import build_wan

    return build_wan()


PACKAGES: dict[str, Callable[[], DiffusionPipeline]] = {
    "tiny-flux": _build_flux,
    "tiny-flux-kontext": _build_flux_kontext,
    "tiny-wan": _build_wan,
}
"""Package name -> builder of the in-memory pipeline it is saved from."""


def content_stamp(name: str) -> str:
    """What a package's files depend on: its name, the recipe source and the library versions."""
    digest = hashlib.sha256(name.encode())
    here = Path(__file__).parent
    for module in _RECIPE_MODULES:
        digest.update((here / module).read_bytes())
    for library in _LIBRARIES:
        digest.update(f"{library}=={importlib.metadata.version(library)}".encode())
    return digest.hexdigest()


def write_tiny_models(out_dir: str | os.PathLike[str], families: Iterable[str] | None = None) -> list[Path]:
    """Write the tiny packages under `out_dir`/<name>/ and return their paths.

    `families` selects packages by name (default: all of PACKAGES). A package whose stamp matches
    is left untouched; otherwise it is built in a temporary folder and moved into place whole, so
    a reader never sees a half-written package.
    """
    names = list(PACKAGES) if families is None else list(families)
    unknown = sorted(set(names) - set(PACKAGES))
    if unknown:
        raise ValueError(f"unknown tiny model package(s) {unknown}; choose from {sorted(PACKAGES)}")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    return [_write_package(root, name) for name in names]


def _write_package(root: Path, name: str) -> Path:
    target = root / name
    stamp = content_stamp(name)
    if _stamp_of(target) == stamp:
        _readable_by_all(target)
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        PACKAGES[name]().save_pretrained(staging, safe_serialization=True)
        (staging / STAMP_FILE).write_text(stamp + "\n")
        _readable_by_all(staging)
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            # Another writer moved the same package into place first; keep theirs if it is current.
            if _stamp_of(target) != stamp:
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _readable_by_all(package: Path) -> None:
    """Let every user read the package: mkdtemp makes folders 0700 and the weights are written 0600,
    but the images run as uid 10001 and read packages through a volume."""
    for path in [package, *package.rglob("*")]:
        mode = path.stat().st_mode
        wanted = mode | (0o055 if path.is_dir() else 0o044)
        if wanted != mode:
            path.chmod(wanted)


def _stamp_of(package: Path) -> str | None:
    try:
        return (package / STAMP_FILE).read_text().strip()
    except OSError:
        return None
