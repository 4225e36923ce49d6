"""`triptych_dev.launch_pool`: a whole local deployment (head + worker pools) from Python.

    from triptych_dev import launch_pool

    with launch_pool(
        ".models/tiny-flux",
        encoder_gpus=[[0]],
        denoiser_gpus=[[1, 2, 3, 4], [5, 6, 7, 8]],  # two denoisers of four GPUs each (the reference design's shape)
        decoder_gpus=[[0]],
        denoiser_sp=4,
    ) as pool:
        httpx.post(f"{pool.url}/v1/images/generations", json={"prompt": "a lighthouse"})

`<role>_gpus` and `<role>_devices` are one argument under two names (the reference design's and ours). Each
inner list is one instance of the role with `--num-gpus len(list)`: GPU indices (made visible to
it as CUDA_VISIBLE_DEVICES), or "cpu" once per CPU rank; with `device="cpu"`, GPU index lists run
as that many CPU ranks (the same pool shape on a machine without GPUs).

Every process is a real `triptych serve`, as on separate machines (ZMQ control plane with a key
set written to the work directory, Mooncake transfers over loopback TCP). The reference design's
`launch_pool_disagg_server` made into a context manager: it returns once every worker
heartbeats to the head, and stops every process on exit. It is local tooling (it starts
processes on this machine), so it lives outside the shipped packages; `triptych_dev.launch_pool`
is its public import path.
"""

from __future__ import annotations

import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triptych.config import ServeArgs, flag
from triptych.flag_roles import WORKERS, roles_taking
from triptych.roles import (
    COMBINED_ROLES,
    FULL_PIPELINE_ROLE,
    ROLE_SPECS,
    SPLIT_ROLES,
    WORKER_ROLES,
    Role,
    is_full_pipeline,
)
from triptych_dev.localdeploy import Device, LocalDeployment, check_devices, local_deployment

Devices = Sequence[Sequence[Device]]


@dataclass
class Pool:
    """A running local deployment: `url` is the head's HTTP API; `deployment` its processes and logs."""

    url: str
    deployment: LocalDeployment


def serve_flags_argv(flags: dict[str, Any]) -> list[str]:
    """`triptych serve` arguments by ServeArgs name: denoiser_sp=4 -> --denoiser-sp 4, simulate=True -> --simulate."""
    known = set(ServeArgs.__dataclass_fields__)
    argv: list[str] = []
    for name, value in flags.items():
        if name not in known:
            raise TypeError(f"launch_pool: {name}={value!r} is not a `triptych serve` flag (see triptych serve --help)")
        if isinstance(value, bool):
            argv += [flag(name)] if value else []
        else:
            argv += [flag(name), ";".join(value) if isinstance(value, list) else str(value)]
    return argv


@dataclass
class RoutedFlags:
    """`triptych serve` flags by ServeArgs name, split by the processes that take them."""

    head: dict[str, Any] = field(default_factory=dict)
    workers: dict[str, Any] = field(default_factory=dict)  # every worker role
    roles: dict[Role, dict[str, Any]] = field(default_factory=dict)  # one role's own (--denoiser-sp)


def route_flags(flags: dict[str, Any]) -> RoutedFlags:
    """Each flag to the processes whose role takes it (triptych.flag_roles, the table ServeArgs.validate
    refuses by): the head's to the head, one every worker role takes to every worker, one only some
    worker roles take (denoiser_sp, encoder_cache_bytes) to those roles' workers only. A flag given to
    a process that does not take it would be refused at its start-up."""
    known = set(ServeArgs.__dataclass_fields__)
    routed = RoutedFlags()
    for name, value in flags.items():
        if name not in known:
            raise TypeError(f"launch_pool: {name}={value!r} is not a `triptych serve` flag (see triptych serve --help)")
        takers = roles_taking(flag(name))
        if Role.SERVER in takers:
            routed.head[name] = value
        if WORKERS <= takers:
            routed.workers[name] = value
            continue
        for role in WORKER_ROLES:
            if role in takers:
                routed.roles.setdefault(role, {})[name] = value
    return routed


CPU: Devices = (("cpu",),)


