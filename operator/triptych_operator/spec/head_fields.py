"""The head's fields of a DiffusionPipeline spec (`spec.head`): replicas, Services and Ingress, its
queues (batching delay, priority), dispatch, timeouts and drain, results, API keys, pod settings.
Part of the one declaration (declaration.py); change this module to add, remove or re-describe one."""

from __future__ import annotations

from triptych.config import (
    DEFAULT_PRIORITY_AGING_S,
    DEFAULT_RESULTS_MAX_AGE_S,
    DEFAULT_RESULTS_MAX_BYTES,
    DEFAULT_TIMEOUT_S,
    DISPATCH_POLICIES,
    HEAD_SHUTDOWN_OVERHEAD_S,
    MAX_PRESIGN_S,
)
from triptych.env_secrets import S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV, file_variable
from triptych_operator.constants import (
    HEAD_HTTP_PORT,
    HEAD_SCHEDULER_PORT,
    S3_CREDENTIALS_MOUNT,
)
from triptych_operator.fields import (
    Field,
    excludes,
    matches_and_avoids,
    required_when,
)
from triptych_operator.spec.pod_fields import DRAIN_MARGIN_S, MAX_DRAIN_SECONDS, pod_fields, resources_field

SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
DEFAULT_API_KEYS_KEY = "keys"
DEFAULT_WEBHOOK_SECRET_KEY = "secret"
# head.replicas when unset: two heads when every head sees the same results (a rollout then replaces
# one while the other serves), one when each head would keep its own.
SHARED_RESULTS_HEADS = 2
UNSHARED_RESULTS_HEADS = 1
DEFAULT_BATCH_DELAY_MS = 30  # the reference design's GLM-Image head (docs/design.md): --batching-delay-ms 30
MAX_BATCH_DELAY_MS = 10_000
# The head's drainSeconds means the same (its terminationGracePeriodSeconds); its own deadline leaves
# room for answering the last clients and saving video jobs (HEAD_SHUTDOWN_OVERHEAD_S) as well.
HEAD_DRAIN_MARGIN_S = int(HEAD_SHUTDOWN_OVERHEAD_S) + DRAIN_MARGIN_S
DEFAULT_HEAD_DRAIN_SECONDS = 600
MIN_HEAD_DRAIN_SECONDS = 2 * HEAD_DRAIN_MARGIN_S
# A head being deleted keeps taking requests this long before its SIGTERM (a preStop sleep): Services,
# kube-proxy and Ingress controllers stop routing to it meanwhile, so no request meets a draining head.
# Taken out of its own drain deadline, so the deadline still ends HEAD_DRAIN_MARGIN_S before the kill.
HEAD_UNROUTE_S = 5


_INGRESS_ANNOTATIONS = (
    "The Ingress's annotations: your controller's settings (cert-manager's issuer, a rewrite, an allow-list, "
    "another controller's timeouts). They go over the operator's own for ingress-nginx, which let a request "
    "through as the heads would take it: `proxy-body-size` of `--max-request-bytes`, `proxy-read-timeout` and "
    "`proxy-send-timeout` of `timeoutSeconds` plus a minute, `proxy-buffering: off` (progress events arrive as "
    "they are sent), and `backend-protocol: HTTPS` with `tls`."
)


# What the Ingress publishes unless told otherwise: the API the OpenAI SDK calls (/v1/...) and the playground's
# page (/ alone) and files (/static/...), as head/triptych_head/api serves them. Not /health, /ready and
# /metrics (the workers' addresses and load: for the kubelet and scrapers, which reach the pods directly),
# nor FastAPI's /docs and /openapi.json.
DEFAULT_INGRESS_PATHS = (
    {"path": "/v1", "pathType": "Prefix"},
    {"path": "/static", "pathType": "Prefix"},
    {"path": "/", "pathType": "Exact"},
)
INGRESS_PATH_TYPES = ("Prefix", "Exact")
# Bounds that keep the API server's cost estimate of the paths' CEL rule within its budget.
MAX_INGRESS_PATHS = 32
MAX_INGRESS_PATH_LENGTH = 1024
# What the API server refuses in an Ingress path of these types (Kubernetes' own validation of one).
INGRESS_PATH_RULE = matches_and_avoids(
    "path",
    "^/",
    "//|/[.][.]?(/|$)|%2[fF]",
    "path must start with '/' and hold no '//', '/./', '/../' or '%2F', as an Ingress path does (e.g. /v1)",
)
_INGRESS_PATHS = (
    "The paths the Ingress sends to the heads, each once: a `path` and its `pathType`, `Prefix` (whole path "
    "elements: `/v1` takes `/v1/images/generations`, not `/v1x`) or `Exact`. The default publishes the API "
    "(`/v1`) and the playground (`/` and `/static`), and not `/health`, `/ready` and `/metrics`, which list the "
    "workers' addresses and load (the kubelet and the metrics API reach the pods directly), nor FastAPI's `/docs` "
    "and `/openapi.json`. `[{path: /}]` publishes everything; `[{path: /v1}]` the API alone (docs/security.md)."
)


