"""`triptych`: the one entrypoint for every role.

    triptych serve --model-path DIR --disagg-role {monolithic,encoder,...,server} [flags]
    triptych keys generate DIR
    triptych generate "PROMPT" -o out.png | video "PROMPT" -o out.mp4 | videos | status   (HTTP clients)

The flags: docs/design.md, "`triptych serve` flags". `triptych.config.ServeArgs` holds their parsed, validated
values and is what the head and workers receive. The operator builds worker arguments with
`triptych.config.ServeArgs.to_argv`, so the two cannot drift.

Other packages add subcommands through the `triptych.commands` entry points (PLUGIN_GROUP): the
local tooling of a dev install (devtools/, `triptych models tiny`, `triptych demo`) does, and the
core never imports it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable, Sequence
from typing import Any

from triptych import __version__
from triptych.client_cli import CLIENT_COMMANDS, add_client_commands, run_client_command
from triptych.config import ConfigError, ServeArgs
from triptych.reference_flags import reference_only_refusal
from triptych.serve_flags import add_serve_flags


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"triptych: error: {message} (see `{self.prog} --help`)\n")


PLUGIN_GROUP = "triptych.commands"
"""Entry points `name = "module:add_commands"`: add_commands(subparsers) adds subcommands whose parsers
set `run` (a function of the parsed namespace returning the exit status) as a default."""

AddCommands = Callable[["argparse._SubParsersAction[Any]"], None]


def plugin_commands(
    entry_points: Sequence[importlib.metadata.EntryPoint] | None = None,
) -> list[AddCommands]:
    """The add_commands functions of the installed plugins (PLUGIN_GROUP).

    An entry point whose package is absent is left out: the images install the project without
    devtools/, and their metadata still declares its entry point. Any other import error is a bug
    in the plugin and propagates.
    """
    found = importlib.metadata.entry_points(group=PLUGIN_GROUP) if entry_points is None else entry_points
    loaded = []
    for entry_point in found:
        try:
            loaded.append(entry_point.load())
        except ModuleNotFoundError as exc:
            package = entry_point.module.partition(".")[0]
            if exc.name is None or exc.name.partition(".")[0] != package:
                raise
    return loaded


def build_parser(plugins: Sequence[AddCommands] = ()) -> argparse.ArgumentParser:
    """The `triptych` parser: the core's subcommands, and those `plugins` add (see plugin_commands)."""
    parser = OneLineParser(prog="triptych", description="Disaggregated diffusion serving.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    serve = sub.add_parser("serve", help="run one role of the pipeline (or all of it, monolithic)")
    add_serve_flags(serve)
    keys = sub.add_parser("keys", help="control-plane keys (CURVE) for --disagg-keys-dir")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, parser_class=OneLineParser)
    generate = keys_sub.add_parser("generate", help="write a head and a worker key pair (secret files 0600)")
    generate.add_argument("dir", help="directory to write them into (created if missing)")
    add_client_commands(sub)
    for add_commands in plugins:
        add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"] and (refusal := reference_only_refusal(argv[1:])) is not None:
        print(f"triptych: error: {refusal}", file=sys.stderr)  # a flag of the reference design only
        return 2
    parser = build_parser(plugin_commands())
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        try:
            args = ServeArgs.from_namespace(ns)
            args.check_files()
        except ConfigError as exc:
            print(f"triptych: error: {exc}", file=sys.stderr)
            return 2
        from triptych.config_checks import secret_file_warnings

        for warning in secret_file_warnings(args):
            print(f"triptych: warning: {warning}", file=sys.stderr)
        from triptych.launch import serve

        return serve(args)
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
    if getattr(ns, "run", None) is not None:  # a plugin's subcommand
        return int(ns.run(ns))
    parser.error(f"unknown command {ns.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
