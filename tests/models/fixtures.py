"""Session fixture `tiny_models`: the tiny diffusers packages, written once into .models/ and reused."""

from __future__ import annotations

from pathlib import Path

import pytest

MODELS_DIR = Path(__file__).resolve().parents[2] / ".models"
"""Cache for generated packages (gitignored); a package is rewritten only when its recipe changes."""


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """Package name ("tiny-flux", "tiny-flux-kontext", "tiny-wan") -> its folder."""
    from triptych_dev.tiny_models import write_tiny_models

    return {path.name: path for path in write_tiny_models(MODELS_DIR)}


@pytest.fixture(scope="session")
def tiny_loras(tiny_models: dict[str, Path]) -> dict[str, Path]:
    """Tiny LoRA adapter name ("flux-ink", "flux-paper", "wan-ink", "flux-misfit") -> its folder."""
    from triptych_dev.tiny_models.loras import RECIPES, write_tiny_loras

    folder = write_tiny_loras(MODELS_DIR, tiny_models)
    return {name: folder / name for name in RECIPES}
