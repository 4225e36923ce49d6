"""The `triptych-operator` command: which namespaces it watches."""

from __future__ import annotations

from triptych_operator.main import build_parser, watched_namespaces


def test_flags_win_over_the_environment() -> None:
    args = build_parser().parse_args(["-n", "a", "--namespace", "b"])
    assert watched_namespaces(args.namespace, "c,d") == ["a", "b"]


def test_environment_lists_namespaces_comma_separated() -> None:
    assert watched_namespaces(None, " team-a, team-b ,") == ["team-a", "team-b"]


def test_nothing_given_means_cluster_wide() -> None:
    assert watched_namespaces(None, None) == []
    assert watched_namespaces(None, "") == []


def test_liveness_endpoint_can_be_disabled() -> None:
    assert build_parser().parse_args(["--liveness", ""]).liveness == ""
