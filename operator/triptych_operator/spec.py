"""A DiffusionPipeline's spec, parsed into dataclasses and checked the way `triptych serve` checks flags.

The CRD schema rejects what OpenAPI and CEL can express (types, enums, minimums, one-of); this
module catches the rest (parallel degrees via triptych.parallelism, size strings) and raises
SpecError naming the field, so the operator can report it as a Degraded condition.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from triptych.config import (
    DEFAULT_POOL_SIZE,
    DEFAULT_RESULTS_MAX_AGE_S,
    DEFAULT_RESULTS_MAX_BYTES,
    DEFAULT_TIMEOUT_S,
    DISPATCH_POLICIES,
    HEAD_SHUTDOWN_OVERHEAD_S,
    parse_size,
)
from triptych.parallelism import Parallelism, ParallelismError, resolve_parallelism
from triptych.roles import Role
from triptych_operator.constants import (
    DEFAULT_HEAD_IMAGE,
    DEFAULT_RDMA_RESOURCE,
    DEFAULT_WORKER_IMAGE,
    HEAD_HTTP_PORT,
    HEAD_SCHEDULER_PORT,
    MAX_NAME_LENGTH,
    MODEL_MOUNT,
    PIPELINE_ROLES,
)

TRANSFER_MODES = ("tcp", "rdma")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PARALLEL_DEGREES = ("tp", "sp", "ulysses", "ring", "cfg")
# Only the denoiser has --denoiser-ulysses/--denoiser-ring; other roles derive them from sp.
ROLE_DEGREES: dict[Role, tuple[str, ...]] = {
    Role.ENCODER: ("tp", "sp", "cfg"),
    Role.DENOISER: PARALLEL_DEGREES,
    Role.DECODER: ("tp", "sp", "cfg"),
}
DEFAULT_TOKEN_KEY = "token"
DEFAULT_API_KEYS_KEY = "keys"
# Autoscaling defaults: a denoiser replica should have about a minute of queued work before
# another is added, and a pool is shrunk only after ten quiet minutes (model loads take minutes).
DEFAULT_TARGET_WORK_SECONDS = 60
DEFAULT_SCALE_DOWN_STABILIZATION_S = 600
MAX_STABILIZATION_S = 3600  # the HPA API's limit
# Drain: a worker gets SIGTERM, finishes what it holds, and is killed drainSeconds later. The
# default fits the longest request each role runs (a long video's denoising loop takes minutes).
DEFAULT_DRAIN_SECONDS: dict[Role, int] = {Role.ENCODER: 120, Role.DENOISER: 900, Role.DECODER: 120}
# The worker's own deadline is this much earlier, so it exits before the kubelet's SIGKILL.
DRAIN_MARGIN_S = 15
MIN_DRAIN_SECONDS = 2 * DRAIN_MARGIN_S
# The head's drainSeconds means the same (its terminationGracePeriodSeconds); its own deadline leaves
# room for answering the last clients and saving video jobs (HEAD_SHUTDOWN_OVERHEAD_S) as well.
HEAD_DRAIN_MARGIN_S = int(HEAD_SHUTDOWN_OVERHEAD_S) + DRAIN_MARGIN_S
DEFAULT_HEAD_DRAIN_SECONDS = 600
MIN_HEAD_DRAIN_SECONDS = 2 * HEAD_DRAIN_MARGIN_S
# Accepted and ignored (the per-pod queue-depth metric they configured was never exported).
DEPRECATED_AUTOSCALING_FIELDS = ("targetQueueDepth", "metricName")
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class SpecError(ValueError):
    """A spec value that cannot work. `str()` starts with the field path and says what to do."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ModelSpec:
    """Where every process loads the model from: a directory on a volume, or a hub id."""

    path: str | None = None
    pvc_claim_name: str | None = None
    host_path: str | None = None
    hub_id: str | None = None
    token_secret_name: str | None = None
    token_secret_key: str = DEFAULT_TOKEN_KEY

    @property
    def model_path(self) -> str:
        """The --model-path every process gets."""
        if self.hub_id:
            return self.hub_id
        rel = (self.path or "").strip("/")
        return f"{MODEL_MOUNT}/{rel}" if rel and rel != "." else MODEL_MOUNT

    @property
    def uses_volume(self) -> bool:
        return self.hub_id is None


