"""`triptych`: the one entrypoint for every role, plus the tiny-model generator.

    triptych serve --model-path DIR --disagg-role {monolithic,encoder,...,server} [flags]
    triptych models tiny --out DIR
    triptych keys generate DIR
    triptych generate "PROMPT" -o out.png | video "PROMPT" -o out.mp4 | status   (HTTP clients of a head)

The flags: docs/design.md, "`triptych serve` flags". `triptych.config.ServeArgs` holds their parsed, validated
values and is what the head and workers receive. The operator builds worker arguments with
`triptych.config.ServeArgs.to_argv`, so the two cannot drift.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from triptych import __version__
from triptych.client_cli import CLIENT_COMMANDS, add_client_commands, run_client_command
from triptych.config import ConfigError, ServeArgs, add_serve_flags


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"triptych: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="triptych", description="Disaggregated diffusion serving.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    serve = sub.add_parser("serve", help="run one role of the pipeline (or all of it, monolithic)")
    add_serve_flags(serve)
    models = sub.add_parser("models", help="model utilities")
    models_sub = models.add_subparsers(dest="models_command", required=True, parser_class=OneLineParser)
    tiny = models_sub.add_parser("tiny", help="write tiny random-weight diffusers packages for tests and demos")
    tiny.add_argument("--out", required=True, help="directory to write the packages into")
    tiny.add_argument("--family", action="append", help="only this package (repeatable); default: all")
    keys = sub.add_parser("keys", help="control-plane keys (CURVE) for --disagg-keys-dir")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, parser_class=OneLineParser)
    generate = keys_sub.add_parser("generate", help="write a head and a worker key pair (secret files 0600)")
    generate.add_argument("dir", help="directory to write them into (created if missing)")
    add_client_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        try:
            args = ServeArgs.from_namespace(ns)
        except ConfigError as exc:
            print(f"triptych: error: {exc}", file=sys.stderr)
            return 2
        from triptych.launch import serve

        return serve(args)
    if ns.command == "models":
        from triptych.tiny_models import write_tiny_models

        try:
            paths = write_tiny_models(ns.out, families=ns.family)
        except ValueError as exc:
            print(f"triptych: error: {exc}", file=sys.stderr)
            return 2
        for path in paths:
            print(path)
        return 0
    if ns.command == "keys":
        from triptych.security import generate_keys

        try:
            paths = generate_keys(ns.dir)
        except (ConfigError, OSError) as exc:
            print(f"triptych: error: {exc}", file=sys.stderr)
            return 2
        for path in paths:
            print(path)
        return 0
    if ns.command in CLIENT_COMMANDS:
        return run_client_command(ns)
    parser.error(f"unknown command {ns.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
