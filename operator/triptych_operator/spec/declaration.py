"""What a DiffusionPipeline spec may say: every field declared once, as a tree of `fields.Field`.

Each field has its type, default, bounds, enum, its one prose text and the CEL rules across its
object; the CRD schema and the field tables of docs/operator.md (crd.py, `make crd`), the parser's
checks and defaults (fields.read) and the typed model (model.py, checked against this tree) all come
from here. Change this module to add, remove or re-describe a field (the head's: head_fields.py).
"""

from __future__ import annotations

import dataclasses

from triptych.config import DEFAULT_POOL_SIZE, DTYPES
from triptych.log_format import FORMATS as LOG_FORMATS
from triptych.model_source import HUB_ID
from triptych.roles import FULL_PIPELINE_ROLE, Role
from triptych_operator.constants import (
    DEFAULT_RDMA_RESOURCE,
    HUB_TOKEN_FILE,
    MAX_NAME_LENGTH,
    MODEL_MOUNT,
    PENDING_WORK_METRIC,
    PIPELINE_ROLES,
    crd_field,
)
from triptych_operator.fields import (
    Field,
    Rule,
    absent_within,
    all_one_unless_positive,
    bounded_match,
    cel_only,
    each_at_most,
    exactly_one,
    excludes,
    matches_and_avoids,
    needs,
    not_above,
    not_above_limit,
    not_both_zero,
    required_when,
    required_when_equal,
)
from triptych_operator.spec.head_fields import HEAD, MAX_BATCH_DELAY_MS
from triptych_operator.spec.pod_fields import DRAIN_MARGIN_S, MAX_DRAIN_SECONDS, pod_fields, resources_field

TRANSFER_MODES = ("tcp", "rdma")
PARALLEL_DEGREES = ("tp", "sp", "ulysses", "ring", "cfg")
# Only the denoiser has --denoiser-ulysses/--denoiser-ring; other roles derive them from sp.
ROLE_DEGREES: dict[Role, tuple[str, ...]] = {role: role.spec.operator_degrees for role in PIPELINE_ROLES}
DEFAULT_TOKEN_KEY = "token"
# Autoscaling defaults: a denoiser replica should have about a minute of queued work before
# another is added, and a pool is shrunk only after ten quiet minutes (model loads take minutes).
DEFAULT_TARGET_WORK_SECONDS = 60
MAX_BATCH_SIZE = 256
DEFAULT_SCALE_DOWN_STABILIZATION_S = 600
MAX_STABILIZATION_S = 3600  # the HPA API's limit
# Drain: a worker gets SIGTERM, finishes (a denoiser: hands off) what it holds, and is killed
# drainSeconds later (triptych/roles.py says why each role's default).
DEFAULT_DRAIN_SECONDS: dict[Role, int] = {role: role.spec.drain_seconds for role in PIPELINE_ROLES}
MIN_DRAIN_SECONDS = 2 * DRAIN_MARGIN_S
# Accepted and ignored (the per-pod queue-depth metric they configured was never exported).
DEPRECATED_AUTOSCALING_FIELDS = ("targetQueueDepth", "metricName")
_OPERATOR_IMAGE = "operator's `TRIPTYCH_%s_IMAGE` (chart `%sImage`)"
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

NAME_RULE = bounded_match(
    "metadata.name",
    MAX_NAME_LENGTH,
    NAME_PATTERN,
    f"metadata.name must be a lowercase DNS label of at most {MAX_NAME_LENGTH} characters "
    "(it prefixes Service names such as <name>-denoiser)",
)


