"""The typed model of a DiffusionPipeline spec: the dataclasses the manifests are built from.

Each attribute is bound to a field of the declaration (declaration.py): by default the camelCase of
its name, or the dotted path in `bound(...)` when the model flattens an object (`batch_max_size` is
`batching.maxSize`). The attribute carries only a name and a type: the default, the bounds and the
prose are the declaration's. The generic parser is `checked`, which walks the declaration
(fields.read: defaults, types, enums, bounds, the CEL rules; errors name the field path and the
value), and `build`, which fills a dataclass from what it returned. `check_model` proves at import
that every declared field has an attribute and every attribute a declared field of a matching type,
so neither can be added without the other. Attributes the cross-field rules compute (rules.py) are
`derived(...)`.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from triptych.parallelism import Parallelism
from triptych.roles import Role
from triptych_operator.constants import MODEL_MOUNT, PIPELINE_ROLES, crd_field
from triptych_operator.fields import MISSING, Field, FieldError, read
from triptych_operator.spec.declaration import (
    DEPRECATED_AUTOSCALING_FIELDS,
    DRAIN_MARGIN_S,
    FULL_PIPELINE,
    ROLE_POOL_FIELDS,
    SPEC,
    role_field,
)
from triptych_operator.spec.head_fields import (
    HEAD_DRAIN_MARGIN_S,
    HEAD_UNROUTE_S,
    SHARED_RESULTS_HEADS,
    UNSHARED_RESULTS_HEADS,
)

T = TypeVar("T")


class SpecError(FieldError):
    """A spec value that cannot work. `str()` starts with the field path and says what to do."""


def bound(path: str) -> dict[str, Any]:
    """Metadata of an attribute read from the declared field at `path` (dotted, relative to its object)."""
    return {"path": path}


def derived(*consumes: str) -> dict[str, Any]:
    """Metadata of an attribute the rules compute (passed to `build`) from the declared fields `consumes`."""
    return {"derived": consumes}


# ---------------------------------------------------------------- the typed model


@dataclass(frozen=True)
class ModelSpec:
    """Where every process loads the model from: a directory on a volume, or a hub id."""

    path: str | None
    pvc_claim_name: str | None = dataclasses.field(metadata=bound("volume.persistentVolumeClaim.claimName"))
    host_path: str | None = dataclasses.field(metadata=bound("volume.hostPath.path"))
    hub_id: str | None = dataclasses.field(metadata=bound("hubId"))
    token_secret_name: str | None = dataclasses.field(metadata=bound("tokenSecretRef.name"))
    token_secret_key: str = dataclasses.field(metadata=bound("tokenSecretRef.key"))
    loras: Sequence[str] = ()  # NAME=SOURCE: --lora-catalog of the head, the encoders and the denoisers

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

    IGNORED: ClassVar[tuple[str, ...]] = DEPRECATED_AUTOSCALING_FIELDS

    enabled: bool
    min_replicas: int
    max_replicas: int | None  # set whenever enabled (a declared rule)
    target_work_seconds_per_replica: int
    scale_down_stabilization_seconds: int

    @property
    def scales_to_zero(self) -> bool:
        """minReplicas 0: idle, the role has no pod (wake.py), and the HPA keeps it at 1 or more while it has work."""
        return self.enabled and self.min_replicas == 0


@dataclass(frozen=True)
class PoolSpec:
    """One worker pool: how many pods, how many GPUs each, and how they split the work."""

    role: Role = dataclasses.field(metadata=derived())
    replicas: int
    gpus_per_replica: int
    # Resolved from spec.<role>.parallelism and gpusPerReplica (rules.py).
    parallelism: Parallelism = dataclasses.field(metadata=derived("parallelism"))
    # Only the degrees the user wrote; these become flags, the worker derives the rest identically.
    explicit_degrees: Mapping[str, int] = dataclasses.field(metadata=derived("parallelism"))
    image: str | None
    resources: Mapping[str, Any]
    node_selector: Mapping[str, str]
    affinity: Mapping[str, Any] | None
    tolerations: Sequence[Mapping[str, Any]]
    extra_args: Sequence[str]
    env: Sequence[Mapping[str, Any]]
    autoscaling: Autoscaling
    # terminationGracePeriodSeconds; the worker's --disagg-drain-timeout is DRAIN_MARGIN_S less.
    drain_seconds: int
    # The Deployment's rolling update; None: the defaults of `rolling_update`.
    max_unavailable: int | None = dataclasses.field(metadata=bound("rollout.maxUnavailable"))
    max_surge: int | None = dataclasses.field(metadata=bound("rollout.maxSurge"))
    # Most compatible requests a worker runs as one batched forward (--batching-max-size; 1: none).
    batch_max_size: int = dataclasses.field(metadata=bound("batching.maxSize"))
    # How long the head lets this role's groups fill (--batching-role-delay-ms); None: the head's delayMs.
    batch_delay_ms: int | None = dataclasses.field(metadata=bound("batching.delayMs"))
    # What the role's model computes in (--dtype): auto, float32, bfloat16, float16.
    dtype: str

    def rolling_update(self) -> dict[str, int]:
        """maxUnavailable/maxSurge of the role's Deployment. Defaults never take a serving role to zero:
        with several replicas one is replaced at a time (no surge: a surge pod would wait for GPUs that are
        taken); a single replica is replaced by a surge pod that must be ready before the old one goes
        (it needs room for one more pod; until there is, the old one keeps serving). An autoscaled role
        counts as several only when its minReplicas is: idle, it may run one pod. One value given as 0
        makes the other 1 whatever the replicas (the API server refuses both 0)."""
        auto = self.autoscaling
        several = auto.min_replicas > 1 if auto.enabled else self.replicas > 1
        unavailable, surge = self.max_unavailable, self.max_surge
        if unavailable is None:
            unavailable = 1 if several or surge == 0 else 0
        if surge is None:
            surge = 1 if not several or unavailable == 0 else 0
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
    mode: str
    rdma_resource_name: str
    rdma_resource_count: int
    ib_device: str | None
    network_annotation: str | None
    pool_size: int

    @property
    def rdma(self) -> bool:
        return self.mode == "rdma"


@dataclass(frozen=True)
class TracingSpec:
    otlp_endpoint: str | None


@dataclass(frozen=True)
class LoggingSpec:
    format: str


@dataclass(frozen=True)
class IngressSpec:
    enabled: bool
    host: str | None
    class_name: str | None
    tls_secret_name: str | None = dataclasses.field(metadata=bound("tls.secretName"))
    annotations: Mapping[str, str]  # over the operator's own (manifests/head.py)
    paths: Sequence[Mapping[str, str]]  # each {path, pathType}, as the Ingress's rule lists them


@dataclass(frozen=True)
class S3Credentials:
    """The Secret whose two keys become the head's AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY."""

    name: str
    access_key_id_key: str
    secret_access_key_key: str


