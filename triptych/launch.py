"""`triptych serve`: start the process for the chosen --disagg-role."""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType
from typing import NoReturn

from triptych import log_format, startup
from triptych.config import ConfigError, ServeArgs
from triptych.families.package import PackageError
from triptych.model_source import ModelSourceError, model_names, resolve_model_path
from triptych.open_files import raise_open_files_limit
from triptych.reference import allow_url_networks, parse_networks
from triptych.roles import Role


def configure_logging(args: ServeArgs, process: str | None = None) -> None:
    """--log-level and --log-format on stderr; `process` names it in each line (default: its role)."""
    log_format.configure(args.log_level, args.log_format, process or args.disagg_role.value)


# What each install extra brings (pyproject.toml); a role started without its extra says which.
EXTRA_OF_PACKAGE = {
    **dict.fromkeys(("torch", "diffusers", "transformers", "accelerate", "safetensors"), "worker"),
    **dict.fromkeys(("fastapi", "uvicorn", "av", "PIL", "prometheus_client"), "head"),
}


def serve(args: ServeArgs) -> int:
    startup.mark("started")
    # Until the role serves (and installs its drain), SIGTERM stops the process at once: nothing was
    # accepted yet. As a container's PID 1 a signal without a handler is ignored, so a pod deleted
    # while its model loads would load on, then take work, until its grace period's SIGKILL.
    signal.signal(signal.SIGTERM, _stop_while_starting)
    configure_logging(args)
    raise_open_files_limit()  # before any socket: a worker's ranks and the bind shim's re-execution inherit it
    try:
        given = args.model_path
        args.model_path = resolve_model_path(given)
        allow_url_networks(parse_networks(args.reference_url_networks))  # image edits' URL references
        return _serve_role(args, model_names(given, args.model_path, args.served_model_name))
    except (ModelSourceError, ConfigError) as exc:  # e.g. unreadable --disagg-keys-dir, found at start-up
        print(f"triptych: error: {exc}", file=sys.stderr)
        return 2
    except PackageError as exc:  # a package that is not one: its index, a config, the weights
        print(f"triptych: error: --model-path {given}: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF_PACKAGE.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(
            f"triptych: error: --disagg-role {args.disagg_role.value} needs {exc.name}, which this install lacks: "
            f"install the project's `{extra}` extra (pip install 'triptych[{extra}]'), or use the image that "
            f"has it (monolithic mode and the worker roles run from the worker image)",
            file=sys.stderr,
        )
        return 2


def _stop_while_starting(signum: int, frame: FrameType | None) -> None:
    os.write(2, b"triptych: SIGTERM while starting: exiting before serving\n")  # async-signal-safe
    os._exit(128 + signal.SIGTERM)


def _serve_role(args: ServeArgs, names: list[str]) -> int:
    if args.disagg_role is Role.SERVER:
        from triptych_head.main import run_head

        return run_head(args, names)
    if args.disagg_role is Role.MONOLITHIC:
        from triptych_head.main import run_monolithic

        return run_monolithic(args, names)
    from triptych_worker.transfer.listeners import confine_mooncake_listeners

    if not args.disagg_full_pipeline:  # a full-pipeline worker starts no Mooncake engine
        # Before the worker's imports: re-executing under the bind shim repeats only what came before.
        confine_mooncake_listeners(args)
    from triptych_worker.runtime import run_worker

    _exit_at_once(run_worker(args))


def _exit_at_once(code: int) -> NoReturn:
    """End a worker process that has closed everything it holds (sockets, Mooncake, its ranks die
    with it): the interpreter's own teardown of torch and the model only delays a drained pod's exit
    (1-3 s measured on a loaded CPU host, more with CUDA); nothing is left to flush but the logs."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