def _parallelism_rule() -> Rule:
    """CEL for what it can see: the degrees set must multiply to gpusPerReplica (or divide it).
    CEL only: resolve_parallelism (in rules.py) is the full check, ulysses x ring = sp included."""

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
    deprecated = (
        "Deprecated and ignored: the per-pod queue metric it named was never exported, the HPA reads "
        f"{PENDING_WORK_METRIC} (set `targetWorkSecondsPerReplica`); kept so older manifests still apply."
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
                "Create an `autoscaling/v2` HPA for the role (docs/autoscaling.md).",
                default=False,
            ),
            Field(
                "minReplicas",
                "integer",
                "HPA lower bound; must be <= `maxReplicas`. 0: the role scales to zero after "
                "`scaleDownStabilizationSeconds` without pending work, and back up as soon as a request needs it "
                "(the operator makes both steps; docs/autoscaling.md#scale-to-zero).",
                default=1,
                minimum=0,
            ),
            Field("maxReplicas", "integer", "HPA upper bound; required when enabled.", minimum=1),
            Field(
                "targetWorkSecondsPerReplica",
                "integer",
                "Estimated device-seconds of queued + running work per replica: the HPA keeps replicas = "
                f"ceil(`{PENDING_WORK_METRIC}` / this).",
                default=DEFAULT_TARGET_WORK_SECONDS,
                minimum=1,
            ),
            Field(
                "scaleDownStabilizationSeconds",
                "integer",
                "The HPA's `behavior.scaleDown.stabilizationWindowSeconds`: it scales down only to the highest "
                "recommendation of this many past seconds, so a momentary dip does not remove busy GPUs.",
                default=DEFAULT_SCALE_DOWN_STABILIZATION_S,
                minimum=0,
                maximum=MAX_STABILIZATION_S,
            ),
            Field("targetQueueDepth", "integer", deprecated, minimum=1),
            Field("metricName", "string", deprecated),
        ),
        rules=(
            required_when("maxReplicas", "enabled", "maxReplicas is required when enabled"),
            not_above("minReplicas", "maxReplicas", "minReplicas must be <= maxReplicas"),
        ),
    )


def _degree(name: str) -> Field:
    text = (
        "Denoiser only (`--denoiser-ulysses`/`--denoiser-ring`), with `ulysses x ring = sp`; rejected on the "
        "encoders and the decoder, which derive them from `sp`."
        if name in ("ulysses", "ring")
        else "Parallel degree. Unset degrees are derived (`triptych.parallelism.resolve_parallelism`) so that "
        "`tp x sp x cfg = gpusPerReplica` and `ulysses x ring = sp`; explicit values that do not fit are an "
        "error, never silently reduced."
    )
    return Field(name, "integer", text, minimum=1, doc_default="derived")


def _rollout() -> Field:
    unavailable = (
        "Pods that may be down at once during a rollout; default 1 with several replicas (an autoscaled role: "
        "`minReplicas` > 1), 0 with one, and 1 when `maxSurge` is 0."
    )
    surge = (
        "Extra pods during a rollout (each needs its GPUs free); default 0 with several replicas, 1 with one, and "
        "1 when `maxUnavailable` is 0. The defaults never take a role to zero: several replicas are replaced one "
        "at a time, a single one (or an autoscaled role whose `minReplicas` is 0 or 1) by a surge pod that is "
        "ready before the old one stops (until there is room for it, the old pod keeps serving and the rollout "
        "waits)."
    )
    return Field(
        "rollout",
        "object",
        "How the role's pods are replaced when its pod template changes (a spec edit, a new operator "
        "version): the Deployment's rolling update.",
        fields=(
            Field("maxUnavailable", "integer", unavailable, minimum=0, doc_default="`1`; `0` with one replica"),
            Field("maxSurge", "integer", surge, minimum=0, doc_default="`0`; `1` with one replica"),
        ),
        rules=(not_both_zero("maxUnavailable", "maxSurge", "rollout: maxUnavailable and maxSurge cannot both be 0"),),
    )


