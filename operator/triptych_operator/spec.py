"""A DiffusionPipeline's spec: declared once (`SPEC`), parsed into dataclasses, checked like `triptych serve`.

`SPEC` is the one declaration of every field (type, default, bounds, enum, description, CEL rule);
the CRD schema (crd.py), the checks and defaults of `parse_pipeline` (fields.read) and the field
tables of docs/operator.md are generated from it (`make crd`). What CEL cannot express is checked
here only, once: parallel degrees (triptych.parallelism), size strings, the head's port, model
paths, and each pod's argv as `triptych serve` parses it (serve_args). A bad field raises SpecError
naming it, which the operator reports as a Degraded condition.
"""

from __future__ import annotations

import dataclasses
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
)
from triptych.parallelism import Parallelism, ParallelismError, resolve_parallelism
from triptych.roles import FULL_PIPELINE_ROLE, Role
from triptych_operator.constants import (
    DEFAULT_HEAD_IMAGE,
    DEFAULT_RDMA_RESOURCE,
    DEFAULT_ROLES,
    DEFAULT_WORKER_IMAGE,
    HEAD_HTTP_PORT,
    HEAD_SCHEDULER_PORT,
    MAX_NAME_LENGTH,
    MODEL_MOUNT,
    PENDING_WORK_METRIC,
    PIPELINE_ROLES,
    crd_field,
)
from triptych_operator.fields import (
    Field,
    FieldError,
    Rule,
    absent_within,
    all_one_unless_positive,
    bounded_match,
    cel_only,
    exactly_one,
    excludes,
    needs,
    not_above,
    not_both_zero,
    read,
    required_when,
    required_when_equal,
)

TRANSFER_MODES = ("tcp", "rdma")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PARALLEL_DEGREES = ("tp", "sp", "ulysses", "ring", "cfg")
# Only the denoiser has --denoiser-ulysses/--denoiser-ring; other roles derive them from sp.
ROLE_DEGREES: dict[Role, tuple[str, ...]] = {role: role.spec.operator_degrees for role in PIPELINE_ROLES}
DEFAULT_TOKEN_KEY = "token"
DEFAULT_API_KEYS_KEY = "keys"
# Autoscaling defaults: a denoiser replica should have about a minute of queued work before
# another is added, and a pool is shrunk only after ten quiet minutes (model loads take minutes).
DEFAULT_TARGET_WORK_SECONDS = 60
DEFAULT_BATCH_DELAY_MS = 30  # the spec's GLM-Image head: --batching-delay-ms 30
MAX_BATCH_DELAY_MS = 10_000
MAX_BATCH_SIZE = 256
DEFAULT_SCALE_DOWN_STABILIZATION_S = 600
MAX_STABILIZATION_S = 3600  # the HPA API's limit
# Drain: a worker gets SIGTERM, finishes what it holds, and is killed drainSeconds later. The
# default fits the longest request each role runs (a long video's denoising loop takes minutes).
DEFAULT_DRAIN_SECONDS: dict[Role, int] = {role: role.spec.drain_seconds for role in PIPELINE_ROLES}
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


class SpecError(FieldError):
    """A spec value that cannot work. `str()` starts with the field path and says what to do."""


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
    # The Deployment's rolling update; None: the defaults of `rolling_update`.
    max_unavailable: int | None = None
    max_surge: int | None = None
    # Most compatible requests a worker runs as one batched forward (--batching-max-size; 1: none).
    batch_max_size: int = 1

    def rolling_update(self) -> dict[str, int]:
        """maxUnavailable/maxSurge of the role's Deployment. Defaults never take a serving role to zero:
        with several replicas one is replaced at a time (no surge: a surge pod would wait for GPUs that are
        taken); a single replica is replaced by a surge pod that must be ready before the old one goes
        (it needs room for one more pod; until there is, the old one keeps serving)."""
        several = self.replicas > 1 or self.autoscaling.enabled
        unavailable = self.max_unavailable if self.max_unavailable is not None else (1 if several else 0)
        surge = self.max_surge if self.max_surge is not None else (0 if several else 1)
        return {"maxUnavailable": unavailable, "maxSurge": surge}

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
    batch_delay_ms: int = DEFAULT_BATCH_DELAY_MS  # how long a group may wait to fill (--batching-delay-ms)

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
    # spec.fullPipeline: `roles` is one denoiser pool whose workers run every stage (--disagg-full-pipeline).
    full_pipeline: bool = False

    def image_for(self, role: Role) -> str:
        return self.roles[role].image or self.worker_image


# ---------------------------------------------------------------- the declaration

NAME_RULE = bounded_match(
    "metadata.name",
    MAX_NAME_LENGTH,
    NAME_PATTERN,
    f"metadata.name must be a lowercase DNS label of at most {MAX_NAME_LENGTH} characters "
    "(it prefixes Service names such as <name>-denoiser)",
)