DEVICE_SUFFIXES = ("_devices", "_gpus")


def role_devices(kwargs: dict[str, Any], cpu: bool = False) -> dict[Role, Devices]:
    """The `<role>_devices`/`<role>_gpus` arguments by role (encoder_gpus -> Role.ENCODER), checked; the rest
    stay in kwargs. `cpu`: GPU indices become CPU ranks, one per index. Errors name the argument."""
    out: dict[Role, Devices] = {}
    given: dict[Role, str] = {}
    for name in [n for n in kwargs if n.endswith(DEVICE_SUFFIXES)]:
        suffix = next(s for s in DEVICE_SUFFIXES if name.endswith(s))
        stem = name.removesuffix(suffix)
        try:
            role = Role(stem)
        except ValueError:
            role = Role.SERVER
        if not role.is_worker:
            roles = ", ".join(f"{r.value}{suffix}" for r in WORKER_ROLES)
            raise TypeError(f"launch_pool: {name} names no worker role; use {roles}")
        if role in given:
            raise TypeError(f"launch_pool: {given[role]} and {name} are the same argument; give one")
        given[role] = name
        out[role] = _instances(name, kwargs.pop(name), cpu)
    return out


def _instances(name: str, value: Any, cpu: bool) -> Devices:
    """One role's instances: a non-empty list of device lists, each valid for device_flags."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"launch_pool: {name}={value!r}: give a list of instances, each a list of devices: [[0, 1]]")
    instances = []
    for i, devices in enumerate(value):
        if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
            raise ValueError(
                f'launch_pool: {name}[{i}]={devices!r}: an instance is a list of devices: [0, 1] or ["cpu"]'
            )
        if cpu and all(isinstance(d, int) and not isinstance(d, bool) for d in devices):
            devices = ["cpu"] * len(devices)
        try:
            check_devices(devices)
        except ValueError as exc:
            raise ValueError(f"launch_pool: {name}[{i}]: {exc}") from None
        instances.append(list(devices))
    return instances


@contextmanager
def launch_pool(
    model_path: str | Path,
    *,
    head_flags: dict[str, Any] | None = None,
    worker_flags: dict[str, Any] | None = None,
    workdir: str | Path | None = None,
    ready_timeout: float = 300,
    full_pipeline: bool = False,
    **kwargs: Any,
) -> Iterator[Pool]:
    """Start a head and one worker per device list, wait until all are ready, stop all on exit.

    `<role>_gpus` or `<role>_devices` (encoder_gpus, prompt_encoder_gpus, image_encoder_gpus,
    denoiser_gpus, decoder_gpus) list a role's instances, each a list of devices: `[["cpu"]]`
    (the default for the roles of the topology), GPU indices (`[[0, 1]]`: one worker on GPUs 0
    and 1, `--num-gpus 2`), or `[["cpu", "cpu"]]` (one worker of two CPU ranks); with
    `device="cpu"`, GPU index lists run as CPU ranks. The split encoders (prompt_encoder_gpus, and
    image_encoder_gpus for image edits) replace the combined encoder. The other keyword arguments
    are `triptych serve` flags by ServeArgs name, each given to the processes that take it
    (route_flags: `disagg_dispatch_policy` to the head, `disagg_transfer_pool_size` to every worker,
    `denoiser_sp=4` to the denoisers, `device` to every worker: the head runs no model); `head_flags`
    go to the head only, `worker_flags` to every worker (`simulate=True`).
    `full_pipeline=True`: a full-pipeline pool instead, denoisers only (denoiser_devices), each running
    every stage (--disagg-full-pipeline) and returning pixels to a head with only --denoiser-urls.
    Logs and keys go to `workdir` (a temporary directory, removed on exit, when not given).
    Raises ValueError for a bad device list or topology, RuntimeError/TimeoutError (with the
    processes' logs) when the deployment does not come up.
    """
    cpu = str({**kwargs, **(worker_flags or {})}.get("device", "")).startswith("cpu")
    given = role_devices(kwargs, cpu)
    if kwargs.get("master_port") is not None and any(len(d) > 1 for ds in given.values() for d in ds):
        raise ValueError(
            f"launch_pool: master_port={kwargs['master_port']}: every multi-device instance gets a free "
            f"rendezvous port of its own; leave master_port unset"
        )
    devices = pool_devices(given, full_pipeline)
    routed = route_flags(kwargs)
    with tempfile.TemporaryDirectory(prefix="triptych-pool-") as tmp:
        with local_deployment(
            Path(model_path),
            Path(workdir) if workdir is not None else Path(tmp),
            {role: len(d) for role, d in devices.items()},
            head_flags=serve_flags_argv({**routed.head, **(head_flags or {})}),
            worker_flags=serve_flags_argv({**routed.workers, **(worker_flags or {})}),
            role_flags={role: serve_flags_argv(flags) for role, flags in routed.roles.items()},
            devices=devices,
            ready_timeout=ready_timeout,
            full_pipeline=full_pipeline,
        ) as dep:
            yield Pool(url=dep.http, deployment=dep)


def pool_devices(given: dict[Role, Devices], full_pipeline: bool) -> dict[Role, Devices]:
    """Every role of the topology with its instances' devices (one CPU instance unless given)."""
    if full_pipeline:
        if not is_full_pipeline({FULL_PIPELINE_ROLE, *given}):
            others = ", ".join(f"{role.value}_devices" for role in given if role is not FULL_PIPELINE_ROLE)
            raise ValueError(f"full_pipeline=True runs {FULL_PIPELINE_ROLE.value}_devices only, not {others}")
        return {FULL_PIPELINE_ROLE: list(given.get(FULL_PIPELINE_ROLE, CPU))}
    split = any(ROLE_SPECS[role].split_encoder for role in given)
    if split and Role.ENCODER in given:
        raise ValueError("give encoder_devices or prompt_encoder_devices/image_encoder_devices, not both")
    if Role.IMAGE_ENCODER in given and Role.PROMPT_ENCODER not in given:
        raise ValueError("image_encoder_devices needs prompt_encoder_devices as well")
    topology = SPLIT_ROLES if split else COMBINED_ROLES
    return {
        role: list(given.get(role, CPU))
        for role in topology
        if role in given or not ROLE_SPECS[role].needs_reference  # the image encoder only when asked for
    }


def launch_pool_disagg_server(
    server_args: ServeArgs,
    *,
    ready: Callable[[Pool], None] | None = None,
    stop: threading.Event | None = None,
    **devices: Any,
) -> None:
    """The reference design's Python API, as it has it: start the pool `server_args` describes with
    the given `<role>_gpus` (encoder_gpus=[[0]], denoiser_gpus=[[1, 2, 3, 4], [5, 6, 7, 8]], ...),
    serve until SIGINT or SIGTERM (or `stop` is set), then stop every process. Each flag of
    `server_args` that differs from its default reaches the processes that take it (route_flags).
    `ready` is called with the running pool (the default prints the head's URL).

        if __name__ == "__main__":
            from triptych.config import ServeArgs
            from triptych_dev.pool import launch_pool_disagg_server

            server_args = ServeArgs.from_kwargs(model_path=".models/tiny-flux", denoiser_sp=2, device="cpu")
            launch_pool_disagg_server(server_args, encoder_gpus=[[0]], denoiser_gpus=[[1, 2]], decoder_gpus=[[0]])
    """
    unknown = [name for name in devices if not name.endswith(DEVICE_SUFFIXES)]
    if unknown:
        raise TypeError(
            f"launch_pool_disagg_server: {unknown[0]} is not a <role>_gpus argument; flags go in server_args"
        )
    defaults = ServeArgs(model_path=server_args.model_path)
    flags = {
        name: getattr(server_args, name)
        for name in ServeArgs.__dataclass_fields__
        if name not in ("model_path", "disagg_role") and getattr(server_args, name) != getattr(defaults, name)
    }
    stop = stop or threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with launch_pool(server_args.model_path, **flags, **devices) as pool:
            (ready or (lambda p: print(f"triptych: serving on {p.url} (Ctrl-C stops)", flush=True)))(pool)
            stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
