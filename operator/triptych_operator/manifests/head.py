"""The head's objects: its Deployment, the internal and headless Services workers and the metrics API
reach it by, the public API Service and Ingress, and the disruption budget of several heads."""

from __future__ import annotations

import math

from triptych.config import MIB, PIPELINE_ENV, ServeArgs
from triptych.env_secrets import S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV, file_variable
from triptych.ports import result_port
from triptych.roles import Role
from triptych_operator.constants import (
    API_KEYS_FILE,
    API_KEYS_MOUNT,
    HEAD_COMPONENT,
    HEAD_SCHEDULER_PORT,
    HEAD_TLS_MOUNT,
    HEADS_SERVICE,
    OUTPUT_MOUNT,
    S3_ACCESS_KEY_FILE,
    S3_CREDENTIALS_MOUNT,
    S3_SECRET_KEY_FILE,
    WEBHOOK_MOUNT,
    WEBHOOK_SECRET_FILE,
)
from triptych_operator.manifests.parts import (
    PROGRESS_DEADLINE_S,
    Manifest,
    container_resources,
    container_security,
    control_keys_volume,
    file_name,
    labels,
    lora_catalog_volume,
    merged_env,
    model_volume_mounts,
    object_metadata,
    pod_security,
    secret_files_volume,
    standard_probes,
    template_annotations,
    tmp_volume,
)
from triptych_operator.serve_args import SERVE_COMMAND, object_name
from triptych_operator.spec.head_fields import HEAD_UNROUTE_S
from triptych_operator.spec.model import PipelineSpec, SpecError

API_COMPONENT = "api"  # the head's public HTTP Service; the scheduler ports stay on the internal one
HEAD_HEALTH_PATH = "/health"  # the head API's liveness route (head/triptych_head/api/system.py)
HEAD_READY_PATH = "/ready"  # its readiness route: 503 from the moment it drains (SIGTERM)
HEAD_READY_PERIOD_S = 2
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
# ingress-nginx's way of being told its backend speaks HTTPS (head.tls); other controllers read the
# Service port's appProtocol.
NGINX = "nginx.ingress.kubernetes.io/"
NGINX_BACKEND_PROTOCOL = NGINX + "backend-protocol"
# An answer may take the whole request timeout; the controller waits this much longer, so the head's own
# 504 (naming the timeout) reaches the client rather than the controller's.
INGRESS_TIMEOUT_MARGIN_S = 60


def api_port_name(pipeline: PipelineSpec) -> str:
    """The name of the heads' HTTP API port: `https` when they serve HTTPS (head.tls), else `http`."""
    return "https" if pipeline.head.tls_secret_name else "http"


def _api_service_port(pipeline: PipelineSpec) -> Manifest:
    """The API port as a Service exposes it (appProtocol https for controllers that read it)."""
    name = api_port_name(pipeline)
    port: Manifest = {"name": name, "port": pipeline.head.port, "targetPort": name, "protocol": "TCP"}
    if pipeline.head.tls_secret_name:
        port["appProtocol"] = "https"
    return port


def _result_port_name(role: Role) -> str:
    # Port names are at most 15 characters: "result-denoiser" is exactly that; the split encoders
    # are named by their offset (result-plus4: --scheduler-port + 4).
    name = f"result-{role.dns_name}"
    return name if len(name) <= 15 else f"result-plus{role.spec.result_port_offset}"


def _head_ports(pipeline: PipelineSpec) -> list[Manifest]:
    """HTTP and the result ports workers push to. The frontend (the scheduler port itself) is the
    head's in-process socket on loopback; workers only derive the result ports from its number."""
    ports = [{"name": api_port_name(pipeline), "containerPort": pipeline.head.port}]
    ports += [
        {"name": _result_port_name(role), "containerPort": result_port(HEAD_SCHEDULER_PORT, role)}
        for role in pipeline.roles
    ]
    return [{**p, "protocol": "TCP"} for p in ports]


def _headstandard_probes(pipeline: PipelineSpec) -> dict[str, Manifest]:
    """Liveness (and startup) on /health, which stays 200 while the head drains so it is not killed
    mid-drain; readiness on /ready, which fails at once on SIGTERM so the api Service drops it. Over
    HTTPS with head.tls (the kubelet does not verify the certificate)."""
    scheme = {"scheme": "HTTPS"} if pipeline.head.tls_secret_name else {}
    port = api_port_name(pipeline)
    probes = standard_probes({"httpGet": {"path": HEAD_HEALTH_PATH, "port": port, **scheme}})
    probes["readinessProbe"] = {
        "httpGet": {"path": HEAD_READY_PATH, "port": port, **scheme},
        "periodSeconds": HEAD_READY_PERIOD_S,
        "timeoutSeconds": HEAD_READY_PERIOD_S,
        "failureThreshold": 2,  # out of the api Service within 4 s; one slow answer is not enough
    }
    return probes