def _role_batching() -> Field:
    max_size = (
        "The workers' `--batching-max-size`: the most compatible requests (same size, steps, guidance, ...) one "
        "batched forward runs (1: each request alone); each worker holds that many times its capacity. Above 1 on "
        "any role, the head runs `--batching-mode dynamic` (docs/batching.md). With `gpusPerReplica` above 1, every "
        "rank runs the group."
    )
    delay = (
        "The longest a request waits at the head for a group of this role to fill (the head's "
        "`--batching-role-delay-ms ROLE=MS`): a short stage waits less, a long one can wait more. Unset: "
        "`spec.head.batching.delayMs`. Used only when `maxSize` is above 1."
    )
    return Field(
        "batching",
        "object",
        "Batched forwards: the most compatible requests a worker of the role runs as one "
        "(--batching-max-size); above 1 the head groups requests for it (spec.head.batching).",
        fields=(
            Field("maxSize", "integer", max_size, default=1, minimum=1, maximum=MAX_BATCH_SIZE),
            Field(
                "delayMs",
                "integer",
                delay,
                minimum=0,
                maximum=MAX_BATCH_DELAY_MS,
                doc_default="`spec.head.batching.delayMs`",
            ),
        ),
    )


def _role_rules(role: Role) -> tuple[Rule, ...]:
    forbidden = [name for name in PARALLEL_DEGREES if name not in ROLE_DEGREES[role]]
    cpu = "parallelism: gpusPerReplica 0 runs the role on CPU, one device per pod; set no degree above 1"
    rules = [
        _parallelism_rule(),
        all_one_unless_positive("gpusPerReplica", "parallelism", PARALLEL_DEGREES, cpu, reason="FieldValueInvalid"),
    ]
    if forbidden:
        only = f"parallelism: {' and '.join(forbidden)} apply to the denoiser only"
        rules.append(absent_within("parallelism", forbidden, only))
    return (*rules, *_layout_rules(role))


def _layout_rules(role: Role) -> tuple[Rule, ...]:
    """What every worker of the role refuses whatever the model's family, so it cannot wait for the package
    (the worker's own check: triptych_worker/parallel/families.py `check_degrees`, before it reads the family)."""
    if role is Role.DECODER:
        return (
            each_at_most(
                "parallelism",
                {"tp": 1, "cfg": 1},
                "parallelism: the decoder splits its work by sp only (--decoder-sp); leave tp and cfg unset",
            ),
        )
    if role is Role.DENOISER:
        return (
            each_at_most(
                "parallelism", {"cfg": 2}, "parallelism: a step has at most 2 guidance branches; use cfg 1 or 2"
            ),
        )
    return (
        not_above_limit(
            "gpusPerReplica",
            1,
            "gpusPerReplica: an encoder runs on one device (only the denoiser and the decoder split their work over "
            "several GPUs); use 1 (or 0 for CPU) and more replicas",
        ),
    )


_DTYPE = (
    "The workers' `--dtype`: what the role's model loads and computes in. `auto`: bfloat16 on GPUs, float32 on "
    "CPU (`gpusPerReplica: 0`). Roles may differ; a receiver casts its inputs to its own (e.g. a float32 decoder "
    "under a bfloat16 pipeline, Wan's recipe; docs/serving.md)."
)