def _resources(who: str) -> Field:
    return Field(
        "resources",
        "object",
        "Extra requests/limits (cpu, memory, ...). GPU and RDMA counts are set by the operator.",
        fields=(Field("requests", "quantity-map"), Field("limits", "quantity-map")),
        doc="CPU/memory etc. The operator sets `nvidia.com/gpu` (and the RDMA resource) itself; its counts win."
        if who == "role"
        else "CPU/memory of the head pod.",
        doc_type="`requests`/`limits`: map of quantities",
        doc_row=True,
    )


def _pod_fields(who: str) -> tuple[Field, ...]:
    """nodeSelector, tolerations, extraArgs, env: the same for the roles and the head."""
    return (
        Field("nodeSelector", "string-map", doc="Pod node selector."),
        Field(
            "tolerations",
            "array",
            "Pod tolerations.",
            items=Field("", "free", "A core/v1 Toleration.", doc_type="Toleration"),
            doc="Added to the default toleration for `nvidia.com/gpu:NoSchedule` (a CPU role has only these)."
            if who == "role"
            else "Pod tolerations.",
        ),
        Field(
            "extraArgs",
            "array",
            f"Extra `triptych serve` flags for {'the ' + who if who != 'role' else 'the role'}, appended after "
            "the operator's; validated by the operator like the process validates them.",
            items=Field("", "string", doc_type="string"),
            doc="More `triptych serve` flags, appended after the operator's; checked like the process checks them."
            + (
                " For the head they also set the HTTP limits: `--max-request-bytes` (default 16MiB), "
                "`--max-queued-requests`."
                if who == "head"
                else ""
            ),
        ),
        Field(
            "env",
            "array",
            "Extra environment variables.",
            items=Field(
                "", "free", "A core/v1 EnvVar.", fields=(Field("name", "string", required=True),), doc_type="EnvVar"
            ),
            doc="More container environment.",
        ),
    )


def _parallelism_rule() -> Rule:
    """CEL for what it can see: the degrees set must multiply to gpusPerReplica (or divide it).
    CEL only: resolve_parallelism (in `_parse_role`) is the full check, ulysses x ring = sp included."""

    def d(name: str) -> str:
        return f"self.parallelism.?{name}.orValue(1)"

    tc = f"{d('tp')} * {d('cfg')}"
    sp_product = f"{tc} * self.parallelism.sp == self.gpusPerReplica"
    split_product = f"{tc} * {d('ulysses')} * {d('ring')} == self.gpusPerReplica"
    derived = f"self.gpusPerReplica % ({tc}) == 0"
    return cel_only(
        f"!has(self.parallelism) || self.gpusPerReplica == 0 || (has(self.parallelism.sp) ? {sp_product} : "
        f"((has(self.parallelism.ulysses) || has(self.parallelism.ring)) ? {split_product} : {derived}))",
        # A static message: CEL's cost estimate for a messageExpression with string() is over budget.
        "parallelism: tp x sp x cfg must equal gpusPerReplica; leave a degree unset to derive it",
        reason="FieldValueInvalid",
    )


def _autoscaling() -> Field:
    deprecated = "Deprecated and ignored: the HPA reads " + PENDING_WORK_METRIC + "; set targetWorkSecondsPerReplica."
    deprecated_doc = (
        "Deprecated and ignored (the per-pod queue metric it named was never exported); "
        "kept so older manifests still apply."
    )
    return Field(
        "autoscaling",
        "object",
        f"An HPA on the role's pending work (the Object metric {PENDING_WORK_METRIC} on its Deployment, "
        "served by triptych-metrics-api from the head). See docs/autoscaling.md.",
        fields=(
            Field(
                "enabled",
                "boolean",
                default=False,
                doc="Create an `autoscaling/v2` HPA for the role ([autoscaling.md](autoscaling.md)).",
            ),
            Field(
                "minReplicas",
                "integer",
                "Lower bound.",
                default=1,
                minimum=1,
                doc="HPA lower bound; must be ≤ `maxReplicas`.",
            ),
            Field(
                "maxReplicas",
                "integer",
                "Upper bound; required when enabled.",
                minimum=1,
                doc="HPA upper bound; required when enabled.",
            ),
            Field(
                "targetWorkSecondsPerReplica",
                "integer",
                "Estimated device-seconds of queued + running work per replica the HPA aims for: "
                "replicas = ceil(pending work / this).",
                default=DEFAULT_TARGET_WORK_SECONDS,
                minimum=1,
                doc="Estimated device-seconds of queued + running work per replica: the HPA keeps replicas = "
                f"ceil(`{PENDING_WORK_METRIC}` / this).",
            ),
            Field(
                "scaleDownStabilizationSeconds",
                "integer",
                "The HPA scales down only to the highest recommendation of this many past seconds, so a "
                "momentary dip does not remove busy GPUs.",
                default=DEFAULT_SCALE_DOWN_STABILIZATION_S,
                minimum=0,
                maximum=MAX_STABILIZATION_S,
                doc="The HPA's `behavior.scaleDown.stabilizationWindowSeconds`: "
                "no scale-down on a dip shorter than this.",
            ),
            Field("targetQueueDepth", "integer", deprecated, minimum=1, doc=deprecated_doc),
            Field("metricName", "string", deprecated, doc=deprecated_doc),
        ),
        rules=(
            required_when("maxReplicas", "enabled", "maxReplicas is required when enabled"),
            not_above("minReplicas", "maxReplicas", "minReplicas must be <= maxReplicas"),
        ),
    )


