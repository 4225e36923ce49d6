"""Classifier-free guidance: when a pipeline runs it, and the request check that follows from it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def guided(guidance_scale: float) -> bool:
    """Whether a pipeline with classifier-free guidance runs it (WanPipeline.do_classifier_free_guidance)."""
    return guidance_scale > 1.0


def unguided_negative(values: Mapping[str, Any]) -> str | None:
    """Why a request's negative prompt would be ignored, or None: it steers classifier-free guidance,
    which runs only at guidance_scale above 1. `values`: the request's fields."""
    negative, guidance = values.get("negative_prompt"), values.get("guidance_scale")
    if not negative or guidance is None or guided(guidance):
        return None
    return (
        f"negative_prompt is used only with classifier-free guidance, which runs at guidance_scale above 1 "
        f"(got guidance_scale {guidance:g}): raise guidance_scale, or leave negative_prompt out"
    )
