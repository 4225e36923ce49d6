"""What a test does when something `make setup` installs is missing (podman, chromium and
Playwright, Mooncake, root for the real node): it fails, naming what and how to get it, so a CI
whose setup went wrong is red rather than quietly skipping. TRIPTYCH_SKIP_MISSING=1 (docs/testing.md)
makes such tests skip instead, for a partial checkout on purpose."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

OPT_OUT = "TRIPTYCH_SKIP_MISSING"


def missing(what: str, how: str = "`make setup` installs it") -> NoReturn:
    """Fail (or, with TRIPTYCH_SKIP_MISSING=1, skip) the test, fixture or module that needs `what`."""
    message = f"{what} is missing ({how}); set {OPT_OUT}=1 to skip the tests that need it instead"
    if os.environ.get(OPT_OUT) == "1":
        pytest.skip(message, allow_module_level=True)
    pytest.fail(message, pytrace=False)