def _ingress_path() -> Field:
    return Field(
        "",
        "object",
        "A path of the Ingress.",
        fields=(
            Field("path", "string", "Starts with `/`.", required=True, max_length=MAX_INGRESS_PATH_LENGTH),
            Field("pathType", "string", "How `path` matches.", enum=INGRESS_PATH_TYPES, default="Prefix"),
        ),
        rules=(INGRESS_PATH_RULE,),
        doc_type="`{path, pathType}`",
    )


def _ingress() -> Field:
    return Field(
        "ingress",
        "object",
        "Optional Ingress to the head's HTTP API.",
        fields=(
            Field("enabled", "boolean", "Create an Ingress to `<name>-api`.", default=False),
            Field("host", "string", "Host name; required when enabled.", min_length=1),
            Field("className", "string", "The Ingress's `ingressClassName`."),
            Field("tls", "object", "TLS.", fields=(Field("secretName", "string", "TLS Secret for `host`."),)),
            Field("annotations", "string-map", _INGRESS_ANNOTATIONS),
            Field(
                "paths",
                "array",
                _INGRESS_PATHS,
                items=_ingress_path(),
                default=[dict(p) for p in DEFAULT_INGRESS_PATHS],
                min_items=1,
                max_items=MAX_INGRESS_PATHS,
                list_map_keys=("path",),
                doc_default="`/v1`, `/static` (Prefix); `/` (Exact)",
            ),
        ),
        rules=(required_when("host", "enabled", "host is required when enabled"),),
    )


def _tls() -> Field:
    secret = (
        "A `kubernetes.io/tls` Secret in the pipeline's namespace (`tls.crt`, `tls.key`; e.g. cert-manager's), "
        "mounted read-only at `/etc/triptych/tls` and passed as `--ssl-certfile` / `--ssl-keyfile`: the heads "
        "serve HTTPS on `port` (the Services' port is then named `https`, with `appProtocol: https`; probes use "
        "HTTPS). A renewed certificate is picked up without a restart. Its names should cover what clients and "
        "the metrics API use: the `<name>-api` Service or Ingress host, and `<name>-head.<namespace>.svc`."
    )
    return Field(
        "tls",
        "object",
        "HTTPS on the heads themselves (--ssl-certfile/--ssl-keyfile); unset: HTTP (TLS may end at the Ingress).",
        fields=(Field("secretName", "string", secret, min_length=1, required=True),),
    )


def _s3() -> Field:
    url = (
        "`--results-store`: `s3://BUCKET/PREFIX` of an S3-compatible bucket every head reads and writes (checked as "
        "the flag is)."
    )
    endpoint = "`--results-s3-endpoint`: the server's `http(s)://HOST[:PORT]` (e.g. MinIO, SeaweedFS); unset: AWS S3."
    secret = (
        "A Secret in the pipeline's namespace whose two keys the operator mounts into the head as files (0440, in "
        f"`{S3_CREDENTIALS_MOUNT}`) that `{file_variable(S3_ACCESS_KEY_ENV)}` and `{file_variable(S3_SECRET_KEY_ENV)}` "
        "name: the values are in neither the Deployment nor the head's environment. Read at start-up: a changed "
        "Secret takes effect as the heads restart. Unset: the operator sets no credentials (give them in `head.env`)."
    )
    presign = (
        "`--results-presign`: image URLs and video content are handed out as presigned URLs valid this long, so "
        "the bytes skip the head (clients must reach the bucket); 0: the head proxies them."
    )
    return Field(
        "s3",
        "object",
        "Results in an S3-compatible bucket shared by every head (--results-store).",
        fields=(
            Field("url", "string", url, min_length=1, required=True),
            Field("endpoint", "string", endpoint),
            Field(
                "credentialsSecret",
                "object",
                "The bucket's credentials.",
                fields=(
                    Field("name", "string", secret, min_length=1, required=True),
                    Field(
                        "accessKeyIdKey",
                        "string",
                        f"The Secret's key for `{S3_ACCESS_KEY_ENV}`.",
                        default=S3_ACCESS_KEY_ENV,
                    ),
                    Field(
                        "secretAccessKeyKey",
                        "string",
                        f"The Secret's key for `{S3_SECRET_KEY_ENV}`.",
                        default=S3_SECRET_KEY_ENV,
                    ),
                ),
            ),
            Field("presignSeconds", "integer", presign, default=0, minimum=0, maximum=MAX_PRESIGN_S),
        ),
    )