def head_termination_grace_seconds(pipeline: PipelineSpec) -> int:
    """drainSeconds, as for the roles: the head's --disagg-drain-timeout ends HEAD_DRAIN_MARGIN_S
    earlier, which covers its own shutdown work (HEAD_SHUTDOWN_OVERHEAD_S) with room to spare."""
    return pipeline.head.drain_seconds


def head_results_volume(pipeline: PipelineSpec) -> Manifest:
    """--output-path: the claim the CR names (results survive the pod; every head mounts it), else an
    emptyDir (they survive container restarts only; with results.s3 the bucket holds them instead)."""
    claim = pipeline.head.results.claim_name
    if claim:
        return {"name": "outputs", "persistentVolumeClaim": {"claimName": claim}}
    return {"name": "outputs", "emptyDir": {}}


def head_results_credentials(pipeline: PipelineSpec) -> tuple[list[Manifest], list[Manifest], list[Manifest]]:
    """(volumes, mounts, env) of the bucket's credentials: the Secret's two keys as files, and
    AWS_ACCESS_KEY_ID_FILE / AWS_SECRET_ACCESS_KEY_FILE naming them, so the values are in neither the
    Deployment nor the head's environment (which every child process inherits)."""
    s3 = pipeline.head.results.s3
    if s3 is None or s3.credentials is None:
        return [], [], []
    creds = s3.credentials
    # A credential head.env sets (a value, or a file of the user's own) is not read from the Secret: the
    # Secret need not hold it, and a volume naming a key the Secret lacks would keep the pod from starting.
    given = {e.get("name") for e in pipeline.head.env}
    named = [
        (name, key, path)
        for name, key, path in (
            (S3_ACCESS_KEY_ENV, creds.access_key_id_key, S3_ACCESS_KEY_FILE),
            (S3_SECRET_KEY_ENV, creds.secret_access_key_key, S3_SECRET_KEY_FILE),
        )
        if not given & {name, file_variable(name)}
    ]
    if not named:
        return [], [], []
    files = [(key, file_name(path)) for _, key, path in named]
    volume, mount = secret_files_volume("s3-credentials", creds.name, files, S3_CREDENTIALS_MOUNT)
    env = [{"name": file_variable(name), "value": path} for name, _, path in named]
    return [volume], [mount], env


def head_apicontrol_keys_volume(pipeline: PipelineSpec) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, mounts) of head.apiKeysSecret: its key as the file --api-keys-file names. A Secret
    update reaches the mounted file within the kubelet's sync period; the head re-reads it then."""
    ref = pipeline.head.api_keys_secret
    if ref is None:
        return [], []
    volume, mount = secret_files_volume("api-keys", ref.name, [(ref.key, file_name(API_KEYS_FILE))], API_KEYS_MOUNT)
    return [volume], [mount]


def head_webhook_volume(pipeline: PipelineSpec) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, mounts) of head.webhook.secret: its key as the file --webhook-secret-file names."""
    webhook = pipeline.head.webhook
    if webhook is None:
        return [], []
    files = [(webhook.secret.key, file_name(WEBHOOK_SECRET_FILE))]
    volume, mount = secret_files_volume("webhook", webhook.secret.name, files, WEBHOOK_MOUNT)
    return [volume], [mount]


def head_tls_volume(pipeline: PipelineSpec) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, mounts) of head.tls: the Secret's tls.crt and tls.key where --ssl-certfile/--ssl-keyfile
    name them, mounted whole (never subPath) so a renewal reaches the files and the head reloads them."""
    name = pipeline.head.tls_secret_name
    if name is None:
        return [], []
    volume, mount = secret_files_volume("tls", name, [(key, key) for key in ("tls.crt", "tls.key")], HEAD_TLS_MOUNT)
    return [volume], [mount]


def _pipeline_env(pipeline: PipelineSpec) -> Manifest:
    """Whose results the head keeps: it marks its store as this pipeline's and refuses one marked as
    another's (head/triptych_head/store_owner.py). head.env may set another (a store kept across a rename)."""
    return {"name": PIPELINE_ENV, "value": f"{pipeline.namespace}/{pipeline.name}"}


