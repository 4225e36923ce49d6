"""The `triptych serve` arguments of each pod, built with triptych.config so they cannot drift.

Every argv is checked the way the process will check it: parsed by the same flag definitions
(`add_serve_flags`) and validated by `ServeArgs.validate`, extraArgs included. A CR whose pods
would exit on start-up is reported instead of deployed, and so is one whose extraArgs change a
flag the operator sets (owned_flags).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from triptych.config import DEFAULT_POOL_SIZE, ROLE_PARALLEL_FLAGS, URL_FLAGS, ConfigError, ServeArgs, flag
from triptych.flag_roles import LORA_WORKERS
from triptych.roles import Role
from triptych.serve_flags import add_serve_flags
from triptych_operator.constants import (
    API_KEYS_FILE,
    HEAD_SCHEDULER_PORT,
    HEAD_TLS_CERT_FILE,
    HEAD_TLS_KEY_FILE,
    HEADS_SERVICE,
    KEYS_MOUNT,
    LORA_CATALOG_FILE,
    OUTPUT_MOUNT,
    PIPELINE_ROLES,
    POD_IP_ENV,
    WEBHOOK_SECRET_FILE,
    WORKER_MASTER_PORT,
    WORKER_PORT,
    crd_field,
)
from triptych_operator.owned_flags import HEAD_SOURCES, refusal, worker_sources
from triptych_operator.spec.model import PipelineSpec, SpecError

CLUSTER_DOMAIN = "cluster.local"
SERVE_COMMAND = ("triptych", "serve")
# Expanded by the kubelet from the container's POD_IP env (downward API): peers reach the worker there.
POD_IP_REF = f"$({POD_IP_ENV})"
# Degrees without a role-specific flag use the generic one, as ServeArgs.parallelism() reads them.
GENERIC_PARALLEL_FLAGS = {"tp": "tp_size", "sp": "sp_degree", "cfg": "cfg_parallel_size"}


def object_name(pipeline_name: str, component: str) -> str:
    """The name shared by a component's Deployment, Service and HPA."""
    return f"{pipeline_name}-{component}"


def service_host(pipeline: PipelineSpec, component: str) -> str:
    return f"{object_name(pipeline.name, component)}.{pipeline.namespace}.svc.{CLUSTER_DOMAIN}"


def head_address(pipeline: PipelineSpec) -> str:
    """--disagg-server-addr for workers: every head pod, as the headless `<name>-heads` Service resolves
    (re-read as heads come and go), at the scheduler port the result ports are derived from.

    Always dns://, whatever head.replicas says: scaling the heads or a rollout's surge head then never
    changes (and rolls) the GPU workers. The price with one head: a worker grants standing receive slots
    only to a single static tcp:// head, so each hop pays a TransferAlloc round trip (docs/design.md)."""
    return f"dns://{service_host(pipeline, HEADS_SERVICE)}:{HEAD_SCHEDULER_PORT}"


def worker_discovery_url(pipeline: PipelineSpec, role: Role) -> str:
    """dns://HOST:PORT: the head resolves the headless Service and treats each address as a worker."""
    return f"dns://{service_host(pipeline, role.dns_name)}:{WORKER_PORT}"


def spec_field_of_flag(container: str, flag_name: str) -> str | None:
    """The CR field behind a worker flag (`--denoiser-ulysses` -> spec.denoiser.parallelism.ulysses), if any;
    `container` is the worker container's name (the role's DNS name)."""
    role = next((r for r in PIPELINE_ROLES if r.dns_name == container), None)
    if role is None:
        return None
    if flag_name == "--num-gpus":
        return f"spec.{crd_field(role)}.gpusPerReplica"
    if flag_name == "--lora-catalog":  # an adapter path without weights refuses a start (triptych.lora)
        return "spec.model.loras"
    for degree, attr in (*ROLE_PARALLEL_FLAGS.get(role, {}).items(), *GENERIC_PARALLEL_FLAGS.items()):
        if flag(attr) == flag_name:
            return f"spec.{crd_field(role)}.parallelism.{degree}"
    return None