@dataclass(frozen=True)
class Autoscaling:
    """An HPA on the role's pending work: replicas = ceil(device-seconds of work / target per replica)."""

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 1
    target_work_seconds_per_replica: int = DEFAULT_TARGET_WORK_SECONDS
    scale_down_stabilization_seconds: int = DEFAULT_SCALE_DOWN_STABILIZATION_S


@dataclass(frozen=True)
class RoleSpec:
    """One worker pool: how many pods, how many GPUs each, and how they split the work."""

    role: Role
    replicas: int = 1
    gpus_per_replica: int = 1
    parallelism: Parallelism = field(default_factory=Parallelism)
    # Only the degrees the user wrote; these become flags, the worker derives the rest identically.
    explicit_degrees: Mapping[str, int] = field(default_factory=dict)
    image: str | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    affinity: Mapping[str, Any] | None = None
    tolerations: Sequence[Mapping[str, Any]] = ()
    extra_args: Sequence[str] = ()
    env: Sequence[Mapping[str, Any]] = ()
    autoscaling: Autoscaling = field(default_factory=Autoscaling)
    # terminationGracePeriodSeconds; the worker's --disagg-drain-timeout is DRAIN_MARGIN_S less.
    drain_seconds: int = DEFAULT_DRAIN_SECONDS[Role.DENOISER]

    @property
    def drain_timeout_seconds(self) -> int:
        """The worker's own deadline for finishing held work after SIGTERM."""
        return self.drain_seconds - DRAIN_MARGIN_S

    @property
    def device(self) -> str:
        """The worker's --device: gpusPerReplica 0 makes a CPU role (no GPU requested, one device per pod)."""
        return "cpu" if self.gpus_per_replica == 0 else "cuda"

    @property
    def num_devices(self) -> int:
        """The worker's --num-gpus: the GPUs it holds, or its one CPU device."""
        return max(self.gpus_per_replica, 1)


@dataclass(frozen=True)
class TransferSpec:
    mode: str = "tcp"
    rdma_resource_name: str = DEFAULT_RDMA_RESOURCE
    rdma_resource_count: int = 1
    ib_device: str | None = None
    network_annotation: str | None = None
    pool_size: int = DEFAULT_POOL_SIZE

    @property
    def rdma(self) -> bool:
        return self.mode == "rdma"


@dataclass(frozen=True)
class IngressSpec:
    enabled: bool = False
    host: str | None = None
    class_name: str | None = None
    tls_secret_name: str | None = None


@dataclass(frozen=True)
class ResultsSpec:
    """Where the head keeps finished results and video jobs (--output-path), and for how long."""

    claim_name: str | None = None  # an existing PVC; None: an emptyDir (results last as long as the pod)
    max_age_seconds: int = int(DEFAULT_RESULTS_MAX_AGE_S)
    max_bytes: int = DEFAULT_RESULTS_MAX_BYTES


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class HeadSpec:
    replicas: int = 1
    service_type: str = "ClusterIP"
    ingress: IngressSpec = field(default_factory=IngressSpec)
    dispatch_policy: str = "round_robin"
    timeout_seconds: int = int(DEFAULT_TIMEOUT_S)
    # terminationGracePeriodSeconds; the head's --disagg-drain-timeout is HEAD_DRAIN_MARGIN_S less.
    drain_seconds: int = DEFAULT_HEAD_DRAIN_SECONDS
    results: ResultsSpec = field(default_factory=ResultsSpec)
    # The HTTP API's keys (--api-keys-file): one per line in this Secret key; None: the API is open.
    api_keys_secret: SecretKeyRef | None = None
    port: int = HEAD_HTTP_PORT
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    extra_args: Sequence[str] = ()
    env: Sequence[Mapping[str, Any]] = ()

    @property
    def drain_timeout_seconds(self) -> int:
        """The head's own deadline for the requests it accepted, after SIGTERM."""
        return self.drain_seconds - HEAD_DRAIN_MARGIN_S


