"""The local tooling's subcommands: `triptych models tiny` and `triptych demo`.

The `triptych` command adds them through its `triptych.commands` entry point (pyproject.toml), so
they exist where this package is installed (a dev install) and nowhere else; `python -m
triptych_dev models tiny ...` runs the same without the installed metadata.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from triptych.cli import OneLineParser


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    """Add `models tiny` and `demo` to the `triptych` parser's subcommands (the entry point)."""
    models = sub.add_parser("models", help="model utilities (local tooling)")
    models_sub = models.add_subparsers(dest="models_command", required=True, parser_class=OneLineParser)
    tiny = models_sub.add_parser("tiny", help="write tiny random-weight diffusers packages for tests and demos")
    tiny.add_argument("--out", required=True, help="directory to write the packages into")
    tiny.add_argument("--family", action="append", help="only this package (repeatable); default: all")
    tiny.set_defaults(run=run_models_tiny)
    demo = sub.add_parser("demo", help="the tiny models served by a local disaggregated deployment (`make demo`)")
    demo.add_argument("--models", default=".models", help="where the tiny packages are (written if missing)")
    demo.add_argument("--out", default="outputs", help="where the image, video and edit are written")
    demo.set_defaults(run=run_demo)


def run_models_tiny(ns: argparse.Namespace) -> int:
    from triptych_dev.tiny_models import write_tiny_models
    from triptych_dev.tiny_models.loras import write_tiny_loras

    try:
        paths = write_tiny_models(ns.out, families=ns.family)
    except ValueError as exc:
        print(f"triptych: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --out is a file, or cannot be written
        print(
            f"triptych: error: --out {ns.out}: cannot write the packages there ({exc.strerror or exc})", file=sys.stderr
        )
        return 2
    if ns.family is None:  # every package: their LoRA adapters too
        paths.append(write_tiny_loras(ns.out, {path.name: path for path in paths}))
    for path in paths:
        print(path)
    return 0


def run_demo(ns: argparse.Namespace) -> int:
    from triptych_dev.demo import run

    for option, folder in (("--models", ns.models), ("--out", ns.out)):
        try:  # before any model is written or process started
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(
                f"triptych: error: {option} {folder}: not a folder this command can write ({exc.strerror or exc})",
                file=sys.stderr,
            )
            return 2
    return run(ns.models, ns.out)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m triptych_dev`: these subcommands alone."""
    parser = OneLineParser(prog="python -m triptych_dev", description="Triptych's local tooling.")
    add_commands(parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser))
    ns = parser.parse_args(argv)
    return int(ns.run(ns))
