"""The rules across fields that the declaration cannot state, and `parse_pipeline`, which applies them.

The declaration's own checks (types, bounds, enums, required fields, CEL rules) run in the generic
parser (model.parse). What CEL cannot express is checked here only, once: which pools a pipeline
runs, parallel degrees against the GPU count (triptych.parallelism), Service names that fit, model
paths that stay on their volume, each pod's resources as the API server checks a container's
(spec/resources.py: requests within limits; extended resources and huge pages whole, never
overcommitted), each pod's env (a name once, never a worker's POD_IP), a hostPath model volume under the
operator's allow-list of folders (when it has one), the head's port against its
scheduler ports, the results bucket and the trace collector as the processes' flags check them, and
several heads only with results they all share.
Each pod's argv is checked as `triptych serve` parses it in serve_args. A bad field raises
SpecError naming it, which the operator reports as a Degraded condition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from triptych.config import ConfigError, ServeArgs
from triptych.config_checks import check_otlp_endpoint, check_results_store
from triptych.parallelism import Parallelism, ParallelismError, resolve_parallelism
from triptych.roles import FULL_PIPELINE_ROLE, Role
from triptych_operator.constants import (
    ALLOWED_HOST_PATHS_ENV,
    DEFAULT_HEAD_IMAGE,
    DEFAULT_ROLES,
    DEFAULT_WORKER_IMAGE,
    GPU_RESOURCE,
    HEAD_SCHEDULER_PORT,
    PIPELINE_ROLES,
    POD_IP_ENV,
    crd_field,
)
from triptych_operator.fields import read
from triptych_operator.spec.declaration import (
    FULL_PIPELINE,
    HOST_PATH_RULE,
    NAME_RULE,
    PARALLEL_DEGREES,
    SPEC,
    role_field,
)
from triptych_operator.spec.model import PipelineSpec, PoolSpec, SpecError, build, checked
from triptych_operator.spec.resources import check_resource_name, check_resources

MAX_SERVICE_NAME = 63


def parse_pipeline(
    name: str,
    namespace: str,
    spec: Mapping[str, Any],
    *,
    worker_image: str = DEFAULT_WORKER_IMAGE,
    head_image: str = DEFAULT_HEAD_IMAGE,
    allowed_host_paths: Sequence[str] = (),
) -> PipelineSpec:
    """Parse and validate a DiffusionPipeline spec; raise SpecError naming the first bad field.
    `allowed_host_paths`: the folders a hostPath model volume must lie under (none: any the schema takes)."""
    assert NAME_RULE.check is not None
    if NAME_RULE.check({"metadata.name": name}) is not None:
        raise SpecError("metadata.name", f"{name!r}: {NAME_RULE.message.removeprefix('metadata.name ')}")
    values = checked(SPEC, spec, "spec")  # as the API server would store it: defaults in, unknown keys out
    _check_model_path(values["model"]["path"])
    _check_host_path_allowed(((values["model"]["volume"] or {}).get("hostPath") or {}).get("path"), allowed_host_paths)
    full = values["fullPipeline"]
    roles = _full_pipeline_pool(name, full) if full is not None else _role_pools(name, values)
    if full is None and values["transfer"]["mode"] == "rdma":  # the resource every worker pod then asks for
        check_resource_name(values["transfer"]["rdmaResourceName"], "spec.transfer.rdmaResourceName")
    check_resources(values["head"]["resources"], "spec.head")
    _check_env(values["head"]["env"], "spec.head")
    _check_head_port(values["head"]["port"])
    _check_results_store(values["head"]["results"]["s3"], values["model"]["path"] or values["model"]["hubId"])
    _check_head_replicas(values["head"])
    _check_otlp_endpoint(values["tracing"]["otlpEndpoint"], values["model"]["path"] or values["model"]["hubId"])
    images = values["images"] or {}
    return build(
        PipelineSpec,
        SPEC,
        values,
        "spec",
        name=name,
        namespace=namespace,
        roles=roles,
        worker_image=images.get("worker") or worker_image,
        head_image=images.get("head") or head_image,
        full_pipeline=full is not None,
    )


def pool_roles(spec: Mapping[str, Any]) -> list[Role]:
    """The roles a spec runs a worker pool (a Deployment `<name>-<role.dns_name>`) for, in route order:
    a full pipeline's one pool, else the declared ones, the denoiser and decoder declared or not, and the
    combined encoder when the spec names no encoder. Reads a stored spec as well as a checked one."""
    if spec.get("fullPipeline") is not None:
        return [FULL_PIPELINE_ROLE]
    declared = [role for role in PIPELINE_ROLES if spec.get(crd_field(role)) is not None]
    declared += [role for role in DEFAULT_ROLES if role.spec.crd_field and not role.spec.also_runs]
    if not any(role.runs_affinity(Role.PROMPT_ENCODER) for role in declared):
        declared.insert(0, Role.ENCODER)
    return [role for role in PIPELINE_ROLES if role in declared]


def _role_pools(name: str, values: Mapping[str, Any]) -> dict[Role, PoolSpec]:
    """The declared pools, in route order (pool_roles)."""
    pools = {}
    for role in pool_roles(values):
        field, where = role_field(role), f"spec.{crd_field(role)}"
        raw = values[crd_field(role)]
        pool = raw if raw is not None else read(field, {}, where)
        _check_object_name(name, role, crd_field(role))
        check_resources(pool["resources"], where, _owned(pool, values["transfer"]))
        _check_env(pool["env"], where, worker=True)
        parallelism, given = _parallelism(pool["parallelism"] or {}, max(pool["gpusPerReplica"], 1), where)
        pools[role] = build(PoolSpec, field, pool, where, role=role, parallelism=parallelism, explicit_degrees=given)
    return pools


def _full_pipeline_pool(name: str, pool: Mapping[str, Any]) -> dict[Role, PoolSpec]:
    """spec.fullPipeline: one pool of workers that each run every stage, denoising on all their GPUs."""
    _check_object_name(name, FULL_PIPELINE_ROLE, "fullPipeline")
    where = "spec.fullPipeline"
    check_resources(pool["resources"], where, _owned(pool))
    _check_env(pool["env"], where, worker=True)
    parallelism, given = _parallelism(pool["parallelism"] or {}, max(pool["gpusPerReplica"], 1), where)
    spec = build(
        PoolSpec, FULL_PIPELINE, pool, where, role=FULL_PIPELINE_ROLE, parallelism=parallelism, explicit_degrees=given
    )
    return {FULL_PIPELINE_ROLE: spec}


def _check_object_name(name: str, role: Role, field: str) -> None:
    if len(f"{name}-{role.dns_name}") > MAX_SERVICE_NAME:
        raise SpecError(
            "metadata.name",
            f"{name!r} is too long for spec.{field}: {name}-{role.dns_name} "
            f"must be at most {MAX_SERVICE_NAME} characters (a Service name)",
        )


def _parallelism(raw: Mapping[str, Any], gpus: int, pool: str) -> tuple[Parallelism, dict[str, int]]:
    """The resolved degrees (unset ones derived) and the ones the user wrote."""
    where = f"{pool}.parallelism"
    given = {degree: raw[degree] for degree in PARALLEL_DEGREES if raw.get(degree) is not None}
    try:
        return resolve_parallelism(gpus, where=f"{where}.", **given), given
    except ParallelismError as exc:
        # The message already starts with the field path (where=...).
        raise SpecError(where, str(exc).removeprefix(f"{where}.")) from None


def _owned(pool: Mapping[str, Any], transfer: Mapping[str, Any] | None = None) -> set[str]:
    """The resources whose counts the operator sets on a pool's pods, whatever the spec says (manifests/workers.py):
    the GPUs of a GPU pool, and the RDMA resource in rdma mode (`transfer`: None for a full pipeline, whose workers
    move no tensors)."""
    owned = {GPU_RESOURCE} if pool["gpusPerReplica"] else set()
    if transfer is not None and transfer["mode"] == "rdma":
        owned.add(transfer["rdmaResourceName"])
    return owned


def _check_env(env: Sequence[Mapping[str, Any]] | None, where: str, *, worker: bool = False) -> None:
    """Each name once (server-side apply refuses a container's env with a duplicate), and never a
    worker's POD_IP, which its --disagg-p2p-hostname needs. Other names the operator sets, the user's
    value replaces (manifests.parts.merged_env)."""
    seen: set[str] = set()
    for i, var in enumerate(env or ()):
        name = var["name"]
        if worker and name == POD_IP_ENV:
            raise SpecError(
                f"{where}.env[{i}].name",
                f"{name} is set by the operator (the pod's IP, which the worker announces to its peers); remove it",
            )
        if name in seen:
            raise SpecError(f"{where}.env[{i}].name", f"{name} is set twice in {where}.env; keep one")
        seen.add(name)


def _check_model_path(path: str | None) -> None:
    if path is not None and ".." in path.split("/"):
        raise SpecError("spec.model.path", f"{path!r} must stay inside the volume (no '..')")


def _check_host_path_allowed(path: str | None, allowed: Sequence[str]) -> None:
    """With an allow-list, a hostPath model volume lies under one of its folders (both are checked paths
    without `.` or `..` segments, so a comparison of whole segments is enough)."""
    if path is None or not allowed or any(_is_under(path, folder) for folder in allowed):
        return
    raise SpecError(
        "spec.model.volume.hostPath.path",
        f"{path!r} is not under a folder this cluster allows for hostPath volumes ({', '.join(allowed)}: "
        f"the operator's {ALLOWED_HOST_PATHS_ENV}, chart value allowedHostPaths); put the model under one of them, "
        "or on a persistentVolumeClaim",
    )


def _is_under(path: str, folder: str) -> bool:
    path, folder = path.rstrip("/"), folder.rstrip("/")
    return path == folder or path.startswith(folder + "/")


def allowed_host_paths(entries: Sequence[str], source: str) -> tuple[str, ...]:
    """The operator's allow-list of hostPath folders (`source`: the flag or variable that gave it), each an
    absolute folder as spec.model.volume.hostPath.path must be; ValueError naming the entry that is not."""
    assert HOST_PATH_RULE.check is not None
    for entry in entries:
        if HOST_PATH_RULE.check({"path": entry}) is not None:
            raise ValueError(f"{source}: {entry!r} is not a folder a hostPath may name: {HOST_PATH_RULE.message}")
    return tuple(entries)


def _check_head_port(port: int) -> None:
    if HEAD_SCHEDULER_PORT <= port <= HEAD_SCHEDULER_PORT + 5:
        raise SpecError(
            "spec.head.port",
            f"{port} collides with the head's scheduler ports {HEAD_SCHEDULER_PORT}-{HEAD_SCHEDULER_PORT + 5}",
        )


# The head flags behind spec.head.results.s3, so a refusal names the CR field.
S3_FIELD_OF_FLAG = {
    "--results-s3-endpoint": "endpoint",
    "--results-presign": "presignSeconds",
    "--results-store": "url",
}


def _check_results_store(s3: Mapping[str, Any] | None, model_path: str) -> None:
    """The bucket as the head will check its --results-store flags (the CRD checks only the shape)."""
    if s3 is None:
        return
    args = ServeArgs(
        model_path=model_path,
        disagg_role=Role.SERVER,
        results_store=s3["url"],
        results_s3_endpoint=s3["endpoint"],
        results_presign=s3["presignSeconds"],
    )
    try:
        check_results_store(args)  # the flags' own check, not the whole argv's (that one names only spec.head)
    except ConfigError as exc:
        flag = next((f for f in S3_FIELD_OF_FLAG if str(exc).startswith(f)), "--results-store")
        raise SpecError(f"spec.head.results.s3.{S3_FIELD_OF_FLAG[flag]}", str(exc)) from None


def _check_otlp_endpoint(endpoint: str | None, model_path: str) -> None:
    """The collector's URL as every process will check its --otlp-endpoint."""
    if endpoint is None:
        return
    try:
        check_otlp_endpoint(ServeArgs(model_path=model_path, disagg_role=Role.SERVER, otlp_endpoint=endpoint))
    except ConfigError as exc:
        raise SpecError("spec.tracing.otlpEndpoint", str(exc)) from None


def _check_head_replicas(head: Mapping[str, Any]) -> None:
    """Several heads only with a results store they all share: with an emptyDir each, a URL image or a
    video job would be answered only by the head that made it, and a 404 by the others."""
    replicas, results = head["replicas"], head["results"]
    if replicas is None or replicas <= 1 or results["s3"] is not None or results["persistentVolumeClaim"] is not None:
        return
    raise SpecError(
        "spec.head.replicas",
        f"{replicas} heads need results every head shares: set spec.head.results.s3 (a bucket) or "
        "spec.head.results.persistentVolumeClaim (a ReadWriteMany claim), or run 1 head",
    )
