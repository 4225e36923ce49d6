"""--model-path: a local diffusers package, or a hub id fetched once into the local cache.

Every process resolves the path the same way before it reads a config, so a DiffusionPipeline
with `model.hubId` works on clusters that can reach the hub (for gated models the token in HF_TOKEN,
or in the file HF_TOKEN_PATH names, as the operator mounts it; HF_HOME for the cache), and a local
path never touches the network.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelSourceError(ValueError):
    """The model cannot be found or fetched; the message says what to do."""


def model_names(given: str, resolved: str, served: str | None = None) -> list[str]:
    """The ids a request's `model` may name, the one to show first: --served-model-name, else the hub
    id the path was given as, else the package folder's name; then the others, and --model-path as given."""
    folder = Path(resolved).resolve().name
    hub = given if not Path(given).is_dir() and HUB_ID.match(given) else None
    names = [served, hub, folder, given]
    return list(dict.fromkeys(n for n in names if n))


def resolve_model_path(model_path: str) -> str:
    """A local directory holding model_index.json for `model_path` (a directory or a hub id)."""
    local = Path(model_path)
    if local.is_dir():
        if not (local / "model_index.json").is_file():
            raise ModelSourceError(f"--model-path {model_path}: no model_index.json (is it a diffusers package?)")
        return str(local)
    if not HUB_ID.match(model_path):
        raise ModelSourceError(f"--model-path {model_path}: no such directory, and not a hub id like org/name")
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(repo_id=model_path))
    except Exception as exc:  # offline, gated, unknown repo: all end here with the hub's own reason
        raise ModelSourceError(
            f"--model-path {model_path}: not a local directory and fetching it from the hub failed "
            f"({type(exc).__name__}: {exc}); mount the package and pass its path, or, for a gated model, "
            "give a token in HF_TOKEN or in the file HF_TOKEN_PATH names"
        ) from None
