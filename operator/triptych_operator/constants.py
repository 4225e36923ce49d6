"""Names and numbers every object the operator writes agrees on, in one place.

Ports follow the design's convention (triptych.ports): the head's frontend is its scheduler
port and its result sockets sit at +1..+5 (encoder, denoiser, decoder, prompt_encoder, image_encoder:
triptych.ports.result_port); each worker pod binds its work socket on WORKER_PORT.
"""

from __future__ import annotations

from typing import Final

from triptych.ports import DEFAULT_HTTP_PORT, DEFAULT_SCHEDULER_PORT
from triptych.roles import COMBINED_ROLES, WORKER_ROLES, Role

GROUP: Final = "triptych.ai"
VERSION: Final = "v1alpha1"
KIND: Final = "DiffusionPipeline"
PLURAL: Final = "diffusionpipelines"
SINGULAR: Final = "diffusionpipeline"
SHORT_NAMES: Final = ("dp", "dpipe")
# How the Kubernetes API writes a time (metav1.Time, RFC 3339 in UTC to the second): status, marks, metrics.
API_TIME_FORMAT: Final = "%Y-%m-%dT%H:%M:%SZ"

# The roles a DiffusionPipeline runs as worker pools, in the order requests flow through them.
# Every role a DiffusionPipeline may declare a pool for (its CR field is the role descriptor's
# crd_field); a pipeline runs the combined encoder or the split encoders, and DEFAULT_ROLES when
# it names neither.
PIPELINE_ROLES: Final = tuple(role for role in WORKER_ROLES if role.spec.crd_field)
DEFAULT_ROLES: Final = COMBINED_ROLES


def crd_field(role: Role) -> str:
    """The role's pool in spec and status: spec.promptEncoder."""
    field = role.spec.crd_field
    assert field is not None, role
    return field


HEAD_COMPONENT: Final = "head"
# The headless Service listing every head pod (<name>-heads): the workers' dns:// --disagg-server-addr.
# A new object beside <name>-head (a ClusterIP Service, which the metrics API and the ServiceMonitor
# read): a Service's clusterIP cannot be changed to None in place.
HEADS_SERVICE: Final = "heads"

# Ports. Every worker pod binds the same work port: pods have their own IPs, so nothing collides,
# and the head's dns:// discovery needs one port per role.
WORKER_PORT: Final = 19000
# torch.distributed rendezvous for multi-GPU roles; kept far from the work port (+1 is its control port).
WORKER_MASTER_PORT: Final = 29500
HEAD_SCHEDULER_PORT: Final = DEFAULT_SCHEDULER_PORT
HEAD_HTTP_PORT: Final = DEFAULT_HTTP_PORT