def role_field(role: Role) -> Field:
    """spec.<role>: one worker pool."""
    forbidden = [name for name in PARALLEL_DEGREES if name not in ROLE_DEGREES[role]]
    rules = [
        _parallelism_rule(),
        all_one_unless_positive(
            "gpusPerReplica",
            "parallelism",
            PARALLEL_DEGREES,
            "parallelism: gpusPerReplica 0 runs the role on CPU, one device per pod; set no degree above 1",
            reason="FieldValueInvalid",
        ),
    ]
    if forbidden:
        rules.append(
            absent_within(
                "parallelism", forbidden, f"parallelism: {' and '.join(forbidden)} apply to the denoiser only"
            )
        )
    degree_doc = (
        "Parallel degrees. Unset degrees are derived (`triptych.parallelism.resolve_parallelism`) so that "
        "`tp × sp × cfg = gpusPerReplica` and `ulysses × ring = sp`; "  # noqa: RUF001 (the docs' multiplication sign)
        "explicit values that do not fit are an error, "
        "never silently reduced."
    )
    split_doc = (
        "Denoiser only (`--denoiser-ulysses/--denoiser-ring`); "
        "rejected on the encoder and decoder, which derive them from `sp`."
    )
    degrees = tuple(
        Field(
            name,
            "integer",
            f"{name} degree; unset degrees are derived so tp x sp x cfg = gpusPerReplica.",
            minimum=1,
            doc=split_doc if name in ("ulysses", "ring") else degree_doc,
            doc_default="derived",
        )
        for name in PARALLEL_DEGREES
    )
    drain_defaults = ", ".join(
        f"`{seconds}` {'/'.join(r.value for r in PIPELINE_ROLES if DEFAULT_DRAIN_SECONDS[r] == seconds)}"
        for seconds in sorted(set(DEFAULT_DRAIN_SECONDS.values()))
    )
    # No schema default: a defaulted pool would clash with spec.fullPipeline; the parser gives a role-pool
    # pipeline the denoiser and decoder it does not declare (_parse_roles).
    return Field(
        crd_field(role),
        "object",
        f"The {role.value} worker pool.",
        fields=(
            Field(
                "replicas",
                "integer",
                "Worker pods (ignored while autoscaling is enabled).",
                default=1,
                minimum=0,
                doc="Worker pods. Ignored while `autoscaling.enabled`. 0 parks the role (the pipeline cannot serve).",
            ),
            Field(
                "gpusPerReplica",
                "integer",
                "GPUs per pod (nvidia.com/gpu) = the role's --num-gpus; 0 runs the role on CPU "
                "(no GPU requested or tolerated, --device cpu).",
                default=1,
                minimum=0,
                doc="`nvidia.com/gpu` limit of each pod and its `--num-gpus`, with `--device cuda`. `0`: a CPU role "
                "(`--device cpu`, no GPU limit or toleration; see above).",
            ),
            Field("parallelism", "object", f"Parallel degrees of the {role.value}.", fields=degrees),
            Field(
                "image",
                "string",
                "Image for this role; default spec.images.worker.",
                doc="Image for this role only (e.g. a canary).",
                doc_default="`spec.images.worker`",
            ),
            _resources("role"),
            _pod_fields("role")[0],
            Field("affinity", "free", "A core/v1 Affinity.", doc="Pod affinity, passed through.", doc_type="Affinity"),
            *_pod_fields("role")[1:],
            _autoscaling(),
            Field(
                "rollout",
                "object",
                "How the role's pods are replaced when its pod template changes (a spec edit, a new operator "
                "version): the Deployment's rolling update.",
                fields=(
                    Field(
                        "maxUnavailable",
                        "integer",
                        "Pods that may be down at once; default 1 with several replicas, 0 with one.",
                        minimum=0,
                        doc="Pods that may be down at once during a rollout.",
                        doc_default="`1`; `0` with one replica",
                    ),
                    Field(
                        "maxSurge",
                        "integer",
                        "Extra pods during a rollout; default 0 with several replicas (GPUs are taken), 1 with one.",
                        minimum=0,
                        doc="Extra pods during a rollout (each needs its GPUs free). The defaults never take a role "
                        "to zero: several replicas are replaced one at a time, a single one by a surge pod that is "
                        "ready before the old one stops (until there is room for it, the old pod keeps serving and "
                        "the rollout waits).",
                        doc_default="`0`; `1` with one replica",
                    ),
                ),
                rules=(
                    not_both_zero(
                        "maxUnavailable", "maxSurge", "rollout: maxUnavailable and maxSurge cannot both be 0"
                    ),
                ),
            ),
            Field(
                "batching",
                "object",
                "Batched forwards: the most compatible requests a worker of the role runs as one "
                "(--batching-max-size); above 1 the head groups requests for it (spec.head.batching).",
                fields=(
                    Field(
                        "maxSize",
                        "integer",
                        "Most requests per batched forward; 1: each request alone.",
                        default=1,
                        minimum=1,
                        maximum=MAX_BATCH_SIZE,
                        doc="The workers' `--batching-max-size`: the most compatible requests (same size, steps, "
                        "guidance, ...) one batched forward runs; each worker holds that many times its "
                        "capacity. Above 1 on any role, the head runs `--batching-mode dynamic` "
                        "([batching.md](batching.md)). Not with `gpusPerReplica` above 1.",
                    ),
                ),
            ),
            Field(
                "drainSeconds",
                "integer",
                "terminationGracePeriodSeconds of the role's pods: on SIGTERM a worker finishes what it holds "
                f"within this minus {DRAIN_MARGIN_S} s (--disagg-drain-timeout), then exits.",
                default=DEFAULT_DRAIN_SECONDS[role],
                minimum=MIN_DRAIN_SECONDS,
                doc="The pods' `terminationGracePeriodSeconds`; the worker gets "
                f"`--disagg-drain-timeout` {DRAIN_MARGIN_S} s less to finish and push what it holds after SIGTERM, "
                "then exits 0.",
                doc_default=drain_defaults,
            ),
        ),
        rules=tuple(rules),
    )