def head_deployment(pipeline: PipelineSpec, argv: list[str], keys_fingerprint: str = "") -> Manifest:
    """The GPU-less head: HTTP API plus the scheduler frontend and result sockets."""
    head = pipeline.head
    volumes, mounts, model_env = model_volume_mounts(pipeline)
    keys_volume, keys_mount = control_keys_volume(pipeline, "head")
    api_key_volumes, api_key_mounts = head_apicontrol_keys_volume(pipeline)
    lora_volumes, lora_mounts = lora_catalog_volume(pipeline)
    tls_volumes, tls_mounts = head_tls_volume(pipeline)
    hook_volumes, hook_mounts = head_webhook_volume(pipeline)
    s3_volumes, s3_mounts, s3_env = head_results_credentials(pipeline)
    tmp, tmp_mount = tmp_volume()
    volumes = [*volumes, *lora_volumes, *tls_volumes, *hook_volumes, *s3_volumes, tmp]
    mounts = [*mounts, *lora_mounts, *tls_mounts, *hook_mounts, *s3_mounts, tmp_mount]
    container: Manifest = {
        "name": HEAD_COMPONENT,
        "image": pipeline.head_image,
        "command": list(SERVE_COMMAND),
        "args": argv,
        "env": merged_env([*model_env, *s3_env, _pipeline_env(pipeline)], head.env),
        "ports": _head_ports(pipeline),
        "resources": container_resources(head.resources, {}),
        "securityContext": container_security(),
        "volumeMounts": [*mounts, {"name": "outputs", "mountPath": OUTPUT_MOUNT}, keys_mount, *api_key_mounts],
        **_headstandard_probes(pipeline),
        # Deleted, it keeps serving while every Service and proxy stops routing to it; SIGTERM (the
        # drain: new requests get a 503) comes after, when none should arrive. Part of the grace period.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(HEAD_UNROUTE_S)]}}},
    }
    pod_spec: Manifest = {
        "securityContext": pod_security(),
        "automountServiceAccountToken": False,  # the head never calls the Kubernetes API (it finds workers by DNS)
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": head_termination_grace_seconds(pipeline),
        "containers": [container],
        "volumes": [*volumes, head_results_volume(pipeline), keys_volume, *api_key_volumes],
    }
    if head.node_selector:
        pod_spec["nodeSelector"] = dict(head.node_selector)
    if head.tolerations:
        pod_spec["tolerations"] = list(head.tolerations)
    # Heads on different nodes where there are several (one node lost takes one head), but never
    # Pending for it: a one-node cluster runs them all.
    pod_spec["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": HOSTNAME_TOPOLOGY,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": labels(pipeline, HEAD_COMPONENT)},
        }
    ]
    head_template_meta: Manifest = {"labels": labels(pipeline, HEAD_COMPONENT)}
    if keys_fingerprint:
        head_template_meta["annotations"] = template_annotations(keys_fingerprint)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_metadata(pipeline, HEAD_COMPONENT),
        "spec": {
            "replicas": head.replicas,
            "selector": {"matchLabels": labels(pipeline, HEAD_COMPONENT)},
            "strategy": head_strategy(pipeline),
            "progressDeadlineSeconds": PROGRESS_DEADLINE_S,
            "template": {"metadata": head_template_meta, "spec": pod_spec},
        },
    }


def head_strategy(pipeline: PipelineSpec) -> Manifest:
    """How a head rollout goes (docs/operator.md, "Head rollouts"): a new head is started and ready
    before an old one drains, so some head always takes requests; every worker serves every head
    (`<name>-heads`), so the surge head gets work at once. One head on a claim keeps Recreate: the
    claim may be ReadWriteOnce, which a surge pod on another node could not mount (the rollout would
    hang), so that head drains first and its successor starts after."""
    head = pipeline.head
    if head.replicas <= 1 and head.results.claim_name:
        return {"type": "Recreate"}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def head_service(pipeline: PipelineSpec) -> Manifest:
    """Internal ClusterIP Service over the head pods: the metrics API (triptych-metrics-api) finds the
    heads at its endpoints and the chart's ServiceMonitor scrapes them through it. The result ports
    stay so that workers started with an earlier operator's `tcp://<name>-head` keep reporting while
    they roll onto `<name>-heads`."""
    api = api_port_name(pipeline)
    results = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
               for p in _head_ports(pipeline) if p["name"] != api]  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(pipeline, HEAD_COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": labels(pipeline, HEAD_COMPONENT),
            # A draining head (not ready by design) still holds work whose metrics count, and which
            # workers must reach to report; readiness governs only the public api Service.
            "publishNotReadyAddresses": True,
            "ports": [_api_service_port(pipeline), *results],
        },
    }