@dataclass(frozen=True)
class PipelineSpec:
    """A whole DiffusionPipeline, validated: everything the manifests need and nothing else."""

    name: str
    namespace: str
    model: ModelSpec
    roles: Mapping[Role, RoleSpec]
    transfer: TransferSpec
    head: HeadSpec
    worker_image: str
    head_image: str

    def image_for(self, role: Role) -> str:
        return self.roles[role].image or self.worker_image


def parse_pipeline(
    name: str,
    namespace: str,
    spec: Mapping[str, Any],
    *,
    worker_image: str = DEFAULT_WORKER_IMAGE,
    head_image: str = DEFAULT_HEAD_IMAGE,
) -> PipelineSpec:
    """Parse and validate a DiffusionPipeline spec; raise SpecError naming the first bad field."""
    if len(name) > MAX_NAME_LENGTH or not re.match(NAME_PATTERN, name):
        raise SpecError(
            "metadata.name",
            f"{name!r} must be a lowercase DNS label of at most {MAX_NAME_LENGTH} characters "
            "(it prefixes Service names such as <name>-denoiser)",
        )
    images = _mapping(spec, "images", "spec.images")
    return PipelineSpec(
        name=name,
        namespace=namespace,
        model=_parse_model(_mapping(spec, "model", "spec.model", required=True)),
        roles={role: _parse_role(role, _mapping(spec, role.value, f"spec.{role.value}")) for role in PIPELINE_ROLES},
        transfer=_parse_transfer(_mapping(spec, "transfer", "spec.transfer")),
        head=_parse_head(_mapping(spec, "head", "spec.head")),
        worker_image=images.get("worker") or worker_image,
        head_image=images.get("head") or head_image,
    )