def role_field(role: Role) -> Field:
    """spec.<role>: one worker pool."""
    replicas = "Worker pods. Ignored while `autoscaling.enabled`. 0 parks the role (the pipeline cannot serve)."
    gpus = (
        "`nvidia.com/gpu` limit of each pod and its `--num-gpus`, with `--device cuda`. `0`: a CPU role "
        "(`--device cpu`, no GPU limit or toleration)."
    )
    drain = (
        f"The pods' `terminationGracePeriodSeconds`; the worker gets `--disagg-drain-timeout` {DRAIN_MARGIN_S} s "
        "less to finish and push what it holds after SIGTERM, then exits 0. A draining denoiser hands each running "
        "request to another denoiser with room at its next step boundary (docs/design.md), so it drains in about a "
        "step and a transfer while its peers have room; this bounds the wait for room. What a worker still holds "
        "at the end is run again on another instance."
    )
    drain_defaults = ", ".join(
        f"`{seconds}` {'/'.join(r.value for r in PIPELINE_ROLES if DEFAULT_DRAIN_SECONDS[r] == seconds)}"
        for seconds in sorted(set(DEFAULT_DRAIN_SECONDS.values()))
    )
    degrees = tuple(_degree(name) for name in PARALLEL_DEGREES)
    image = "Image for this role only (e.g. a canary); default `spec.images.worker`."
    # No schema default: a defaulted pool would clash with spec.fullPipeline; the parser gives a role-pool
    # pipeline the denoiser and decoder it does not declare (rules.py).
    return Field(
        crd_field(role),
        "object",
        f"The {role.value} worker pool.",
        fields=(
            Field("replicas", "integer", replicas, default=1, minimum=0),
            Field("gpusPerReplica", "integer", gpus, default=1, minimum=0),
            Field("parallelism", "object", f"Parallel degrees of the {role.value}.", fields=degrees),
            Field("image", "string", image, doc_default="`spec.images.worker`"),
            resources_field("role"),
            pod_fields("role")[0],
            Field("affinity", "free", "Pod affinity (a core/v1 Affinity), passed through.", doc_type="Affinity"),
            *pod_fields("role")[1:],
            _autoscaling(),
            _rollout(),
            _role_batching(),
            Field("dtype", "string", _DTYPE, enum=DTYPES, default="auto"),
            Field(
                "drainSeconds",
                "integer",
                drain,
                default=DEFAULT_DRAIN_SECONDS[role],
                minimum=MIN_DRAIN_SECONDS,
                maximum=MAX_DRAIN_SECONDS,
                doc_default=drain_defaults,
            ),
        ),
        rules=_role_rules(role),
    )


# A node folder a pod may mount: absolute, below / (never / itself), with no empty, `.` or `..` segment, so
# what it names is what it says (and an allow-list compares it by its prefix: spec/rules.py).
MAX_HOST_PATH_LENGTH = 4096  # Linux's PATH_MAX
HOST_PATH_RULE = matches_and_avoids(
    "path",
    "^(/[^/]+)+/?$",
    "/[.][.]?(/|$)",
    "path must be an absolute folder other than /, with no '.', '..' or empty segment (e.g. /var/lib/triptych/models)",
)


def _model_volume() -> Field:
    claim = (
        f"A PVC in the pipeline's namespace, mounted read-only at `{MODEL_MOUNT}` in every pod. "
        "Use a ReadOnlyMany/ReadWriteMany volume when pods land on several nodes."
    )
    host = (
        f"A node directory (type `Directory`), mounted read-only at `{MODEL_MOUNT}`: an absolute path other than `/`, "
        "with no `.`, `..` or empty (`//`) segment. Where the operator is given an allow-list (chart value "
        "`allowedHostPaths`), it must lie under one of its folders. Exactly one of `persistentVolumeClaim` and "
        "`hostPath`; a hostPath volume is outside Pod Security's `baseline` and `restricted` levels (docs/security.md)."
    )
    return Field(
        "volume",
        "object",
        f"The volume holding the model directory (mounted read-only at {MODEL_MOUNT}).",
        fields=(
            Field(
                "persistentVolumeClaim",
                "object",
                "A PVC in the pipeline's namespace.",
                fields=(Field("claimName", "string", claim, min_length=1, required=True),),
            ),
            Field(
                "hostPath",
                "object",
                "A directory on every node.",
                fields=(Field("path", "string", host, min_length=1, max_length=MAX_HOST_PATH_LENGTH, required=True),),
                rules=(HOST_PATH_RULE,),
            ),
        ),
        rules=(
            exactly_one("persistentVolumeClaim", "hostPath", "set exactly one of persistentVolumeClaim or hostPath"),
        ),
    )