def _results() -> Field:
    claim = (
        "An existing PVC mounted at every head's `--output-path` (`/var/lib/triptych/outputs`): URL images and "
        "video jobs survive a head restart, and every head serves every result. More than one head needs a "
        "ReadWriteMany claim (a ReadWriteOnce one: set `head.replicas: 1`, and the head is replaced with "
        "`Recreate`). Without it or `s3`: an `emptyDir` per head (results survive container restarts, not a new "
        "pod, and only one head may run)."
    )
    max_age = "`--results-max-age`: results older than this are removed."
    max_bytes = (
        "`--results-max-bytes`: beyond this total the oldest results are removed; bytes or a size such as "
        f"`5GiB` (default {DEFAULT_RESULTS_MAX_BYTES}). Keep it below the claim's size."
    )
    max_bytes_default = f"`{DEFAULT_RESULTS_MAX_BYTES}` ({DEFAULT_RESULTS_MAX_BYTES >> 30} GiB)"
    return Field(
        "results",
        "object",
        "Where the heads keep finished images (URL responses) and video jobs, and for how long: a claim "
        "(--output-path) or a bucket (--results-store) every head shares, else each head's own emptyDir.",
        default={},
        fields=(
            Field(
                "persistentVolumeClaim",
                "object",
                "An existing PVC mounted at the output path, so results outlive the pod; without it an emptyDir.",
                fields=(Field("claimName", "string", claim, min_length=1, required=True),),
            ),
            _s3(),
            Field("maxAgeSeconds", "integer", max_age, default=int(DEFAULT_RESULTS_MAX_AGE_S), minimum=1),
            Field("maxBytes", "size", max_bytes, default=DEFAULT_RESULTS_MAX_BYTES, doc_default=max_bytes_default),
        ),
        rules=(
            excludes(
                "s3",
                ("persistentVolumeClaim",),
                "results: set s3 (a bucket) or persistentVolumeClaim (a shared folder), not both",
            ),
        ),
    )


def _api_keys_secret() -> Field:
    name = (
        "A Secret in the pipeline's namespace holding the HTTP API's keys, one per line (`#` comments allowed; "
        "after a key, `max_priority=LEVEL`, `max_in_flight=N`, `max_per_minute=N` and the quotas `max_per_hour=N`, "
        "`max_per_day=N`, `max_per_month=N`, and `tenant=NAME`, whose video jobs the key sees and whose limits "
        "it shares: docs/security.md). "
        "Mounted read-only at `/etc/triptych/api-keys` (a whole-volume mount, so Secret updates reach it) and "
        "passed as `--api-keys-file`; clients then send `Authorization: Bearer KEY`, while /health, /ready and "
        '/metrics stay open. Updating the Secret rotates keys without a restart (docs/security.md, "HTTP API and '
        'overload"). Unset: the API is open.'
    )
    return Field(
        "apiKeysSecret",
        "object",
        "API keys of the HTTP API (--api-keys-file); unset: the API is open.",
        fields=_secret_key_ref(name, "The Secret's key holding the list.", DEFAULT_API_KEYS_KEY),
    )


def _secret_key_ref(name: str, key: str, default_key: str) -> tuple[Field, ...]:
    """The fields of a Secret and the key in it (`{name, key}`): `name` and `key` describe them."""
    return (
        Field("name", "string", name, min_length=1, required=True),
        Field("key", "string", key, default=default_key),
    )


def _webhook() -> Field:
    url = (
        "`--webhook-url`: the http(s) URL every head POSTs each video job's end to (`video.completed`, "
        "`video.failed`, `video.cancelled`; retried on no answer, 408, 429 and 5xx). The heads reach it from "
        "their pods: outside the cluster, through any egress the cluster allows."
    )
    secret = (
        "A Secret in the pipeline's namespace whose key holds the signing secret, `whsec_<base64 of 24 or more "
        "random bytes>` (Standard Webhooks), mounted read-only at `/etc/triptych/webhook` and passed as "
        "`--webhook-secret-file`; a receiver checks each delivery's `webhook-signature` with it."
    )
    return Field(
        "webhook",
        "object",
        "Signed webhooks for the ends of video jobs (--webhook-url, --webhook-secret-file); unset: none.",
        fields=(
            Field("url", "string", url, min_length=1, required=True),
            Field(
                "secret",
                "object",
                "The signing secret.",
                required=True,
                fields=_secret_key_ref(secret, "The Secret's key holding it.", DEFAULT_WEBHOOK_SECRET_KEY),
            ),
        ),
    )


