"""`triptych serve --help`: flags grouped by who uses them, every optional flag's default shown."""

from __future__ import annotations

import argparse
import re

from triptych.cli import build_parser
from triptych.roles import Role
from triptych.serve_help import GROUP_OF, GROUPS


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_help_lists_the_groups_in_order_and_every_flag_under_its_own():
    parser = serve_parser()
    text = parser.format_help()
    positions = [text.index(f"\n{title}:\n") for title in GROUPS]
    assert positions == sorted(positions)
    for flag, title in GROUP_OF.items():
        section = text[text.index(f"\n{title}:\n") :]
        following = [t for t in GROUPS if t != title and f"\n{t}:\n" in section]
        end = min((section.index(f"\n{t}:\n") for t in following), default=len(section))
        assert re.search(rf"^  {re.escape(flag)}\b", section[:end], re.M), f"{flag} is not under {title}"


def test_every_grouped_flag_exists_and_every_optional_flag_shows_its_default():
    parser = serve_parser()
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    assert set(GROUP_OF) <= flags, set(GROUP_OF) - flags
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and not action.required and action.dest != "help":
            shown = formatter._expand_help(action)
            assert "default" in shown, action.option_strings
            assert "(default: )" not in shown, action.option_strings  # an empty string reads as nothing


def test_the_master_port_help_gives_the_default_the_workers_use():
    """--master-port unset is the work port + DEFAULT_MASTER_PORT_OFFSET (triptych_worker.parallel.ranks), not none."""
    from triptych.config import ServeArgs
    from triptych.ports import DEFAULT_MASTER_PORT_OFFSET
    from triptych_worker.parallel.ranks import master_port

    parser = serve_parser()
    action = next(a for a in parser._actions if "--master-port" in a.option_strings)
    text = parser._get_formatter()._expand_help(action)
    assert f"(default: its --scheduler-port + {DEFAULT_MASTER_PORT_OFFSET})" in text and "none" not in text, text
    worker = ServeArgs(model_path="m", disagg_role=Role.DENOISER, scheduler_port=19001)
    assert master_port(worker) == 19001 + DEFAULT_MASTER_PORT_OFFSET


def test_version():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "triptych", "--version"], capture_output=True, text=True, check=True)
    assert re.fullmatch(r"triptych \d+\.\d+\.\d+\n", out.stdout)