def _model() -> Field:
    path = (
        f"Model directory relative to the volume root (`.` for the root). Becomes `--model-path {MODEL_MOUNT}/<path>`. "
        "No `..`."
    )
    hub_id = (
        "Hub repository id (e.g. `black-forest-labs/FLUX.1-dev`), for clusters that reach a hub. Becomes "
        "`--model-path <hubId>`; downloads go to an `emptyDir` at `/cache` (`HF_HOME=/cache/huggingface`). "
        "`org/name` of letters, digits, `_`, `.` and `-`, as `triptych serve` takes it (`triptych.model_source`)."
    )
    loras = (
        "LoRA adapters requests may name (`loras`, docs/serving.md), as `NAME=SOURCE`: SOURCE an absolute path "
        f"of a folder or `.safetensors` file in the pod (the model volume is at `{MODEL_MOUNT}`) or a hub id, which "
        "the denoisers and encoders download on first use into an `emptyDir` at `/cache`, with `tokenSecretRef`'s "
        "token. Written to a ConfigMap `<name>-loras` that the head, the encoders and the denoisers mount "
        "and read as `--lora-catalog`: an added adapter reaches them without a restart (within the kubelet's "
        "sync period). A path without adapter weights in the pod keeps a denoiser or encoder pod from starting "
        "(its termination message says which entry and why); added while they run, it fails only the requests "
        "naming it."
    )
    token_secret = (
        f"Secret with the hub token, mounted as the file `{HUB_TOKEN_FILE}` (mode 0440) that `HF_TOKEN_PATH` "
        "names, never an environment value (which every child process would inherit)."
    )
    token = (
        Field("name", "string", token_secret, min_length=1, required=True),
        Field("key", "string", "Key in that Secret.", default=DEFAULT_TOKEN_KEY),
    )
    return Field(
        "model",
        "object",
        "The diffusers model every process loads: `path` on a `volume`, or a `hubId`.",
        required=True,
        fields=(
            Field("path", "string", path),
            _model_volume(),
            Field("hubId", "string", hub_id, min_length=1, pattern=HUB_ID.pattern),
            Field("tokenSecretRef", "object", "Secret holding the hub token (a file, not an env value).", fields=token),
            Field("loras", "array", loras, items=Field("", "string", min_length=3, doc_type="string")),
        ),
        rules=(
            exactly_one("path", "hubId", "set exactly one of path or hubId"),
            needs("path", "volume", "path needs a volume"),
        ),
    )


MODEL = _model()


def _transfer() -> Field:
    mode = (
        "Mooncake transport between workers: `tcp` anywhere; `rdma` GPU-direct over InfiniBand/RoCE, which adds the "
        "RDMA device-plugin resource and `--disagg-ib-device`."
    )
    resource = "Extended (device-plugin) resource requested per worker pod in `rdma` mode."
    ib_device = (
        "RDMA NIC (`--disagg-ib-device`, e.g. `mlx5_0`, `mlx5_roce0`); required in `rdma` mode (without it "
        "Mooncake would fall back to TCP)."
    )
    network = "Value of `k8s.v1.cni.cncf.io/networks` on worker pods (Multus secondary network for RoCE)."
    pool = (
        "Transfer pool per worker (`--disagg-transfer-pool-size`): bytes, or `256Mi`, `256MiB`, `1GiB`; at least 1 MiB."
    )
    pool_default = f"`{DEFAULT_POOL_SIZE}` ({DEFAULT_POOL_SIZE >> 20} MiB)"
    return Field(
        "transfer",
        "object",
        "How tensors move between workers (Mooncake).",
        default={},
        fields=(
            Field("mode", "string", mode, enum=TRANSFER_MODES, default="tcp"),
            Field("rdmaResourceName", "string", resource, default=DEFAULT_RDMA_RESOURCE),
            Field(
                "rdmaResourceCount", "integer", "How many of `rdmaResourceName` per worker pod.", default=1, minimum=1
            ),
            Field("ibDevice", "string", ib_device, min_length=1),
            Field("networkAnnotation", "string", network),
            Field("poolSize", "size", pool, default=DEFAULT_POOL_SIZE, doc_default=pool_default),
        ),
        rules=(required_when_equal("ibDevice", "mode", "rdma", "ibDevice is required with mode rdma"),),
    )


