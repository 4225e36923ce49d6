"""The `triptych-operator` command: which namespaces it watches, whether it peers, how it logs."""

from __future__ import annotations

import json
import logging

import pytest

from triptych_operator.constants import ALLOWED_HOST_PATHS_ENV
from triptych_operator.main import (
    PEERING_ENV,
    PEERING_LIFETIME_ENV,
    build_parser,
    configure_logging,
    host_path_allow_list,
    main,
    watched_namespaces,
)


def test_flags_win_over_the_environment() -> None:
    args = build_parser().parse_args(["-n", "a", "--namespace", "b"])
    assert watched_namespaces(args.namespace, "c,d") == ["a", "b"]


def test_environment_lists_namespaces_comma_separated() -> None:
    assert watched_namespaces(None, " team-a, team-b ,") == ["team-a", "team-b"]


def test_nothing_given_means_cluster_wide() -> None:
    assert watched_namespaces(None, None) == []
    assert watched_namespaces(None, "") == []


def test_the_host_path_allow_list_comes_from_the_flags_else_the_environment_and_none_means_no_list() -> None:
    args = build_parser().parse_args(["--allowed-host-path", "/srv/models", "--allowed-host-path", "/mnt/m"])
    assert host_path_allow_list(args.allowed_host_path, "/other") == ("/srv/models", "/mnt/m")
    assert host_path_allow_list(None, " /srv/models, /mnt/m ,") == ("/srv/models", "/mnt/m")
    assert host_path_allow_list(None, None) == host_path_allow_list(None, "") == ()


@pytest.mark.parametrize("entry", ["models", "/", "/srv/../etc"])
def test_an_allow_list_entry_that_is_not_an_absolute_folder_stops_the_operator_naming_it(
    entry: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ALLOWED_HOST_PATHS_ENV, f"/srv/models,{entry}")
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert f"{ALLOWED_HOST_PATHS_ENV}: {entry!r} is not a folder a hostPath may name" in capsys.readouterr().err


def test_liveness_endpoint_can_be_disabled() -> None:
    assert build_parser().parse_args(["--liveness", ""]).liveness == ""


def test_standalone_unless_a_peering_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEERING_ENV, raising=False)
    assert build_parser().parse_args([]).peering is None
    monkeypatch.setenv(PEERING_ENV, "rel-triptych")
    monkeypatch.setenv(PEERING_LIFETIME_ENV, "15")
    args = build_parser().parse_args([])
    assert (args.peering, args.peering_lifetime, args.priority) == ("rel-triptych", 15, None)


def test_log_format_json_makes_every_line_an_object_naming_the_resource(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging(build_parser().parse_args(["--log-format", "json"]))
        logging.getLogger("kopf.objects").info(
            "Handler 'create_fn' succeeded.", extra={"k8s_ref": {"kind": "DiffusionPipeline", "name": "wan-t2v"}}
        )
        logging.getLogger("triptych_operator.handlers").warning("no object")
        objects, plain = (json.loads(line) for line in capsys.readouterr().err.strip().splitlines()[-2:])
        # The pipeline's processes' fields (triptych.log_format), so one log pipeline reads every component.
        assert objects["message"] == "Handler 'create_fn' succeeded."
        assert (objects["level"], objects["process"], objects["logger"]) == ("INFO", "operator", "kopf.objects")
        assert objects["object"] == {"kind": "DiffusionPipeline", "name": "wan-t2v"}
        assert objects["time"].endswith("Z")
        assert (plain["level"], plain["message"]) == ("WARNING", "no object") and "object" not in plain
        configure_logging(build_parser().parse_args([]))  # text: kopf's full format, as before
        logging.getLogger("kopf.objects").info("plain")
        assert capsys.readouterr().err.rstrip().endswith("plain")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