def _mapping(parent: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> Mapping[str, Any]:
    value = parent.get(key)
    if value is None:
        if required:
            raise SpecError(where, "is required")
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(where, f"must be an object, not {type(value).__name__}")
    return value


def _int(
    obj: Mapping[str, Any], key: str, where: str, default: int, *, minimum: int, maximum: int | None = None
) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}.{key}", f"must be an integer, not {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise SpecError(f"{where}.{key}", f"is {value}; it must be {bound}")
    return value


def _choice(obj: Mapping[str, Any], key: str, where: str, default: str, choices: Sequence[str]) -> str:
    value = obj.get(key, default)
    if value not in choices:
        raise SpecError(f"{where}.{key}", f"is {value!r}; choose one of {', '.join(choices)}")
    return str(value)


def _strings(obj: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = obj.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"{where}.{key}", "must be a list of strings")
    return tuple(value)


def _parse_model(model: Mapping[str, Any]) -> ModelSpec:
    path, hub_id = model.get("path"), model.get("hubId")
    if (path is None) == (hub_id is None):
        raise SpecError("spec.model", "set exactly one of path (with volume) or hubId")
    if hub_id is not None:
        token = _mapping(model, "tokenSecretRef", "spec.model.tokenSecretRef")
        return ModelSpec(
            hub_id=str(hub_id),
            token_secret_name=token.get("name"),
            token_secret_key=token.get("key") or DEFAULT_TOKEN_KEY,
        )
    if ".." in str(path).split("/"):
        raise SpecError("spec.model.path", f"{path!r} must stay inside the volume (no '..')")
    volume = _mapping(model, "volume", "spec.model.volume", required=True)
    pvc = _mapping(volume, "persistentVolumeClaim", "spec.model.volume.persistentVolumeClaim").get("claimName")
    host = _mapping(volume, "hostPath", "spec.model.volume.hostPath").get("path")
    if (pvc is None) == (host is None):
        raise SpecError("spec.model.volume", "set exactly one of persistentVolumeClaim.claimName or hostPath.path")
    return ModelSpec(path=str(path), pvc_claim_name=pvc, host_path=host)


def _parse_parallelism(role: Role, raw: Mapping[str, Any], gpus: int) -> tuple[Parallelism, dict[str, int]]:
    where = f"spec.{role.value}.parallelism"
    allowed = ROLE_DEGREES[role]
    given: dict[str, int] = {}
    for degree in PARALLEL_DEGREES:
        if raw.get(degree) is None:
            continue
        if degree not in allowed:
            raise SpecError(f"{where}.{degree}", f"only the denoiser takes {degree}; {role.value} derives it from sp")
        given[degree] = _int(raw, degree, where, 1, minimum=1)
    try:
        return resolve_parallelism(gpus, where=f"{where}.", **given), given
    except ParallelismError as exc:
        # The message already starts with the field path (where=...).
        raise SpecError(f"{where}", str(exc).removeprefix(f"{where}.")) from None


def _parse_autoscaling(raw: Mapping[str, Any], where: str) -> Autoscaling:
    if not raw.get("enabled", False):
        return Autoscaling()
    low = _int(raw, "minReplicas", where, 1, minimum=1)
    if raw.get("maxReplicas") is None:
        raise SpecError(f"{where}.maxReplicas", "is required when autoscaling is enabled")
    high = _int(raw, "maxReplicas", where, low, minimum=1)
    if low > high:
        raise SpecError(where, f"minReplicas {low} is above maxReplicas {high}")
    return Autoscaling(
        enabled=True,
        min_replicas=low,
        max_replicas=high,
        target_work_seconds_per_replica=_int(
            raw, "targetWorkSecondsPerReplica", where, DEFAULT_TARGET_WORK_SECONDS, minimum=1
        ),
        scale_down_stabilization_seconds=_int(
            raw,
            "scaleDownStabilizationSeconds",
            where,
            DEFAULT_SCALE_DOWN_STABILIZATION_S,
            minimum=0,
            maximum=MAX_STABILIZATION_S,
        ),
    )


def _parse_role(role: Role, raw: Mapping[str, Any]) -> RoleSpec:
    where = f"spec.{role.value}"
    gpus = _int(raw, "gpusPerReplica", where, 1, minimum=0)
    raw_parallelism = _mapping(raw, "parallelism", f"{where}.parallelism")
    if gpus == 0:
        split = sorted(d for d in PARALLEL_DEGREES if raw_parallelism.get(d) not in (None, 1))
        if split:
            raise SpecError(
                f"{where}.parallelism.{split[0]}",
                "is above 1, but gpusPerReplica 0 runs the role on CPU, one device per pod: "
                "remove the parallel degrees or request GPUs",
            )
    parallelism, given = _parse_parallelism(role, raw_parallelism, max(gpus, 1))
    return RoleSpec(
        role=role,
        replicas=_int(raw, "replicas", where, 1, minimum=0),
        gpus_per_replica=gpus,
        parallelism=parallelism,
        explicit_degrees=given,
        image=raw.get("image") or None,
        resources=_mapping(raw, "resources", f"{where}.resources"),
        node_selector=_mapping(raw, "nodeSelector", f"{where}.nodeSelector"),
        affinity=raw.get("affinity") or None,
        tolerations=tuple(raw.get("tolerations") or ()),
        extra_args=_strings(raw, "extraArgs", where),
        env=tuple(raw.get("env") or ()),
        autoscaling=_parse_autoscaling(_mapping(raw, "autoscaling", f"{where}.autoscaling"), f"{where}.autoscaling"),
        drain_seconds=_int(raw, "drainSeconds", where, DEFAULT_DRAIN_SECONDS[role], minimum=MIN_DRAIN_SECONDS),
    )


def _size(obj: Mapping[str, Any], key: str, where: str, default: int) -> int:
    """Bytes from an integer or a size string such as 256MiB."""
    value = obj.get(key, default)
    try:
        return value if isinstance(value, int) and not isinstance(value, bool) else parse_size(str(value))
    except argparse.ArgumentTypeError as exc:
        raise SpecError(f"{where}.{key}", str(exc)) from None


def _parse_results(raw: Mapping[str, Any], where: str) -> ResultsSpec:
    claim = _mapping(raw, "persistentVolumeClaim", f"{where}.persistentVolumeClaim").get("claimName")
    return ResultsSpec(
        claim_name=str(claim) if claim else None,
        max_age_seconds=_int(raw, "maxAgeSeconds", where, ResultsSpec.max_age_seconds, minimum=1),
        max_bytes=_size(raw, "maxBytes", where, ResultsSpec.max_bytes),
    )


def _parse_transfer(raw: Mapping[str, Any]) -> TransferSpec:
    where = "spec.transfer"
    mode = _choice(raw, "mode", where, "tcp", TRANSFER_MODES)
    ib_device = raw.get("ibDevice") or None
    if mode == "rdma" and not ib_device:
        raise SpecError(f"{where}.ibDevice", "is required with mode rdma (e.g. mlx5_0); use mode tcp without RDMA")
    pool = raw.get("poolSize", DEFAULT_POOL_SIZE)
    try:
        pool_size = pool if isinstance(pool, int) and not isinstance(pool, bool) else parse_size(str(pool))
    except argparse.ArgumentTypeError as exc:
        raise SpecError(f"{where}.poolSize", str(exc)) from None
    return TransferSpec(
        mode=mode,
        rdma_resource_name=raw.get("rdmaResourceName") or DEFAULT_RDMA_RESOURCE,
        rdma_resource_count=_int(raw, "rdmaResourceCount", where, 1, minimum=1),
        ib_device=ib_device,
        network_annotation=raw.get("networkAnnotation") or None,
        pool_size=pool_size,
    )


def _parse_secret_ref(raw: Mapping[str, Any], key: str, where: str, default_key: str) -> SecretKeyRef | None:
    ref = _mapping(raw, key, f"{where}.{key}")
    if not ref:
        return None
    name = ref.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError(f"{where}.{key}.name", "is required: the name of a Secret in the pipeline's namespace")
    return SecretKeyRef(name=name, key=str(ref.get("key") or default_key))


def _parse_head(raw: Mapping[str, Any]) -> HeadSpec:
    where = "spec.head"
    ingress = _mapping(raw, "ingress", f"{where}.ingress")
    port = _int(raw, "port", where, HEAD_HTTP_PORT, minimum=1, maximum=65535)
    if HEAD_SCHEDULER_PORT <= port <= HEAD_SCHEDULER_PORT + 5:
        raise SpecError(
            f"{where}.port",
            f"{port} collides with the head's scheduler ports {HEAD_SCHEDULER_PORT}-{HEAD_SCHEDULER_PORT + 5}",
        )
    if ingress.get("enabled") and not ingress.get("host"):
        raise SpecError(f"{where}.ingress.host", "is required when the ingress is enabled")
    return HeadSpec(
        # One head at most: it owns the request state and every worker reports to exactly one head.
        replicas=_int(raw, "replicas", where, 1, minimum=0, maximum=1),
        service_type=_choice(raw, "serviceType", where, "ClusterIP", SERVICE_TYPES),
        ingress=IngressSpec(
            enabled=bool(ingress.get("enabled", False)),
            host=ingress.get("host"),
            class_name=ingress.get("className"),
            tls_secret_name=_mapping(ingress, "tls", f"{where}.ingress.tls").get("secretName"),
        ),
        dispatch_policy=_choice(raw, "dispatchPolicy", where, "round_robin", DISPATCH_POLICIES),
        timeout_seconds=_int(raw, "timeoutSeconds", where, int(DEFAULT_TIMEOUT_S), minimum=1),
        drain_seconds=_int(raw, "drainSeconds", where, DEFAULT_HEAD_DRAIN_SECONDS, minimum=MIN_HEAD_DRAIN_SECONDS),
        results=_parse_results(_mapping(raw, "results", f"{where}.results"), f"{where}.results"),
        api_keys_secret=_parse_secret_ref(raw, "apiKeysSecret", where, DEFAULT_API_KEYS_KEY),
        port=port,
        resources=_mapping(raw, "resources", f"{where}.resources"),
        node_selector=_mapping(raw, "nodeSelector", f"{where}.nodeSelector"),
        tolerations=tuple(raw.get("tolerations") or ()),
        extra_args=_strings(raw, "extraArgs", where),
        env=tuple(raw.get("env") or ()),
    )
