"""`triptych-operator`: run the DiffusionPipeline operator (kopf) cluster-wide or in some namespaces.

    triptych-operator                          # all namespaces
    triptych-operator -n team-a -n team-b      # only these (or TRIPTYCH_WATCH_NAMESPACES=team-a,team-b)

Standalone by default: one replica, no kopf peering resources. For high availability run several
replicas with `--peering NAME` (or TRIPTYCH_PEERING): they share kopf's KopfPeering (namespaced)
or ClusterKopfPeering (cluster-wide) object NAME, the one with the highest priority works and
the others pause; when it stops they resume (at once after a clean exit, within
--peering-lifetime seconds after a crash). Each replica picks a random priority unless given one.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import random
import secrets
import socket
from collections.abc import Sequence

import kopf

from triptych import __version__
from triptych.log_format import FIELDS, JSON, JsonFormatter
from triptych.log_format import FORMATS as LOG_FORMATS
from triptych_operator.constants import ALLOWED_HOST_PATHS_ENV
from triptych_operator.leading import Leadership
from triptych_operator.spec.rules import allowed_host_paths

WATCH_NAMESPACES_ENV = "TRIPTYCH_WATCH_NAMESPACES"
LIVENESS_ENV = "TRIPTYCH_LIVENESS_ENDPOINT"
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
PEERING_ENV = "TRIPTYCH_PEERING"
PEERING_LIFETIME_ENV = "TRIPTYCH_PEERING_LIFETIME"
POD_ID_ENV = "POD_ID"  # kopf's name for it: the pod's name, this replica's name among its peers
# kopf's default: a replica that stops without saying so is taken for dead this long after its last keep-alive.
DEFAULT_PEERING_LIFETIME_S = 60


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
    parser.add_argument(
        "--peering",
        default=os.environ.get(PEERING_ENV) or None,
        help=f"run as one of several replicas, sharing this kopf peering object (default: ${PEERING_ENV}; "
        "unset: standalone, the only replica)",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority: the live replica with the highest one works (default: random)",
    )
    parser.add_argument(
        "--peering-lifetime",
        type=int,
        default=int(os.environ.get(PEERING_LIFETIME_ENV) or DEFAULT_PEERING_LIFETIME_S),
        help="seconds after its last keep-alive that a silent replica is taken for dead and another takes over "
        f"(default: ${PEERING_LIFETIME_ENV} or {DEFAULT_PEERING_LIFETIME_S})",
    )
    parser.add_argument(
        "--allowed-host-path",
        action="append",
        default=None,
        metavar="FOLDER",
        help="refuse a pipeline whose hostPath model volume is not under FOLDER or another one given (repeatable; "
        f"default: ${ALLOWED_HOST_PATHS_ENV}, comma-separated; none: any absolute folder but /)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=LOG_FORMATS[0],
        help="text, or json: one object per line, as the pipeline's processes write them, with the resource "
        "a line is about under `object`",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def own_identity() -> str:
    """This replica's name among its peers (kopf's peering object): its pod's name ($POD_ID, as kopf
    reads it), else host and process, and a random tail so that a restarted process is a new peer."""
    pod = os.environ.get(POD_ID_ENV)
    if pod:
        return pod
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"


def comma_list(env: str | None) -> list[str]:
    """The entries of a comma-separated env value, blanks around and empty entries dropped."""
    return [entry.strip() for entry in (env or "").split(",") if entry.strip()]


def watched_namespaces(flags: Sequence[str] | None, env: str | None) -> list[str]:
    """Namespaces from the flags, else from the comma-separated env value; empty means cluster-wide."""
    if flags:
        return list(flags)
    return comma_list(env)


def host_path_allow_list(flags: Sequence[str] | None, env: str | None) -> tuple[str, ...]:
    """The hostPath folders from the flags, else from the comma-separated env value; empty: no allow-list.
    ValueError naming the flag or variable and the entry that is not an absolute folder."""
    if flags:
        return allowed_host_paths(flags, "--allowed-host-path")
    return allowed_host_paths(comma_list(env), ALLOWED_HOST_PATHS_ENV)


def configure_logging(args: argparse.Namespace) -> None:
    """kopf's handler on the root logger: --verbose, --log-format. json: the pipeline's own JSON lines
    (time, level, process "operator", logger, message, exception), so one log pipeline reads every
    component the same way, with the resource a kopf line is about under `object`."""
    root = logging.getLogger()
    before = set(root.handlers)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.FULL)
    if args.log_format == JSON:
        for handler in root.handlers:
            if handler not in before:  # kopf's own, which it replaces when configured again
                handler.setFormatter(ObjectJsonFormatter("operator"))


class ObjectJsonFormatter(JsonFormatter):
    """A JSON line with the resource a kopf line is about (its `k8s_ref`: apiVersion, kind, name, uid,
    namespace) under `object`."""

    def format(self, record: logging.LogRecord) -> str:
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, dict):
            record = copy.copy(record)
            setattr(record, FIELDS, {**(getattr(record, FIELDS, None) or {}), "object": ref})
        return super().format(record)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `triptych-operator` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    namespaces = watched_namespaces(args.namespace, os.environ.get(WATCH_NAMESPACES_ENV))
    try:
        host_paths = host_path_allow_list(args.allowed_host_path, os.environ.get(ALLOWED_HOST_PATHS_ENV))
    except ValueError as exc:
        parser.error(str(exc))
    import triptych_operator.handlers  # registers the handlers

    triptych_operator.handlers.ALLOWED_HOST_PATHS = host_paths

    configure_logging(args)
    priority = 0
    identity = own_identity()
    if args.peering:
        # Two replicas of equal priority would both pause: random priorities practically never collide.
        priority = args.priority if args.priority is not None else random.randint(1, 2**31 - 1)
        triptych_operator.handlers.PEERING_LIFETIME_S = args.peering_lifetime
        triptych_operator.handlers.LEADERSHIP = Leadership(args.peering, identity, priority, clusterwide=not namespaces)
    kopf.run(
        standalone=not args.peering,
        peering_name=args.peering,
        priority=priority,
        identity=identity,  # type: ignore[arg-type]  # kopf's Identity: a NewType of str, not exported
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
