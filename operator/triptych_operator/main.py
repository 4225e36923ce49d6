"""`triptych-operator`: run the DiffusionPipeline operator (kopf) cluster-wide or in some namespaces.

    triptych-operator                          # all namespaces
    triptych-operator -n team-a -n team-b      # only these (or TRIPTYCH_WATCH_NAMESPACES=team-a,team-b)

Peering is off (standalone): run one replica, so no kopf peering CRDs or RBAC are needed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import kopf

from triptych import __version__

WATCH_NAMESPACES_ENV = "TRIPTYCH_WATCH_NAMESPACES"
LIVENESS_ENV = "TRIPTYCH_LIVENESS_ENDPOINT"
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triptych-operator", description=__doc__.splitlines()[0])
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=None,
        help=f"watch only this namespace (repeatable; default: ${WATCH_NAMESPACES_ENV}, else all namespaces)",
    )
    parser.add_argument(
        "--liveness",
        default=os.environ.get(LIVENESS_ENV, DEFAULT_LIVENESS),
        help=f"kopf liveness endpoint (default: ${LIVENESS_ENV} or {DEFAULT_LIVENESS}); '' disables it",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def watched_namespaces(flags: Sequence[str] | None, env: str | None) -> list[str]:
    """Namespaces from the flags, else from the comma-separated env value; empty means cluster-wide."""
    if flags:
        return list(flags)
    return [ns.strip() for ns in (env or "").split(",") if ns.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `triptych-operator` console script."""
    args = build_parser().parse_args(argv)
    namespaces = watched_namespaces(args.namespace, os.environ.get(WATCH_NAMESPACES_ENV))
    import triptych_operator.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose)
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