@dataclass(frozen=True)
class S3Results:
    """An S3-compatible bucket every head shares (--results-store and its flags)."""

    url: str
    endpoint: str | None
    credentials: S3Credentials | None = dataclasses.field(metadata=bound("credentialsSecret"))
    presign_seconds: int


@dataclass(frozen=True)
class ResultsSpec:
    """Where the heads keep finished results and video jobs, and for how long."""

    # An existing PVC at --output-path; None: an emptyDir (results last as long as the pod).
    claim_name: str | None = dataclasses.field(metadata=bound("persistentVolumeClaim.claimName"))
    s3: S3Results | None
    max_age_seconds: int
    max_bytes: int

    @property
    def shared(self) -> bool:
        """Whether every head sees every result (a bucket, or one claim they all mount); an emptyDir is one head's."""
        return self.s3 is not None or self.claim_name is not None


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class WebhookSpec:
    """Where the heads POST the ends of video jobs (--webhook-url), signed with the key in a Secret."""

    url: str
    secret: SecretKeyRef


@dataclass(frozen=True)
class HeadSpec:
    # As written; None: the default `replicas` resolves (it depends on the results store).
    requested_replicas: int | None = dataclasses.field(metadata=bound("replicas"))
    service_type: str
    ingress: IngressSpec
    dispatch_policy: str
    timeout_seconds: int
    # terminationGracePeriodSeconds: the preStop sleep (HEAD_UNROUTE_S), then --disagg-drain-timeout,
    # which ends HEAD_DRAIN_MARGIN_S before the kill.
    drain_seconds: int
    results: ResultsSpec
    # The HTTP API's keys (--api-keys-file): one per line in this Secret key; None: the API is open.
    api_keys_secret: SecretKeyRef | None
    # --webhook-url and --webhook-secret-file; None: no webhooks.
    webhook: WebhookSpec | None
    # A kubernetes.io/tls Secret: the heads serve HTTPS with it (--ssl-certfile/--ssl-keyfile); None: HTTP.
    tls_secret_name: str | None = dataclasses.field(metadata=bound("tls.secretName"))
    port: int
    resources: Mapping[str, Any]
    node_selector: Mapping[str, str]
    tolerations: Sequence[Mapping[str, Any]]
    extra_args: Sequence[str]
    env: Sequence[Mapping[str, Any]]
    # How long a group may wait to fill (--batching-delay-ms).
    batch_delay_ms: int = dataclasses.field(metadata=bound("batching.delayMs"))
    # Priority scheduling (--disagg-priority-aging, --disagg-preemption).
    priority_aging_seconds: int = dataclasses.field(metadata=bound("priority.agingSeconds"))
    preemption: bool = dataclasses.field(metadata=bound("priority.preemption"))

    @property
    def replicas(self) -> int:
        """Head pods: as written, else two with shared results (one serves while a rollout replaces the
        other) and one without (each head's emptyDir would hold results the others cannot serve)."""
        if self.requested_replicas is not None:
            return self.requested_replicas
        return SHARED_RESULTS_HEADS if self.results.shared else UNSHARED_RESULTS_HEADS

    @property
    def drain_timeout_seconds(self) -> int:
        """The head's own deadline for the requests it accepted, after SIGTERM."""
        return self.drain_seconds - HEAD_UNROUTE_S - HEAD_DRAIN_MARGIN_S