MODEL = Field(
    "model",
    "object",
    "The diffusers model every process loads: `path` on a `volume`, or a `hubId`.",
    required=True,
    fields=(
        Field(
            "path",
            "string",
            "Model directory relative to the volume root ('.' for the root).",
            doc="Model directory relative to the volume root (`.` for the root). "
            f"Becomes `--model-path {MODEL_MOUNT}/<path>`. No `..`.",
        ),
        Field(
            "volume",
            "object",
            f"The volume holding the model directory (mounted read-only at {MODEL_MOUNT}).",
            fields=(
                Field(
                    "persistentVolumeClaim",
                    "object",
                    "A PVC in the pipeline's namespace.",
                    fields=(
                        Field(
                            "claimName",
                            "string",
                            "PVC name.",
                            min_length=1,
                            required=True,
                            doc="A PVC in the pipeline's namespace, "
                            f"mounted read-only at `{MODEL_MOUNT}` in every pod. "
                            "Use a ReadOnlyMany/ReadWriteMany volume when pods land on several nodes.",
                        ),
                    ),
                ),
                Field(
                    "hostPath",
                    "object",
                    "A directory on every node.",
                    fields=(
                        Field(
                            "path",
                            "string",
                            "Node path.",
                            min_length=1,
                            required=True,
                            doc=f"A node directory (type `Directory`), mounted read-only at `{MODEL_MOUNT}`. "
                            "Exactly one of `persistentVolumeClaim` and `hostPath`.",
                        ),
                    ),
                ),
            ),
            rules=(
                exactly_one(
                    "persistentVolumeClaim", "hostPath", "set exactly one of persistentVolumeClaim or hostPath"
                ),
            ),
        ),
        Field(
            "hubId",
            "string",
            "Hub repository id (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers), for clusters that reach a hub.",
            doc="Hub repository id (e.g. `black-forest-labs/FLUX.1-dev`), for clusters that reach a hub. Becomes "
            "`--model-path <hubId>`; downloads go to an `emptyDir` at `/cache` (`HF_HOME=/cache/huggingface`).",
        ),
        Field(
            "tokenSecretRef",
            "object",
            "Secret holding the hub token (exposed as HF_TOKEN).",
            fields=(
                Field(
                    "name",
                    "string",
                    "Secret name.",
                    required=True,
                    doc="Secret with the hub token, exposed as `HF_TOKEN`.",
                ),
                Field("key", "string", "Key in the Secret.", default=DEFAULT_TOKEN_KEY, doc="Key in that Secret."),
            ),
        ),
    ),
    rules=(
        exactly_one("path", "hubId", "set exactly one of path or hubId"),
        needs("path", "volume", "path needs a volume"),
    ),
)

