"""Which roles take each `triptych serve` flag: the one table behind "no flag silently ignored".

A flag given with a non-default value to a process whose role does not use it is refused at
start-up (ServeArgs.validate), naming the flag, the role and what to do. The table starts from the
`--help` groups (serve_help.GROUPS: who a flag is listed for) and overrides them flag by flag where
a group's flag is taken by fewer, or more, roles. Monolithic mode is the head and every stage in
one process on ONE device: it takes the head's HTTP flags and the flags of the stages it runs
in-process, but no control-plane, transfer, worker-pool or multi-device flag.
"""

from __future__ import annotations

from typing import Any

from triptych.roles import FULL_PIPELINE_ROLE, RECEIVING_ROLES, ROLE_SPECS, WORKER_ROLES, Role
from triptych.serve_help import GENERAL, GROUP_OF, flag

EVERY: frozenset[Role] = frozenset(Role)
WORKERS: frozenset[Role] = frozenset(WORKER_ROLES)
SERVER = frozenset({Role.SERVER})
HEADS = frozenset({Role.SERVER, Role.MONOLITHIC})  # the processes that serve HTTP
# The worker roles that load LoRA adapters: the denoiser (transformer part) and those that encode
# prompts (text-encoder part); the operator mounts the catalogue on these (operator serve_args).
LORA_WORKERS = frozenset({Role.DENOISER} | {r for r in WORKER_ROLES if r.runs_affinity(Role.PROMPT_ENCODER)})

# Who takes the flags of each `--help` group, unless OVERRIDES says otherwise for one flag.
GROUP_ROLES: dict[str, frozenset[Role]] = {
    GENERAL: EVERY,
    "head": HEADS,
    "batching": SERVER | WORKERS,
    "worker": WORKERS,
    "parallelism": WORKERS,
    "transfer": WORKERS,
    "control plane security": SERVER | WORKERS,  # monolithic mode has no control plane
    "lora": HEADS | LORA_WORKERS,  # the head checks names; denoisers, prompt encoders, monolithic mode apply them
    "tracing": SERVER | WORKERS,  # a trace follows a request's hops; monolithic mode has none
}

# Flags whose takers differ from their group's. Each line says why.
OVERRIDES: dict[str, frozenset[Role]] = {
    "--served-model-name": HEADS,  # listed under the general group, but only an HTTP process names its model
    "--scheduler-port": SERVER | WORKERS,  # the head's frontend and a worker's work socket; monolithic has neither
    **{flag(role.url_attr): SERVER for role in WORKER_ROLES},  # the disaggregated head's worker lists
    # the disaggregated head's dispatch over worker pools; monolithic runs requests in-process
    **dict.fromkeys(
        (
            "--disagg-dispatch-policy",
            "--disagg-max-retries",
            "--disagg-no-instance-wait",
            "--disagg-migration",
            "--disagg-preemption",
        ),
        SERVER,
    ),
    # the head's bound on a silent worker, and a worker's on a silent head (it releases that head's work)
    "--disagg-heartbeat-timeout": SERVER | WORKERS,
    # the head re-reads its worker lists, a worker its list of heads (dns://, file://)
    "--disagg-discovery-interval": SERVER | WORKERS,
    "--disagg-drain-timeout": EVERY,  # every process drains on SIGTERM (run_monolithic passes it too)
    "--batching-mode": SERVER,  # the head groups requests; workers only take the group size
    "--batching-delay-ms": SERVER,
    "--batching-role-delay-ms": SERVER,
    "--enable-batching-metrics": SERVER,
    # the roles that run text encoding (a full-pipeline denoiser encodes prompts itself); monolithic
    # loads its pipeline without a prompt cache (run_monolithic)
    "--encoder-cache-bytes": frozenset(r for r in WORKER_ROLES if r.runs_affinity(Role.PROMPT_ENCODER))
    | {FULL_PIPELINE_ROLE},
    "--disagg-full-pipeline": frozenset({FULL_PIPELINE_ROLE}),
    "--disagg-load-ahead": frozenset(RECEIVING_ROLES),  # the roles that take tensors through receive slots
    # who opens an edit's image URL: the head's API checks it, the image-encoding stages open it
    "--reference-url-networks": HEADS
    | {r for r in WORKER_ROLES if r.runs_affinity(Role.IMAGE_ENCODER)}
    | {FULL_PIPELINE_ROLE},
    "--lora-cache-bytes": LORA_WORKERS | {Role.MONOLITHIC},  # the processes that hold adapters
    # monolithic mode runs on the device --device and --base-gpu-id name (ServeArgs.resolved_device);
    # the disaggregated head runs no model stage and never reads either
    "--device": WORKERS | {Role.MONOLITHIC},
    "--dtype": WORKERS | {Role.MONOLITHIC},
    "--base-gpu-id": WORKERS | {Role.MONOLITHIC},
    # a role's own degree: that role only
    **{flag(attr): frozenset({role}) for role, spec in ROLE_SPECS.items() for attr in spec.parallel_flags.values()},
}

# Values that change nothing, besides the default: one device, a degree of 1.
INERT: dict[str, tuple[Any, ...]] = {
    "--num-gpus": (1,),
    **dict.fromkeys(("--tp-size", "--sp-degree", "--cfg-parallel-size"), (None, 1)),
    **{flag(a): (None, 1) for spec in ROLE_SPECS.values() for a in spec.parallel_flags.values()},
}

# What to use instead, where a role is refused a flag for a reason the role name alone does not say:
# by (role, --help group), or by (role, flag) for one flag of a group the role otherwise takes.
INSTEAD: dict[tuple[Role, str], str] = {
    (Role.MONOLITHIC, "parallelism"): (
        "monolithic mode runs on one device; run the roles disaggregated (--disagg-role denoiser ...) for multi-device"
    ),
    (Role.SERVER, "--device"): "the head runs no model and uses no device; give --device to its workers",
}


def roles_taking(name: str) -> frozenset[Role]:
    """The roles that take flag `name` (--port)."""
    return OVERRIDES.get(name, GROUP_ROLES[GROUP_OF.get(name, GENERAL)])


def who(roles: frozenset[Role]) -> str:
    """The takers of a flag in words: 'the head (server or monolithic)', 'denoiser', 'workers'."""
    if roles == HEADS:
        return "the head (server or monolithic)"
    if roles == SERVER:
        return "the head (--disagg-role server)"
    if roles == WORKERS:
        return "worker roles (" + ", ".join(r.value for r in WORKER_ROLES) + ")"
    return ", ".join(r.value for r in Role if r in roles)


def refusal(name: str, role: Role) -> str:
    """The one line refusing `name` to `role`."""
    line = f"{name} is for {who(roles_taking(name))}, not {role.value}"
    hint = INSTEAD.get((role, name)) or INSTEAD.get((role, GROUP_OF.get(name, GENERAL)))
    return f"{line}: {hint}" if hint else line


def is_given(name: str, value: Any, default: Any) -> bool:
    """Whether `value` of flag `name` asks for something (a default or inert value does not)."""
    return value != default and value not in INERT.get(name, ())


def first_unused(values: dict[str, Any], defaults: dict[str, Any], role: Role) -> str | None:
    """The first flag (by ServeArgs attribute) given to `role` that it does not take, or None."""
    for attr, value in values.items():
        name = flag(attr)
        if role not in roles_taking(name) and is_given(name, value, defaults[attr]):
            return name
    return None