def worker_serve_args(pipeline: PipelineSpec, role: Role) -> ServeArgs:
    spec = pipeline.roles[role]
    parallel = {
        ROLE_PARALLEL_FLAGS.get(role, {}).get(degree, GENERIC_PARALLEL_FLAGS.get(degree, "")): value
        for degree, value in spec.explicit_degrees.items()
    }
    return ServeArgs(
        model_path=pipeline.model.model_path,
        disagg_role=role,
        disagg_server_addr=head_address(pipeline),
        scheduler_port=WORKER_PORT,
        num_gpus=spec.num_devices,
        disagg_p2p_hostname=POD_IP_REF,
        disagg_ib_device=pipeline.transfer.ib_device if pipeline.transfer.rdma and not pipeline.full_pipeline else None,
        # a full-pipeline worker moves no tensors: no pool to size (the worker refuses the flag)
        disagg_transfer_pool_size=DEFAULT_POOL_SIZE if pipeline.full_pipeline else pipeline.transfer.pool_size,
        master_port=WORKER_MASTER_PORT if spec.gpus_per_replica > 1 else None,
        device=spec.device,
        dtype=spec.dtype,
        disagg_drain_timeout=float(spec.drain_timeout_seconds),
        disagg_keys_dir=KEYS_MOUNT,
        batching_max_size=spec.batch_max_size,
        disagg_full_pipeline=pipeline.full_pipeline,
        otlp_endpoint=pipeline.tracing.otlp_endpoint or "",
        log_format=pipeline.logging.format,
        # The head checks the names requests give, the denoisers and prompt encoders load them: one catalogue file.
        lora_catalog=LORA_CATALOG_FILE if pipeline.model.loras and role in LORA_WORKERS else None,
        **parallel,  # type: ignore[arg-type]
    )


def head_batching(pipeline: PipelineSpec) -> dict[str, Any]:
    """The head's batching flags: dynamic grouping, with its metrics, when some role batches. Its group
    size is the largest role's; each role's workers heartbeat their own, which bounds their groups."""
    largest = max(spec.batch_max_size for spec in pipeline.roles.values())
    if largest <= 1:
        return {}
    own = [(role, spec.batch_delay_ms) for role, spec in pipeline.roles.items() if spec.batch_delay_ms is not None]
    return {
        "batching_mode": "dynamic",
        "batching_max_size": largest,
        "batching_delay_ms": float(pipeline.head.batch_delay_ms),
        "batching_role_delay_ms": ",".join(f"{role.value}={ms}" for role, ms in own),
        "enable_batching_metrics": True,
    }


def head_results_store(pipeline: PipelineSpec) -> dict[str, Any]:
    """The --results-store flags of head.results.s3 (the credentials are env from its Secret, not flags)."""
    s3 = pipeline.head.results.s3
    if s3 is None:
        return {}
    return {"results_store": s3.url, "results_s3_endpoint": s3.endpoint, "results_presign": s3.presign_seconds}


def head_wake_wait(pipeline: PipelineSpec) -> dict[str, Any]:
    """A role that scales to zero needs a pod's start to wake (scheduling, the image, the model): its
    requests wait for an instance as long as they may live (--disagg-timeout), not the default two minutes."""
    if any(spec.autoscaling.scales_to_zero for spec in pipeline.roles.values()):
        return {"disagg_no_instance_wait": float(pipeline.head.timeout_seconds)}
    return {}