# Where things live inside the containers.
MODEL_MOUNT: Final = "/models"
HF_CACHE_MOUNT: Final = "/cache"
SHM_MOUNT: Final = "/dev/shm"
# The containers' root filesystem is read-only: /tmp (HOME in the images) is the one writable folder besides
# the mounted volumes (torch's and triton's caches, a bucket's staging files, anything a library writes there).
TMP_MOUNT: Final = "/tmp"
SHM_PER_RANK_GIB: Final = 2  # /dev/shm per rank of a multi-GPU role (NCCL's intra-node buffers, with room)
# A worker's own IP (downward API), which its --disagg-p2p-hostname expands: a role's env may not set it.
POD_IP_ENV: Final = "POD_IP"
# A multi-GPU role's ranks share one pod: these keep NCCL's bootstrap and gloo on loopback.
RANK_INTERFACE_ENV: Final = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
OUTPUT_MOUNT: Final = "/var/lib/triptych/outputs"
# head.apiKeysSecret: the Secret's key is mounted as this file (a whole-volume mount, never subPath,
# so a Secret update reaches the file and the head re-reads it).
API_KEYS_MOUNT: Final = "/etc/triptych/api-keys"
API_KEYS_FILE: Final = f"{API_KEYS_MOUNT}/keys"
# head.webhook.secret: the Secret's key is mounted as this file, passed as --webhook-secret-file.
WEBHOOK_MOUNT: Final = "/etc/triptych/webhook"
WEBHOOK_SECRET_FILE: Final = f"{WEBHOOK_MOUNT}/secret"
# head.tls: the kubernetes.io/tls Secret's tls.crt and tls.key, mounted whole (a renewal reaches the
# files and the head reloads them) and passed as --ssl-certfile / --ssl-keyfile.
HEAD_TLS_MOUNT: Final = "/etc/triptych/tls"
HEAD_TLS_CERT_FILE: Final = f"{HEAD_TLS_MOUNT}/tls.crt"
HEAD_TLS_KEY_FILE: Final = f"{HEAD_TLS_MOUNT}/tls.key"
# model.tokenSecretRef: the hub token as this file (HF_TOKEN_PATH names it), never an env value that
# every child process inherits; mounted whole, so a Secret update reaches the file (read at each download).
HUB_TOKEN_MOUNT: Final = "/etc/triptych/hub"
HUB_TOKEN_FILE: Final = f"{HUB_TOKEN_MOUNT}/token"
# head.results.s3.credentialsSecret: the bucket's two keys as these files (AWS_ACCESS_KEY_ID_FILE and
# AWS_SECRET_ACCESS_KEY_FILE name them), read by the head at start-up.
S3_CREDENTIALS_MOUNT: Final = "/etc/triptych/s3"
S3_ACCESS_KEY_FILE: Final = f"{S3_CREDENTIALS_MOUNT}/access-key-id"
S3_SECRET_KEY_FILE: Final = f"{S3_CREDENTIALS_MOUNT}/secret-access-key"
# The pipeline's control-plane key set (Secret "<name>-control-keys"), read-only: --disagg-keys-dir.
KEYS_MOUNT: Final = "/etc/triptych/keys"
# spec.model.loras as the --lora-catalog file of the head, the denoisers and the prompt encoders: a
# ConfigMap mounted whole (no subPath), so an edit reaches the file and the processes re-read it without a restart.
LORA_COMPONENT: Final = "loras"
LORA_CATALOG_MOUNT: Final = "/etc/triptych/loras"
LORA_CATALOG_FILE: Final = f"{LORA_CATALOG_MOUNT}/catalog.txt"
KEYS_COMPONENT: Final = "control-keys"
# Pod-template annotation with the keys' public fingerprint: new keys (a deleted Secret) roll every pod.
KEYS_FINGERPRINT_ANNOTATION: Final = "triptych.ai/control-keys"
# On every child: the digest of the manifest last applied (drift.stamp), so a removed field is seen.
MANIFEST_ANNOTATION: Final = "triptych.ai/manifest"
RUN_AS_USER: Final = 10001  # the numeric uid the images declare with USER

# Default images; the chart overrides them through the operator's environment.
DEFAULT_WORKER_IMAGE: Final = "ghcr.io/triptych-ai/triptych-worker:0.1.0"
DEFAULT_HEAD_IMAGE: Final = "ghcr.io/triptych-ai/triptych-head:0.1.0"
WORKER_IMAGE_ENV: Final = "TRIPTYCH_WORKER_IMAGE"
HEAD_IMAGE_ENV: Final = "TRIPTYCH_HEAD_IMAGE"
# The folders a pipeline's hostPath model volume must lie under, comma-separated (chart value allowedHostPaths);
# unset or empty: any folder the CRD takes.
ALLOWED_HOST_PATHS_ENV: Final = "TRIPTYCH_ALLOWED_HOST_PATHS"

# Resources and scheduling.
GPU_RESOURCE: Final = "nvidia.com/gpu"
DEFAULT_RDMA_RESOURCE: Final = "rdma/ib"
MULTUS_NETWORKS_ANNOTATION: Final = "k8s.v1.cni.cncf.io/networks"

# Autoscaling. The HPA of an autoscaled role reads this Object metric on the role's Deployment:
# the device-seconds of work queued and running for the role, as the head estimates it. The
# metrics API server (triptych_operator.metrics_api) serves it from the heads' /metrics.
PENDING_WORK_METRIC: Final = "triptych_pending_work_seconds"
CUSTOM_METRICS_GROUP: Final = "custom.metrics.k8s.io"
# Where the metrics API server scrapes a pipeline's head, when not at its Service's endpoints
# (comma-separated URLs, summed): e.g. a head running outside the cluster.
HEAD_METRICS_URL_ANNOTATION: Final = f"{GROUP}/head-metrics-url"

# Labels on every child; the selector labels never change so Deployments can be re-applied.
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
APP_NAME: Final = "triptych"
MANAGER: Final = "triptych-operator"

# CR names become Service names "<name>-denoiser", which must stay DNS-1035 labels (<= 63 chars).
MAX_NAME_LENGTH: Final = 63 - len("-denoiser")  # split-encoder Services are checked when they are declared
