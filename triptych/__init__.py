"""Triptych: disaggregated diffusion serving.

This package holds what every deployable shares: roles, the port convention, the wire
protocol and the `triptych` command line. The head, worker and operator packages import it;
nothing here imports them at module import time.
"""

__version__ = "0.1.0"


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    # `triptych.launch_pool` without importing the launcher (httpx) for every `triptych` command.
    if name == "launch_pool":
        from triptych.pool import launch_pool

        return launch_pool
    raise AttributeError(f"module 'triptych' has no attribute {name!r}")
