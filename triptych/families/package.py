"""A diffusers package read through its JSON files only."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class PackageError(ValueError):
    """The package at --model-path cannot be read or loaded; the message names the file and why."""


@dataclass(frozen=True)
class ModelPackage:
    """A diffusers package on disk, read through its JSON files only."""

    path: Path
    index: dict[str, Any]

    @classmethod
    def read(cls, model_path: str | Path) -> ModelPackage:
        """Read model_index.json; raises ValueError naming the path when it is not a diffusers package."""
        path = Path(model_path)
        index_file = path / "model_index.json"
        try:
            index = json.loads(index_file.read_text())
        except FileNotFoundError:
            raise PackageError(f"model path {path}: no model_index.json (is it a diffusers package?)") from None
        except json.JSONDecodeError as exc:
            raise PackageError(f"{index_file}: not valid JSON ({exc})") from None
        if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
            raise PackageError(f"{index_file}: no '_class_name'; not a diffusers model index")
        return cls(path=path, index=index)

    @property
    def class_name(self) -> str:
        return str(self.index["_class_name"])

    @property
    def components(self) -> tuple[str, ...]:
        """Component names the index declares, present ones and null ones alike."""
        return tuple(k for k, v in self.index.items() if not k.startswith("_") and isinstance(v, list))

    def present(self, component: str) -> bool:
        entry = self.index.get(component)
        return isinstance(entry, list) and entry[0] is not None

    def fingerprint(self) -> str:
        """What makes two copies of a package the same model, from its JSON files only: the index and
        every present component's config (weights are not read: a copy with other weights under the
        same configs is not told apart). Processes on different machines compare it, not paths."""
        digest = hashlib.sha256(json.dumps(self.index, sort_keys=True).encode())
        for component in sorted(c for c in self.components if self.present(c)):
            try:
                digest.update(json.dumps([component, self.config(component)], sort_keys=True).encode())
            except ValueError:  # a component without a config (a tokenizer): its name is in the index
                continue
        return digest.hexdigest()[:16]

    def config(self, component: str) -> dict[str, Any]:
        """A component's config.json (scheduler_config.json for schedulers), without loading weights."""
        folder = self.path / component
        for name in ("config.json", "scheduler_config.json"):
            if (folder / name).is_file():
                try:
                    config = json.loads((folder / name).read_text())
                except json.JSONDecodeError as exc:
                    raise PackageError(f"{folder / name}: not valid JSON ({exc})") from None
                if not isinstance(config, dict):
                    raise PackageError(f"{folder / name}: not a JSON object")
                return config
        raise PackageError(f"model path {self.path}: component {component!r} has no config.json")


def package_fingerprint(model_path: str | Path) -> str:
    """ModelPackage.fingerprint of the package at `model_path`; "" when it cannot be read (nothing to compare)."""
    try:
        return ModelPackage.read(model_path).fingerprint()
    except (ValueError, OSError):
        return ""


def lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)