@dataclass(frozen=True)
class PipelineSpec:
    """A whole DiffusionPipeline, validated: everything the manifests need and nothing else."""

    name: str = dataclasses.field(metadata=derived())
    namespace: str = dataclasses.field(metadata=derived())
    model: ModelSpec
    # The pools in route order (rules.py); with spec.fullPipeline one denoiser pool whose workers run every stage.
    roles: Mapping[Role, PoolSpec] = dataclasses.field(metadata=derived(*ROLE_POOL_FIELDS, "fullPipeline"))
    transfer: TransferSpec
    tracing: TracingSpec
    logging: LoggingSpec
    head: HeadSpec
    worker_image: str = dataclasses.field(metadata=derived("images.worker"))
    head_image: str = dataclasses.field(metadata=derived("images.head"))
    full_pipeline: bool = dataclasses.field(metadata=derived("fullPipeline"))

    def image_for(self, role: Role) -> str:
        return self.roles[role].image or self.worker_image


# ---------------------------------------------------------------- the generic parser


def checked(field: Field, value: Any, where: str) -> Any:
    """`value` checked against the declaration `field` with its defaults filled in (fields.read: types,
    enums, bounds, required fields, CEL rules); SpecError naming the field path, the value and what to do."""
    try:
        return read(field, value, where)
    except FieldError as exc:
        raise SpecError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None


def build(cls: type[T], field: Field, values: Mapping[str, Any], where: str, **derived_values: Any) -> T:
    """`cls` from the checked `values` of `field` (what fields.read returned), plus the derived attributes."""
    hints = typing.get_type_hints(cls)
    kwargs = dict(derived_values)
    for attr in dataclasses.fields(typing.cast(Any, cls)):
        if "derived" in attr.metadata:
            continue
        path = _path(attr)
        declared, value = _lookup(field, values, path)
        kwargs[attr.name] = _convert(hints[attr.name], declared, value, f"{where}.{path}")
    return cls(**kwargs)


def _path(attr: dataclasses.Field[Any]) -> str:
    path = attr.metadata.get("path")
    if path is not None:
        return str(path)
    head, *rest = attr.name.split("_")
    return head + "".join(word.title() for word in rest)


def _declared(field: Field, path: str) -> list[Field]:
    """The fields along `path` under `field`; KeyError naming the first step that is not declared."""
    chain = []
    for step in path.split("."):
        found = next((f for f in field.fields if f.name == step), None)
        if found is None:
            raise KeyError(step)
        chain.append(found)
        field = found
    return chain


def _lookup(field: Field, values: Mapping[str, Any] | None, path: str) -> tuple[Field, Any]:
    """The declared field at `path` and its value; past an object that is not set, the field's default."""
    chain = _declared(field, path)
    for declared in chain:
        if values is None:
            return chain[-1], None if chain[-1].default is MISSING else copy.deepcopy(chain[-1].default)
        values = values.get(declared.name)
    return chain[-1], values


