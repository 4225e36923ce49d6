"""`triptych` subcommands from other packages (triptych.cli.PLUGIN_GROUP): the local tooling's
`models tiny` and `demo` come through the entry point pyproject.toml declares, and an install
without devtools/ (every image) leaves them out."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest

from triptych import cli

ROOT = Path(__file__).resolve().parents[2]
DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][cli.PLUGIN_GROUP]


def entry_point(value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name="probe", value=value, group=cli.PLUGIN_GROUP)


@pytest.fixture
def declared_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed metadata as pyproject.toml declares it (an editable install may predate it)."""
    declared = [importlib.metadata.EntryPoint(n, v, cli.PLUGIN_GROUP) for n, v in DECLARED.items()]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: declared if group == cli.PLUGIN_GROUP else [])


def test_the_local_tooling_is_the_one_declared_plugin() -> None:
    assert DECLARED == {"local": "triptych_dev.cli:add_commands"}


def test_models_tiny_and_demo_parse_through_the_declared_plugin() -> None:
    parser = cli.build_parser(cli.plugin_commands([entry_point(DECLARED["local"])]))
    tiny = parser.parse_args(["models", "tiny", "--out", "x", "--family", "tiny-wan"])
    assert (tiny.out, tiny.family, tiny.run.__module__) == ("x", ["tiny-wan"], "triptych_dev.cli")
    demo = parser.parse_args(["demo", "--models", "m"])
    assert (demo.models, demo.out, demo.run.__module__) == ("m", "outputs", "triptych_dev.cli")


def test_an_unknown_tiny_package_is_a_one_line_error_naming_it(
    declared_plugins: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["models", "tiny", "--out", str(tmp_path), "--family", "tiny-sdxl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("triptych: error: unknown tiny model package(s) ['tiny-sdxl']") and "tiny-flux" in err


def test_a_plugin_whose_package_is_absent_is_left_out_as_in_the_images(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.plugin_commands([entry_point("triptych_not_installed.cli:add_commands")]) == []
    parser = cli.build_parser([])
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["models", "tiny", "--out", "x"])
    assert exit_.value.code == 2
    assert "invalid choice: 'models'" in capsys.readouterr().err


def test_a_plugin_that_fails_to_import_something_else_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_triptych_plugin.py").write_text("import a_dependency_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="a_dependency_nobody_installed"):
        cli.plugin_commands([entry_point("broken_triptych_plugin:add_commands")])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["models", "tiny", "--family", "tiny-flux", "--out", "{file}"], "--out {file}: cannot write the packages"),
        (["demo", "--out", "{file}"], "--out {file}: not a folder this command can write"),
        (["demo", "--models", "{file}"], "--models {file}: not a folder this command can write"),
    ],
)
def test_a_folder_option_that_is_a_file_is_a_one_line_error(
    declared_plugins: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    """These ended in FileExistsError tracebacks (the demo's before any process started)."""
    file = tmp_path / "a-file"
    file.write_text("x")
    assert cli.main([a.format(file=file) for a in argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"triptych: error: {says.format(file=file)}"), line