def heads_service(pipeline: PipelineSpec) -> Manifest:
    """Headless Service of every head pod: its name resolves to each head's address, which is what a
    worker's `--disagg-server-addr dns://<name>-heads...:5555` serves (it derives the result ports from
    5555). Not-ready heads are listed too: a draining head must still get the reports of the work it
    is finishing, and a new head must be found before it can be ready."""
    ports = [p for p in _head_ports(pipeline) if p["name"] != api_port_name(pipeline)]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(pipeline, HEAD_COMPONENT, object_name(pipeline.name, HEADS_SERVICE)),
        "spec": {
            "clusterIP": "None",
            "selector": labels(pipeline, HEAD_COMPONENT),
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
                for p in ports
            ],
        },
    }


def head_disruption_budget(pipeline: PipelineSpec) -> Manifest | None:
    """With several heads, a voluntary disruption (a node drain, an autoscaler's scale-down) evicts one
    at a time, so the others keep serving; None with one head (a budget would block every drain of its
    node, and a single head is replaced by its Deployment, not kept by a budget)."""
    if pipeline.head.replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_metadata(pipeline, HEAD_COMPONENT),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": labels(pipeline, HEAD_COMPONENT)},
            # A head that is not ready (crash-looping, stuck) may always be evicted: it serves nothing,
            # and keeping it must not block a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def api_service(pipeline: PipelineSpec) -> Manifest:
    """The HTTP API Service, of spec.head.serviceType; it exposes only the HTTP port (the result ports
    are for the pipeline's workers, on the internal Service)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**object_metadata(pipeline, HEAD_COMPONENT, object_name(pipeline.name, API_COMPONENT))},
        "spec": {
            "type": pipeline.head.service_type,
            "selector": labels(pipeline, HEAD_COMPONENT),
            "ports": [_api_service_port(pipeline)],
        },
    }


def head_ingress(pipeline: PipelineSpec, head_flags: ServeArgs) -> Manifest | None:
    """The Ingress to the API Service, on the paths spec.head.ingress.paths lists (by default the API and the
    playground, not /metrics, /health or /ready); `head_flags`: the heads' flags (their request size and timeout)."""
    ingress = pipeline.head.ingress
    if not ingress.enabled:
        return None
    name = object_name(pipeline.name, API_COMPONENT)
    backend = {"service": {"name": name, "port": {"name": api_port_name(pipeline)}}}
    paths = [{"path": p["path"], "pathType": p["pathType"], "backend": backend} for p in ingress.paths]
    spec: Manifest = {"rules": [{"host": ingress.host, "http": {"paths": paths}}]}
    if ingress.class_name:
        spec["ingressClassName"] = ingress.class_name
    if ingress.tls_secret_name:
        spec["tls"] = [{"hosts": [ingress.host], "secretName": ingress.tls_secret_name}]
    metadata = object_metadata(pipeline, HEAD_COMPONENT, name)
    metadata["annotations"] = {
        **_nginx_annotations(pipeline, head_flags),
        **ingress.annotations,
    }
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": metadata, "spec": spec}


def _nginx_annotations(pipeline: PipelineSpec, args: ServeArgs) -> dict[str, str]:
    """ingress-nginx's settings that let a request through as the heads take it (its defaults would
    refuse a body over 1 MiB and cut an answer after 60 s); other controllers ignore them."""
    annotations = {
        NGINX + "proxy-body-size": f"{math.ceil(args.max_request_bytes / MIB)}m",
        NGINX + "proxy-read-timeout": _ingress_timeout(args.disagg_timeout),
        NGINX + "proxy-send-timeout": _ingress_timeout(args.disagg_timeout),
        NGINX + "proxy-buffering": "off",  # progress events (SSE) reach the client as the head sends them
    }
    if pipeline.head.tls_secret_name:  # the heads speak HTTPS: so must the controller, to them
        annotations[NGINX_BACKEND_PROTOCOL] = "HTTPS"
    return annotations


def _ingress_timeout(seconds: float) -> str:
    """The heads' --disagg-timeout plus a margin, in whole seconds. A non-finite one (which math.ceil cannot
    round) is refused naming the field, should it ever get past the argv checks."""
    if not math.isfinite(seconds):
        raise SpecError("spec.head.timeoutSeconds", f"--disagg-timeout {seconds} is not a finite number of seconds")
    return str(math.ceil(seconds) + INGRESS_TIMEOUT_MARGIN_S)
