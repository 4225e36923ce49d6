"""Flags of the reference design's commands that Triptych does not have, each with why and what to
use instead (docs/reference-commands.md).

A user coming from the reference brings its commands. `triptych serve` with one of these flags
exits at start-up with one line naming the flag and saying what to do, rather than argparse's
bare "unrecognized arguments".
"""

from __future__ import annotations

from collections.abc import Sequence

_AUTOREGRESSIVE = (
    "is the reference design's GLM-Image distributed mode (an external autoregressive server feeding the "
    "denoisers), which Triptych does not have: no family here has an autoregressive stage. For whole requests "
    "on independent workers, run a full-pipeline pool (workers with --disagg-full-pipeline, the head with only "
    "--denoiser-urls)"
)
_LANGUAGE_SERVER = (
    "is a flag of sglang's language-model server (the GLM-Image autoregressive stage), not of a diffusion role; "
    "Triptych serves diffusion pipelines only"
)

REFERENCE_ONLY: dict[str, str] = {
    "--srt-encoder-url": _AUTOREGRESSIVE,
    "--srt-encoder-timeout": _AUTOREGRESSIVE,
    "--dit-cpu-offload": (
        "is not needed: each role keeps its own weights on its device; a denoiser too large for one device runs "
        "on several (--num-gpus with --denoiser-sp or --denoiser-tp, docs/parallelism.md)"
    ),
    "--attention-backend": (
        "is not a choice here: the roles run diffusers' attention, PyTorch's scaled_dot_product_attention, which "
        "picks the flash or memory-efficient kernel itself; omit the flag"
    ),
    **dict.fromkeys(
        (
            "--tokenizer-path",
            "--enable-multimodal",
            "--cuda-graph-max-bs-decode",
            "--mem-fraction-static",
            "--disable-fast-image-processor",
        ),
        _LANGUAGE_SERVER,
    ),
}


def reference_only_refusal(argv: Sequence[str]) -> str | None:
    """The refusal of the first flag in `argv` (a `serve` command line) that only the reference has."""
    for token in argv:
        name = token.partition("=")[0]
        if name in REFERENCE_ONLY:
            return f"{name} {REFERENCE_ONLY[name]}"
    return None