TRANSFER = Field(
    "transfer",
    "object",
    "How tensors move between workers (Mooncake).",
    default={},
    fields=(
        Field(
            "mode",
            "string",
            "rdma: GPU-direct over InfiniBand/RoCE; tcp: anywhere.",
            enum=TRANSFER_MODES,
            default="tcp",
            doc="Mooncake transport between workers. "
            "`rdma` adds the RDMA device-plugin resource and `--disagg-ib-device`.",
        ),
        Field(
            "rdmaResourceName",
            "string",
            "Device-plugin resource requested per worker in rdma mode.",
            default=DEFAULT_RDMA_RESOURCE,
            doc="Extended resource requested per worker pod in `rdma` mode.",
        ),
        Field(
            "rdmaResourceCount",
            "integer",
            "How many of rdmaResourceName per worker.",
            default=1,
            minimum=1,
            doc="How many of it.",
        ),
        Field(
            "ibDevice",
            "string",
            "RDMA device (--disagg-ib-device), e.g. mlx5_0; required in rdma mode.",
            doc="RDMA NIC (`mlx5_0`, `mlx5_roce0`); "
            "required in `rdma` mode (without it Mooncake would fall back to TCP).",
        ),
        Field(
            "networkAnnotation",
            "string",
            "Multus k8s.v1.cni.cncf.io/networks value for worker pods.",
            doc="Value of `k8s.v1.cni.cncf.io/networks` on worker pods (Multus secondary network for RoCE).",
        ),
        Field(
            "poolSize",
            "size",
            f"Transfer pool per worker, bytes or 256MiB/1GiB (default {DEFAULT_POOL_SIZE}).",
            default=DEFAULT_POOL_SIZE,
            doc="`--disagg-transfer-pool-size`: bytes, or `256MiB`, `1GiB`; at least 1 MiB.",
            doc_default=f"`{DEFAULT_POOL_SIZE}` ({DEFAULT_POOL_SIZE >> 20} MiB)",
        ),
    ),
    rules=(required_when_equal("ibDevice", "mode", "rdma", "ibDevice is required with mode rdma"),),
)