def _head_batching() -> Field:
    delay = (
        "`--batching-delay-ms`: the longest a request waits for its group to fill, for every role without a "
        "`batching.delayMs` of its own (each role's group size is its own `batching.maxSize`, which its workers "
        "heartbeat to the head)."
    )
    return Field(
        "batching",
        "object",
        "How the head groups requests for roles whose batching.maxSize is above 1.",
        fields=(
            Field("delayMs", "integer", delay, default=DEFAULT_BATCH_DELAY_MS, minimum=0, maximum=MAX_BATCH_DELAY_MS),
        ),
    )


def _head_priority() -> Field:
    aging = (
        "`--disagg-priority-aging`: each wait this long raises a waiting request's priority one level, which "
        "bounds how long a low-priority request can be passed over (docs/design.md)."
    )
    preemption = (
        "`--disagg-preemption`: a request waiting for a denoiser with none free has a lower-priority running "
        "denoise suspended at its next step boundary, and resumed after (docs/design.md); not while dynamic "
        "batching is on (a role's `batching.maxSize` above 1)."
    )
    return Field(
        "priority",
        "object",
        "How the head orders requests by their `priority` (per-key ceilings: `apiKeysSecret`, docs/security.md).",
        fields=(
            Field("agingSeconds", "integer", aging, default=int(DEFAULT_PRIORITY_AGING_S), minimum=1),
            Field("preemption", "boolean", preemption, default=True),
        ),
    )


def _head() -> Field:
    replicas = (
        "Head pods. Every worker serves every head (a headless Service `<name>-heads`), so clients may reach any "
        "of them; more than one needs results every head shares (`results.s3`, or `results.persistentVolumeClaim` "
        "on a ReadWriteMany claim). A rollout replaces one head at a time while the others serve; 0 parks the "
        "pipeline (see docs/operator.md#head-rollouts-drain-and-results)."
    )
    replicas_default = (
        f"`{SHARED_RESULTS_HEADS}` with `results.s3` or `results.persistentVolumeClaim`, else "
        f"`{UNSHARED_RESULTS_HEADS}`"
    )
    policy = "`--disagg-dispatch-policy` (the enum is `triptych.config.DISPATCH_POLICIES`)."
    drain = (
        "The head pod's `terminationGracePeriodSeconds`, as for the roles. A head being deleted (rollout, "
        f"eviction) takes requests for {HEAD_UNROUTE_S} more seconds while it leaves the Services (a `preStop` "
        f"sleep), then gets SIGTERM; accepted requests may finish until {HEAD_DRAIN_MARGIN_S} s before the end "
        f"(`--disagg-drain-timeout` = `drainSeconds` - {HEAD_DRAIN_MARGIN_S + HEAD_UNROUTE_S}: the head needs at "
        f"most {int(HEAD_SHUTDOWN_OVERHEAD_S)} s to answer its last clients and save its jobs), then fail with a "
        "503 that says so; the head exits as soon as "
        "nothing is left. Keep it above `timeoutSeconds` so any request that can still succeed does (the Wan "
        "example uses 900 for both)."
    )
    port = f"HTTP port; must not collide with the scheduler ports {HEAD_SCHEDULER_PORT}-{HEAD_SCHEDULER_PORT + 5}."
    return Field(
        "head",
        "object",
        "The GPU-less head (DiffusionServer + HTTP API).",
        default={},
        fields=(
            Field("replicas", "integer", replicas, minimum=0, doc_default=replicas_default),
            Field(
                "serviceType",
                "string",
                "Type of the `<name>-api` Service (HTTP only).",
                enum=SERVICE_TYPES,
                default="ClusterIP",
            ),
            _ingress(),
            _head_batching(),
            _head_priority(),
            Field("dispatchPolicy", "string", policy, enum=DISPATCH_POLICIES, default=DISPATCH_POLICIES[0]),
            Field("timeoutSeconds", "integer", "`--disagg-timeout`.", default=int(DEFAULT_TIMEOUT_S), minimum=1),
            Field(
                "drainSeconds",
                "integer",
                drain,
                default=DEFAULT_HEAD_DRAIN_SECONDS,
                minimum=MIN_HEAD_DRAIN_SECONDS,
                maximum=MAX_DRAIN_SECONDS,
            ),
            _results(),
            _api_keys_secret(),
            _webhook(),
            _tls(),
            Field("port", "integer", port, default=HEAD_HTTP_PORT, minimum=1, maximum=65535),
            resources_field("head"),
            *pod_fields("head"),
        ),
    )


HEAD = _head()
