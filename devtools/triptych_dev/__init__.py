"""Triptych's local tooling: everything that runs a deployment on one machine, for development,
tests, benchmarks and demos. No image installs it (the Dockerfiles copy triptych/, head/, worker/
and operator/ only), and no shipped package imports it (tests/unit/test_layering.py).

    from triptych_dev import launch_pool      # a head and worker pools as local processes
    triptych models tiny --out .models        # tiny random-weight diffusers packages (tiny_models)
    triptych demo                             # `make demo` (demo)

- localdeploy: a head plus workers as local `triptych serve` processes (LocalDeployment)
- pool: launch_pool, the Python API on top of it (the design's launch_pool_disagg_server)
- prefork: the preloaded interpreter the test suite forks its workers from
- null_pipeline: zero-compute workers for measuring the control and transfer planes
- tiny_models: tiny random-weight diffusers packages
- demo: `make demo`
- cli: `triptych models tiny` and `triptych demo` (a plugin of the `triptych` command; also
  `python -m triptych_dev`)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from triptych_dev.pool import launch_pool

__all__ = ["launch_pool"]


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    # `triptych_dev.launch_pool` without importing the launcher (httpx) for `triptych models tiny`.
    if name == "launch_pool":
        from triptych_dev.pool import launch_pool

        return launch_pool
    raise AttributeError(f"module 'triptych_dev' has no attribute {name!r}")