HEAD = Field(
    "head",
    "object",
    "The GPU-less head (DiffusionServer + HTTP API).",
    default={},
    fields=(
        Field(
            "replicas",
            "integer",
            "0 or 1: the head holds request state and every worker reports to one head.",
            default=1,
            minimum=0,
            maximum=1,
            doc="The head holds request state and every worker serves exactly one head, "
            "so there is never more than one (see [Head rollouts](#head-rollouts-drain-and-results)).",
        ),
        Field(
            "serviceType",
            "string",
            "Type of the <name>-api Service.",
            enum=SERVICE_TYPES,
            default="ClusterIP",
            doc="Type of the `<name>-api` Service (HTTP only).",
        ),
        Field(
            "ingress",
            "object",
            "Optional Ingress to the head's HTTP API.",
            fields=(
                Field("enabled", "boolean", default=False, doc="Create an Ingress to `<name>-api`."),
                Field("host", "string", "Host name.", doc="Required when enabled."),
                Field("className", "string", "IngressClass.", doc="`ingressClassName`."),
                Field(
                    "tls",
                    "object",
                    "TLS.",
                    fields=(Field("secretName", "string", "TLS Secret.", doc="TLS Secret for `host`."),),
                ),
            ),
            rules=(required_when("host", "enabled", "host is required when enabled"),),
        ),
        Field(
            "batching",
            "object",
            "How the head groups requests for roles whose batching.maxSize is above 1.",
            fields=(
                Field(
                    "delayMs",
                    "integer",
                    "--batching-delay-ms: longest a request waits for its group to fill.",
                    default=DEFAULT_BATCH_DELAY_MS,
                    minimum=0,
                    maximum=MAX_BATCH_DELAY_MS,
                    doc="`--batching-delay-ms`: the longest a request waits for its group to fill, for every "
                    "role (the head has one queue timer; each role's group size is its own `batching.maxSize`, "
                    "which its workers heartbeat to the head).",
                ),
            ),
        ),
        Field(
            "dispatchPolicy",
            "string",
            "--disagg-dispatch-policy.",
            enum=DISPATCH_POLICIES,
            default=DISPATCH_POLICIES[0],
            doc="`--disagg-dispatch-policy` (the enum is `triptych.config.DISPATCH_POLICIES`).",
        ),
        Field(
            "timeoutSeconds",
            "integer",
            "--disagg-timeout.",
            default=int(DEFAULT_TIMEOUT_S),
            minimum=1,
            doc="`--disagg-timeout`.",
        ),
        Field(
            "drainSeconds",
            "integer",
            "The head pod's terminationGracePeriodSeconds. On SIGTERM (rollout, deletion) it stops taking "
            "requests and lets accepted ones finish until this minus "
            f"{HEAD_DRAIN_MARGIN_S} s (--disagg-drain-timeout), then fails the rest and exits.",
            default=DEFAULT_HEAD_DRAIN_SECONDS,
            minimum=MIN_HEAD_DRAIN_SECONDS,
            doc="As for the roles, the head pod's `terminationGracePeriodSeconds`. On SIGTERM (rollout, deletion, "
            f"eviction) accepted requests may finish until {HEAD_DRAIN_MARGIN_S} s before it "
            f"(`--disagg-drain-timeout` = `drainSeconds` − {HEAD_DRAIN_MARGIN_S}: "  # noqa: RUF001 (the docs' minus)
            f"the head needs at most {int(HEAD_SHUTDOWN_OVERHEAD_S)} s to answer "
            "its last clients and save its jobs), then fail with a 503 that says so; the head exits as soon as nothing "
            "is left. Keep it above `timeoutSeconds` so any request that can still succeed does (the Wan example uses "
            "900 for both).",
        ),
        Field(
            "results",
            "object",
            "Where the head keeps finished images (URL responses) and video jobs (--output-path), and for how long.",
            default={},
            fields=(
                Field(
                    "persistentVolumeClaim",
                    "object",
                    "An existing PVC mounted at the output path, so results outlive the pod; without it an emptyDir. "
                    "ReadWriteOnce is enough for one head.",
                    fields=(
                        Field(
                            "claimName",
                            "string",
                            "PVC name.",
                            min_length=1,
                            required=True,
                            doc="An existing PVC mounted at the head's `--output-path` "
                            "(`/var/lib/triptych/outputs`): URL images and video jobs survive a head restart. "
                            "ReadWriteOnce is enough for the one head. "
                            "Without it: an `emptyDir` (results survive container restarts, not a new pod).",
                        ),
                    ),
                ),
                Field(
                    "maxAgeSeconds",
                    "integer",
                    "--results-max-age: results older than this are removed.",
                    default=int(DEFAULT_RESULTS_MAX_AGE_S),
                    minimum=1,
                    doc="`--results-max-age`: results older than this are removed.",
                ),
                Field(
                    "maxBytes",
                    "size",
                    "--results-max-bytes: the oldest results are removed beyond this total, bytes or 5GiB "
                    f"(default {DEFAULT_RESULTS_MAX_BYTES}).",
                    default=DEFAULT_RESULTS_MAX_BYTES,
                    doc="`--results-max-bytes`: beyond this total the oldest results are removed. "
                    "Keep it below the claim's size.",
                    doc_default=f"`{DEFAULT_RESULTS_MAX_BYTES}` ({DEFAULT_RESULTS_MAX_BYTES >> 30} GiB)",
                ),
            ),
        ),
        Field(
            "apiKeysSecret",
            "object",
            "API keys of the HTTP API: a Secret in the pipeline's namespace whose `key` holds one key per "
            "line (# comments allowed), mounted into the head as --api-keys-file. Clients send "
            "'Authorization: Bearer KEY'; /health, /ready and /metrics stay open. Updating the Secret "
            "rotates the keys without a restart. Unset: the API is open.",
            fields=(
                Field(
                    "name",
                    "string",
                    "Secret name.",
                    min_length=1,
                    required=True,
                    doc="A Secret in the pipeline's namespace holding the HTTP API's keys, one per line (`#` comments "
                    "allowed). Mounted read-only at `/etc/triptych/api-keys` (a whole-volume mount, so Secret updates "
                    "reach it) and passed as `--api-keys-file`; clients then send `Authorization: Bearer KEY`. "
                    'Updating the Secret rotates keys without a restart (README, "HTTP API and overload"). '
                    "Unset: the API is open.",
                ),
                Field(
                    "key",
                    "string",
                    "Key in the Secret.",
                    default=DEFAULT_API_KEYS_KEY,
                    doc="The Secret's key holding the list.",
                ),
            ),
        ),
        Field(
            "port",
            "integer",
            "HTTP port.",
            default=HEAD_HTTP_PORT,
            minimum=1,
            maximum=65535,
            doc="HTTP port; must not collide with the scheduler ports "
            f"{HEAD_SCHEDULER_PORT}–{HEAD_SCHEDULER_PORT + 5}.",  # noqa: RUF001 (the docs' en dash)
        ),
        _resources("head"),
        *_pod_fields("head"),
    ),
)

IMAGES = Field(
    "images",
    "object",
    "Image overrides (default: the operator's configured images).",
    fields=(
        Field(
            "worker",
            "string",
            "Worker image (CUDA).",
            doc="CUDA worker image for all roles (a role's `image` wins).",
            doc_default="operator's `TRIPTYCH_WORKER_IMAGE` (chart `workerImage`)",
        ),
        Field(
            "head",
            "string",
            "Head image (CPU).",
            doc="CPU head image.",
            doc_default="operator's `TRIPTYCH_HEAD_IMAGE` (chart `headImage`)",
        ),
    ),
)


