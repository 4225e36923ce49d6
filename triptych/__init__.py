"""Triptych: disaggregated diffusion serving.

This package holds what every deployable shares: roles, the port convention, the wire
protocol and the `triptych` command line. The head, worker and operator packages import it;
nothing here imports them at module import time, and nothing here imports the local tooling
(triptych_dev: launch_pool, local deployments, tiny models), which no image installs.
"""

__version__ = "0.1.0"


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name == "launch_pool":  # moved to the local tooling, which the core never imports
        raise AttributeError("launch_pool is local tooling now: `from triptych_dev import launch_pool`")
    raise AttributeError(f"module 'triptych' has no attribute {name!r}")