TRANSFER = _transfer()


def _tracing() -> Field:
    endpoint = (
        "OTLP/HTTP collector, `http(s)://HOST:PORT` (e.g. an OpenTelemetry Collector's "
        "`http://otel-collector.observability:4318`), given to the head and every worker as `--otlp-endpoint`: "
        "one trace per request, a span per hop (docs/serving.md). Unset: tracing off, at no cost."
    )
    return Field(
        "tracing",
        "object",
        "OpenTelemetry traces of requests.",
        default={},
        fields=(Field("otlpEndpoint", "string", endpoint, min_length=1),),
    )


TRACING = _tracing()


def _logging() -> Field:
    log_format = (
        "How the head and every worker write their log lines, given to each as `--log-format`: `text`, or "
        "`json` (one object per line: time, level, process, logger, message, and structured fields such as "
        "the access log's `http`) for a log pipeline to read fields from (docs/serving.md). Mooncake's engine "
        "writes its own lines in its own format either way."
    )
    return Field(
        "logging",
        "object",
        "The processes' log lines.",
        default={},
        fields=(Field("format", "string", log_format, enum=LOG_FORMATS, default=LOG_FORMATS[0]),),
    )


LOGGING = _logging()


IMAGES = Field(
    "images",
    "object",
    "Image overrides (default: the operator's configured images).",
    fields=(
        Field(
            "worker",
            "string",
            "CUDA worker image for all roles (a role's `image` wins).",
            doc_default=_OPERATOR_IMAGE % ("WORKER", "worker"),
        ),
        Field("head", "string", "CPU head image.", doc_default=_OPERATOR_IMAGE % ("HEAD", "head")),
    ),
)


def full_pipeline_field() -> Field:
    """spec.fullPipeline: one pool whose workers each run the whole pipeline (--disagg-full-pipeline).

    A denoiser pool's fields (its pods are denoiser-role workers, its objects <name>-denoiser): with
    several GPUs a worker denoises on all of them (the denoiser's parallel degrees) and encodes and
    decodes on the first."""
    pool = role_field(FULL_PIPELINE_ROLE)
    gpus = dataclasses.replace(
        pool.field("gpusPerReplica"),
        description="`nvidia.com/gpu` limit of each pod and its `--num-gpus`, with `--device cuda`: the denoising "
        "runs on every GPU (as `parallelism` splits it), the text encoders and the VAE on the first. `0`: CPU "
        "(`--device cpu`).",
    )
    return dataclasses.replace(
        pool,
        name="fullPipeline",
        description="A full-pipeline pool instead of role pools: each worker pod loads the whole pipeline "
        "(encode, denoise, decode) and returns pixels to the head; no tensor moves between pods (no Mooncake). "
        "Exclusive with encoder, promptEncoder, imageEncoder, denoiser and decoder.",
        fields=tuple(gpus if f.name == "gpusPerReplica" else f for f in pool.fields),
    )


FULL_PIPELINE = full_pipeline_field()
ROLE_POOL_FIELDS = tuple(crd_field(role) for role in PIPELINE_ROLES)

SPEC = Field(
    "spec",
    "object",
    "Desired state of a disaggregated diffusion pipeline.",
    required=True,
    fields=(
        MODEL,
        *(role_field(role) for role in PIPELINE_ROLES),
        FULL_PIPELINE,
        TRANSFER,
        TRACING,
        LOGGING,
        HEAD,
        IMAGES,
    ),
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