def full_pipeline_field() -> Field:
    """spec.fullPipeline: one pool whose workers each run the whole pipeline (--disagg-full-pipeline).

    A denoiser pool's fields (its pods are denoiser-role workers, its objects <name>-denoiser) without
    parallelism: a full-pipeline worker runs on one device."""
    pool = role_field(FULL_PIPELINE_ROLE)
    gpus = dataclasses.replace(
        pool.field("gpusPerReplica"),
        description="GPUs per pod: 1, or 0 to run on CPU; a full-pipeline worker runs on one device.",
        maximum=1,
        doc="`1` (one GPU, `--device cuda`) or `0` (CPU); a full-pipeline worker runs on one device.",
    )
    return dataclasses.replace(
        pool,
        name="fullPipeline",
        description="A full-pipeline pool instead of role pools: each worker pod loads the whole pipeline "
        "(encode, denoise, decode) and returns pixels to the head; no tensor moves between pods (no Mooncake). "
        "Exclusive with encoder, promptEncoder, imageEncoder, denoiser and decoder.",
        fields=tuple(gpus if f.name == "gpusPerReplica" else f for f in pool.fields if f.name != "parallelism"),
        rules=(),
    )


FULL_PIPELINE = full_pipeline_field()
ROLE_POOL_FIELDS = tuple(crd_field(role) for role in PIPELINE_ROLES)

SPEC = Field(
    "spec",
    "object",
    "Desired state of a disaggregated diffusion pipeline.",
    required=True,
    fields=(MODEL, *(role_field(role) for role in PIPELINE_ROLES), FULL_PIPELINE, TRANSFER, HEAD, IMAGES),
    rules=(
        excludes(
            "fullPipeline",
            ROLE_POOL_FIELDS,
            "spec.fullPipeline: declare a full-pipeline pool or role pools (encoder, promptEncoder, imageEncoder, "
            "denoiser, decoder), not both",
        ),
        excludes(
            "encoder",
            ("promptEncoder", "imageEncoder"),
            "spec.encoder: declare encoder (three roles) or promptEncoder and imageEncoder (split encoders), not both",
        ),
        needs("imageEncoder", "promptEncoder", "spec.imageEncoder needs spec.promptEncoder (the split encoders)"),
    ),
)

# ---------------------------------------------------------------- the parser


def parse_pipeline(
    name: str,
    namespace: str,
    spec: Mapping[str, Any],
    *,
    worker_image: str = DEFAULT_WORKER_IMAGE,
    head_image: str = DEFAULT_HEAD_IMAGE,
) -> PipelineSpec:
    """Parse and validate a DiffusionPipeline spec; raise SpecError naming the first bad field."""
    assert NAME_RULE.check is not None
    if NAME_RULE.check({"metadata.name": name}) is not None:
        raise SpecError("metadata.name", f"{name!r}: {NAME_RULE.message.removeprefix('metadata.name ')}")
    try:
        values = read(SPEC, spec, "spec")
    except FieldError as exc:
        raise SpecError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
    images = values["images"] or {}
    return PipelineSpec(
        name=name,
        namespace=namespace,
        model=_parse_model(values["model"]),
        roles=_parse_full_pipeline(name, values["fullPipeline"])
        if values["fullPipeline"]
        else _parse_roles(name, values),
        full_pipeline=values["fullPipeline"] is not None,
        transfer=_parse_transfer(values["transfer"]),
        head=_parse_head(values["head"]),
        worker_image=images.get("worker") or worker_image,
        head_image=images.get("head") or head_image,
    )


def _parse_roles(name: str, values: Mapping[str, Any]) -> dict[Role, RoleSpec]:
    """The declared pools, in route order; the denoiser and decoder are there declared or not, and a
    pipeline that names no encoder gets the combined one."""
    declared = [role for role in PIPELINE_ROLES if values[crd_field(role)] is not None]
    declared += [role for role in DEFAULT_ROLES if role.spec.crd_field and not role.spec.also_runs]
    if not any(role.runs_affinity(Role.PROMPT_ENCODER) for role in declared):
        declared.insert(0, Role.ENCODER)
    roles = {}
    for role in (r for r in PIPELINE_ROLES if r in declared):
        field = crd_field(role)
        raw = values[field] if values[field] is not None else read(role_field(role), {}, f"spec.{field}")
        _check_object_name(name, role, field)
        roles[role] = _parse_role(role, raw)
    return roles


def _parse_full_pipeline(name: str, raw: Mapping[str, Any]) -> dict[Role, RoleSpec]:
    _check_object_name(name, FULL_PIPELINE_ROLE, "fullPipeline")
    return {FULL_PIPELINE_ROLE: _parse_role(FULL_PIPELINE_ROLE, {**raw, "parallelism": None})}


def _check_object_name(name: str, role: Role, field: str) -> None:
    if len(f"{name}-{role.dns_name}") > 63:
        raise SpecError("metadata.name", f"{name!r} is too long for spec.{field}: {name}-{role.dns_name} "
                        "must be at most 63 characters (a Service name)")  # fmt: skip


