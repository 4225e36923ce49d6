"""A component `make setup` installs that is missing fails its tests, unless the documented
opt-out (TRIPTYCH_SKIP_MISSING=1) says to skip them."""

from __future__ import annotations

import pytest

from tests.setup_check import OPT_OUT, missing


def test_a_missing_component_fails_naming_it_and_the_opt_out(monkeypatch):
    monkeypatch.delenv(OPT_OUT, raising=False)
    with pytest.raises(pytest.fail.Exception, match=f"podman is missing .*set {OPT_OUT}=1"):
        missing("podman")


def test_with_the_opt_out_it_skips(monkeypatch):
    monkeypatch.setenv(OPT_OUT, "1")
    with pytest.raises(pytest.skip.Exception, match="podman is missing"):
        missing("podman")