def head_serve_args(pipeline: PipelineSpec) -> ServeArgs:
    urls = {URL_FLAGS[role]: [worker_discovery_url(pipeline, role)] for role in pipeline.roles}
    return ServeArgs(
        model_path=pipeline.model.model_path,
        disagg_role=Role.SERVER,
        scheduler_port=HEAD_SCHEDULER_PORT,
        host="0.0.0.0",
        port=pipeline.head.port,
        disagg_timeout=float(pipeline.head.timeout_seconds),
        disagg_dispatch_policy=pipeline.head.dispatch_policy,
        disagg_priority_aging=float(pipeline.head.priority_aging_seconds),
        disagg_preemption="on" if pipeline.head.preemption else "off",
        output_path=OUTPUT_MOUNT,
        disagg_drain_timeout=float(pipeline.head.drain_timeout_seconds),
        results_max_age=float(pipeline.head.results.max_age_seconds),
        results_max_bytes=pipeline.head.results.max_bytes,
        api_keys_file=API_KEYS_FILE if pipeline.head.api_keys_secret else None,
        webhook_url=pipeline.head.webhook.url if pipeline.head.webhook else None,
        webhook_secret_file=WEBHOOK_SECRET_FILE if pipeline.head.webhook else None,
        ssl_certfile=HEAD_TLS_CERT_FILE if pipeline.head.tls_secret_name else None,
        ssl_keyfile=HEAD_TLS_KEY_FILE if pipeline.head.tls_secret_name else None,
        disagg_keys_dir=KEYS_MOUNT,
        otlp_endpoint=pipeline.tracing.otlp_endpoint or "",
        log_format=pipeline.logging.format,
        lora_catalog=LORA_CATALOG_FILE if pipeline.model.loras else None,
        **head_batching(pipeline),
        **head_results_store(pipeline),
        **head_wake_wait(pipeline),
        **urls,  # type: ignore[arg-type]
    )


def worker_argv(pipeline: PipelineSpec, role: Role) -> list[str]:
    """Container args for a worker of `role` (after `triptych serve`); raises SpecError if they would not start."""
    where = "spec.fullPipeline" if pipeline.full_pipeline else f"spec.{crd_field(role)}"
    own, extra = worker_serve_args(pipeline, role).to_argv(), list(pipeline.roles[role].extra_args)
    check_extra_args(own, extra, worker_sources(role, where), where=where)
    check_argv(own + extra, where=where)
    return own + extra


def head_argv(pipeline: PipelineSpec) -> tuple[list[str], ServeArgs]:
    """Container args for the head (after `triptych serve`), and what the head makes of them (extraArgs
    included); raises SpecError if they would not start."""
    own, extra = head_serve_args(pipeline).to_argv(), list(pipeline.head.extra_args)
    check_extra_args(own, extra, HEAD_SOURCES, where="spec.head")
    return own + extra, check_argv(own + extra, where="spec.head")


class _RaisingParser(argparse.ArgumentParser):
    """The `triptych serve` flags, reporting a bad one as an exception instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


@functools.cache
def _serve_parser() -> _RaisingParser:
    # Built once: building it (~90 flags, help formatters) cost more than all of a pipeline's API calls.
    parser = _RaisingParser(prog="triptych serve", add_help=False)
    add_serve_flags(parser)
    return parser


def check_extra_args(own: Sequence[str], extra: Sequence[str], sources: Mapping[str, str], *, where: str) -> None:
    """SpecError naming `where`.extraArgs if `extra`, after the operator's `own` flags, changes one whose
    `sources` say the spec sets it. Compared as parsed, so `--flag=V` and abbreviations count too, and
    repeating the operator's own value changes nothing."""
    if not extra:
        return
    try:
        before = vars(_serve_parser().parse_args(list(own)))
        after = vars(_serve_parser().parse_args([*own, *extra]))
    except ConfigError:
        return  # check_argv reports what does not parse, naming the flag
    for attr, source in sources.items():
        if after.get(attr) != before.get(attr):
            raise SpecError(f"{where}.extraArgs", refusal(attr, source))


def check_argv(argv: Sequence[str], *, where: str) -> ServeArgs:
    """Parse and validate `argv` exactly as `triptych serve` does; SpecError names `where` (extraArgs live there)."""
    try:
        return ServeArgs.from_namespace(_serve_parser().parse_args(list(argv)))
    except ConfigError as exc:
        raise SpecError(where, f"the process would reject its arguments: {exc}") from None