def _parse_model(model: Mapping[str, Any]) -> ModelSpec:
    if model["hubId"] is not None:
        token = model["tokenSecretRef"] or {}
        return ModelSpec(
            hub_id=model["hubId"],
            token_secret_name=token.get("name"),
            token_secret_key=token.get("key") or DEFAULT_TOKEN_KEY,
        )
    path = model["path"]
    if ".." in path.split("/"):
        raise SpecError("spec.model.path", f"{path!r} must stay inside the volume (no '..')")
    volume = model["volume"]
    pvc = (volume["persistentVolumeClaim"] or {}).get("claimName")
    host = (volume["hostPath"] or {}).get("path")
    return ModelSpec(path=path, pvc_claim_name=pvc, host_path=host)


def _parse_parallelism(role: Role, raw: Mapping[str, Any], gpus: int) -> tuple[Parallelism, dict[str, int]]:
    where = f"spec.{crd_field(role)}.parallelism"
    given = {degree: raw[degree] for degree in PARALLEL_DEGREES if raw.get(degree) is not None}
    try:
        return resolve_parallelism(gpus, where=f"{where}.", **given), given
    except ParallelismError as exc:
        # The message already starts with the field path (where=...).
        raise SpecError(f"{where}", str(exc).removeprefix(f"{where}.")) from None


def _parse_autoscaling(raw: Mapping[str, Any]) -> Autoscaling:
    if not raw["enabled"]:
        return Autoscaling()
    return Autoscaling(
        enabled=True,
        min_replicas=raw["minReplicas"],
        max_replicas=raw["maxReplicas"],
        target_work_seconds_per_replica=raw["targetWorkSecondsPerReplica"],
        scale_down_stabilization_seconds=raw["scaleDownStabilizationSeconds"],
    )


def _parse_role(role: Role, raw: Mapping[str, Any]) -> RoleSpec:
    gpus = raw["gpusPerReplica"]
    parallelism, given = _parse_parallelism(role, raw["parallelism"] or {}, max(gpus, 1))
    return RoleSpec(
        role=role,
        replicas=raw["replicas"],
        gpus_per_replica=gpus,
        parallelism=parallelism,
        explicit_degrees=given,
        image=raw["image"] or None,
        resources={k: v for k, v in (raw["resources"] or {}).items() if v is not None},
        node_selector=raw["nodeSelector"] or {},
        affinity=raw["affinity"] or None,
        tolerations=tuple(raw["tolerations"] or ()),
        extra_args=tuple(raw["extraArgs"] or ()),
        env=tuple(raw["env"] or ()),
        autoscaling=_parse_autoscaling(raw["autoscaling"] or {"enabled": False}),
        drain_seconds=raw["drainSeconds"],
        batch_max_size=(raw["batching"] or {}).get("maxSize", 1),
        max_unavailable=(raw["rollout"] or {}).get("maxUnavailable"),
        max_surge=(raw["rollout"] or {}).get("maxSurge"),
    )


def _parse_transfer(raw: Mapping[str, Any]) -> TransferSpec:
    return TransferSpec(
        mode=raw["mode"],
        rdma_resource_name=raw["rdmaResourceName"] or DEFAULT_RDMA_RESOURCE,
        rdma_resource_count=raw["rdmaResourceCount"],
        ib_device=raw["ibDevice"] or None,
        network_annotation=raw["networkAnnotation"] or None,
        pool_size=raw["poolSize"],
    )


def _parse_head(raw: Mapping[str, Any]) -> HeadSpec:
    port = raw["port"]
    if HEAD_SCHEDULER_PORT <= port <= HEAD_SCHEDULER_PORT + 5:
        raise SpecError(
            "spec.head.port",
            f"{port} collides with the head's scheduler ports {HEAD_SCHEDULER_PORT}-{HEAD_SCHEDULER_PORT + 5}",
        )
    ingress = raw["ingress"] or {}
    keys = raw["apiKeysSecret"]
    claim = (raw["results"]["persistentVolumeClaim"] or {}).get("claimName")
    return HeadSpec(
        replicas=raw["replicas"],
        service_type=raw["serviceType"],
        ingress=IngressSpec(
            enabled=bool(ingress.get("enabled")),
            host=ingress.get("host"),
            class_name=ingress.get("className"),
            tls_secret_name=(ingress.get("tls") or {}).get("secretName"),
        ),
        dispatch_policy=raw["dispatchPolicy"],
        batch_delay_ms=(raw["batching"] or {}).get("delayMs", DEFAULT_BATCH_DELAY_MS),
        timeout_seconds=raw["timeoutSeconds"],
        drain_seconds=raw["drainSeconds"],
        results=ResultsSpec(
            claim_name=claim or None,
            max_age_seconds=raw["results"]["maxAgeSeconds"],
            max_bytes=raw["results"]["maxBytes"],
        ),
        api_keys_secret=SecretKeyRef(name=keys["name"], key=keys["key"]) if keys else None,
        port=port,
        resources={k: v for k, v in (raw["resources"] or {}).items() if v is not None},
        node_selector=raw["nodeSelector"] or {},
        tolerations=tuple(raw["tolerations"] or ()),
        extra_args=tuple(raw["extraArgs"] or ()),
        env=tuple(raw["env"] or ()),
    )