def _optional(hint: Any) -> tuple[Any, bool]:
    """(the hint without None, whether it allowed None)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _convert(hint: Any, declared: Field, value: Any, where: str) -> Any:
    target, optional = _optional(hint)
    if declared.type == "string" and value == "":
        value = None if declared.default is MISSING else declared.default  # an empty string is unset
    if dataclasses.is_dataclass(target):
        if value is None:
            if optional:
                return None
            value = checked(declared, {}, where)  # an unset object: its fields' defaults
        return build(typing.cast(type, target), declared, value, where)
    if declared.type == "array":
        return tuple(value or ())
    if declared.type in ("object", "free", "string-map", "quantity-map"):
        if value is None and optional:
            return None
        return {k: v for k, v in (value or {}).items() if v is not None}
    return value


# ---------------------------------------------------------------- the model checked against the declaration

_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "size": (int,),
    "string": (str,),
    "boolean": (bool,),
    "array": (Sequence,),
    "object": (Mapping,),
    "free": (Mapping,),
    "string-map": (Mapping,),
    "quantity-map": (Mapping,),
}


class ModelError(TypeError):
    """The typed model and the declaration disagree: a programming error, raised at import."""


def check_model(cls: type, field: Field, where: str) -> None:
    """Every attribute of `cls` is a declared field of a matching type (None allowed where the field can be
    unset), and every declared field under `field` is an attribute, derived or IGNORED; ModelError if not."""
    hints = typing.get_type_hints(cls)
    claims: list[str] = list(getattr(cls, "IGNORED", ()))
    for attr in dataclasses.fields(cls):
        if "derived" in attr.metadata:
            claims += attr.metadata["derived"]
            continue
        path = _path(attr)
        claims.append(path)
        try:
            chain = _declared(field, path)
        except KeyError as exc:
            raise ModelError(
                f"{cls.__name__}.{attr.name} reads {where}.{path}, but {where} declares no {exc.args[0]!r}: "
                "declare it (declaration.py) or bind the attribute to a declared path with bound(...)"
            ) from None
        _check_type(cls, attr.name, hints[attr.name], chain, f"{where}.{path}")
    for path in _leaf_paths(field, ""):
        if not any(path == claim or path.startswith(claim + ".") for claim in claims):
            raise ModelError(
                f"{where}.{path} is declared but {cls.__name__} has no attribute for it: add one "
                f"(e.g. `{_snake(path)}: <type>`, spec/model.py), or list it in {cls.__name__}.IGNORED"
            )


def _check_type(cls: type, name: str, hint: Any, chain: list[Field], where: str) -> None:
    target, optional = _optional(hint)
    declared = chain[-1]
    if isinstance(target, type) and dataclasses.is_dataclass(target):
        if declared.type != "object":
            raise ModelError(f"{cls.__name__}.{name} is a {target.__name__}, but {where} is declared {declared.type}")
        check_model(target, declared, where)
        return
    origin = typing.get_origin(target) or target
    if not (isinstance(origin, type) and issubclass(origin, _PYTHON_TYPES[declared.type])):
        raise ModelError(f"{cls.__name__}.{name} is {_name(hint)}, but {where} is declared {declared.type}")
    always_set = declared.default is not MISSING or all(f.required for f in chain)
    container = declared.type in ("array", "object", "string-map", "quantity-map") or (
        declared.type == "free" and not optional
    )
    if not (optional or always_set or container):
        raise ModelError(
            f"{cls.__name__}.{name} cannot be None, but {where} may be unset: make it `{_name(hint)} | None`"
        )


def _name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("collections.abc.", "").replace("typing.", "")


def _leaf_paths(field: Field, prefix: str) -> list[str]:
    paths = []
    for f in field.fields:
        paths += _leaf_paths(f, f"{prefix}{f.name}.") if f.type == "object" and f.fields else [prefix + f.name]
    return paths


def _snake(path: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in path.replace(".", "_"))


def check_all() -> None:
    """The whole typed model against the whole declaration (run at import)."""
    check_model(PipelineSpec, SPEC, "spec")
    for role in PIPELINE_ROLES:
        check_model(PoolSpec, role_field(role), f"spec.{crd_field(role)}")
    check_model(PoolSpec, FULL_PIPELINE, "spec.fullPipeline")


check_all()
