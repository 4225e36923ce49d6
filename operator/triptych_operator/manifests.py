"""Desired children of a DiffusionPipeline, as plain dicts: `PipelineSpec -> manifests`.

Nothing here talks to the API server, so every object the operator writes can be unit-tested.
Each role's objects depend only on that role's spec (and the shared model/transfer/images), so
editing one role rolls only that role's Deployment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from triptych.flag_roles import LORA_WORKERS
from triptych.lora import parse_entries
from triptych.ports import MOONCAKE_PORT_RANGE, result_port
from triptych.roles import Role
from triptych.security import Side, key_files
from triptych_operator.constants import (
    API_KEYS_FILE,
    API_KEYS_MOUNT,
    APP_NAME,
    GPU_RESOURCE,
    HEAD_COMPONENT,
    HEAD_SCHEDULER_PORT,
    HEADS_SERVICE,
    HF_CACHE_MOUNT,
    KEYS_COMPONENT,
    KEYS_FINGERPRINT_ANNOTATION,
    KEYS_MOUNT,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LORA_CATALOG_FILE,
    LORA_CATALOG_MOUNT,
    LORA_COMPONENT,
    MANAGER,
    MODEL_MOUNT,
    MULTUS_NETWORKS_ANNOTATION,
    OUTPUT_MOUNT,
    PENDING_WORK_METRIC,
    PIPELINE_ROLES,
    RANK_INTERFACE_ENV,
    RUN_AS_USER,
    SHM_MOUNT,
    SHM_PER_RANK_GIB,
    WORKER_PORT,
    crd_field,
)
from triptych_operator.serve_args import SERVE_COMMAND, head_argv, object_name, worker_argv
from triptych_operator.spec.declaration import HEAD_UNROUTE_S, S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV
from triptych_operator.spec.model import PipelineSpec, SpecError

Manifest = dict[str, Any]

API_COMPONENT = "api"  # the head's public HTTP Service; the scheduler ports stay on the internal one
# Model loading takes minutes; the startup probe allows this long before liveness applies.
STARTUP_GRACE_S = 1800
# A rollout is reported stuck only after the startup grace has run out, not while a model loads.
PROGRESS_DEADLINE_S = STARTUP_GRACE_S + 600
PROBE_PERIOD_S = 10
HEAD_HEALTH_PATH = "/health"  # the head API's liveness route (head/triptych_head/api/system.py)
HEAD_READY_PATH = "/ready"  # its readiness route: 503 from the moment it drains (SIGTERM)
HEAD_READY_PERIOD_S = 2
KEYS_VOLUME = "control-keys"
KEYS_FILE_MODE = 0o440  # owner root, group the pod's fsGroup (the process): nobody else reads the secret keys
WORKERS_POLICY = "workers"  # name suffixes of the two NetworkPolicies
HEAD_POLICY = "head"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


@dataclass(frozen=True)
class ObjectRef:
    """An object the operator may have created earlier and that must not exist now."""

    api_version: str
    kind: str
    name: str


@dataclass
class Children:
    """What to apply for a pipeline, and which optional objects to remove (e.g. a disabled HPA)."""

    apply: list[Manifest] = field(default_factory=list)
    delete: list[ObjectRef] = field(default_factory=list)


def labels(pipeline: PipelineSpec, component: str) -> dict[str, str]:
    """Common labels; also the (immutable) Deployment selectors, so they never include anything that changes."""
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: pipeline.name,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGER,
    }


def _metadata(pipeline: PipelineSpec, component: str, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or object_name(pipeline.name, component),
        "namespace": pipeline.namespace,
        "labels": labels(pipeline, component),
    }


def render(pipeline: PipelineSpec, owner: Mapping[str, Any] | None = None, keys_fingerprint: str = "") -> Children:
    """Every child of `pipeline`; argv are validated first, so an invalid spec renders nothing.

    With `owner` (the DiffusionPipeline body), each child gets a controller owner reference so
    deleting the pipeline garbage-collects it. `keys_fingerprint` (of the control-keys Secret,
    which the handler creates once, see `control_keys_secret`) goes into every pod template, so
    new keys roll every pod.
    """
    argvs = {role: worker_argv(pipeline, role) for role in pipeline.roles}
    head_args = head_argv(pipeline)
    children = Children()
    for role in PIPELINE_ROLES:
        if role not in pipeline.roles:  # the other encoder shape: remove its pool if it was declared before
            children.delete += _role_refs(pipeline, role)
            continue
        deployment = worker_deployment(pipeline, role, argvs[role], keys_fingerprint)
        children.apply += [deployment, worker_service(pipeline, role)]
        hpa = worker_hpa(pipeline, role)
        if hpa is None:
            children.delete.append(
                ObjectRef("autoscaling/v2", "HorizontalPodAutoscaler", object_name(pipeline.name, role.dns_name))
            )
        else:
            children.apply.append(hpa)
    children.apply += [head_deployment(pipeline, head_args, keys_fingerprint), head_service(pipeline)]
    children.apply.append(heads_service(pipeline))
    pdb = head_disruption_budget(pipeline)
    if pdb is None:
        children.delete.append(
            ObjectRef("policy/v1", "PodDisruptionBudget", object_name(pipeline.name, HEAD_COMPONENT))
        )
    else:
        children.apply.append(pdb)
    children.apply += [api_service(pipeline), worker_network_policy(pipeline), head_network_policy(pipeline)]
    catalog = lora_catalog(pipeline)
    if catalog is None:
        children.delete.append(ObjectRef("v1", "ConfigMap", object_name(pipeline.name, LORA_COMPONENT)))
    else:
        children.apply.append(catalog)
    ingress = head_ingress(pipeline)
    if ingress is None:
        children.delete.append(ObjectRef("networking.k8s.io/v1", "Ingress", object_name(pipeline.name, API_COMPONENT)))
    else:
        children.apply.append(ingress)
    if owner is not None:
        # The owner-reference half of kopf.adopt: adopt would also copy the pipeline's labels onto
        # every child, so relabelling a pipeline would rewrite all of its objects.
        kopf.append_owner_reference(children.apply, owner=kopf.Body(cast(kopf.RawBody, dict(owner))))
    return children


def _model_volume(
    pipeline: PipelineSpec, downloads: bool = False
) -> tuple[list[Manifest], list[Manifest], list[Manifest]]:
    """(volumes, mounts, env) that give a container the model; a hub model needs a cache and a token,
    as does a denoiser of a model on a volume (`downloads`) that may fetch hub-id LoRA adapters."""
    model = pipeline.model
    if model.uses_volume and not downloads:
        if model.pvc_claim_name:
            source: Manifest = {"persistentVolumeClaim": {"claimName": model.pvc_claim_name, "readOnly": True}}
        else:
            source = {"hostPath": {"path": model.host_path, "type": "Directory"}}
        return [{"name": "model", **source}], [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}], []
    volumes: list[Manifest] = [{"name": "hf-cache", "emptyDir": {}}]
    mounts: list[Manifest] = [{"name": "hf-cache", "mountPath": HF_CACHE_MOUNT}]
    if model.uses_volume:  # and downloads: the model from its volume, adapters from the hub into the cache
        model_volumes, model_mounts, _ = _model_volume(pipeline)
        volumes, mounts = [*model_volumes, *volumes], [*model_mounts, *mounts]
    env: list[Manifest] = [{"name": "HF_HOME", "value": f"{HF_CACHE_MOUNT}/huggingface"}]
    if model.token_secret_name:
        ref = {"name": model.token_secret_name, "key": model.token_secret_key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return volumes, mounts, env


def lora_catalog(pipeline: PipelineSpec) -> Manifest | None:
    """spec.model.loras as the ConfigMap the head, the denoisers and the prompt encoders read their --lora-catalog from;
    None without adapters. SpecError naming the field for an entry the processes would not take."""
    loras = pipeline.model.loras
    if not loras:
        return None
    try:
        parse_entries(loras, "spec.model.loras:")
    except ValueError as exc:
        raise SpecError("spec.model.loras", str(exc).removeprefix("spec.model.loras: ")) from None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(pipeline, LORA_COMPONENT, object_name(pipeline.name, LORA_COMPONENT)),
        "data": {LORA_CATALOG_FILE.rsplit("/", 1)[1]: "".join(f"{entry}\n" for entry in loras)},
    }


def lora_catalog_volume(pipeline: PipelineSpec) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, mounts) of the adapters' catalogue, mounted whole (no subPath) so that an edit of
    spec.model.loras reaches the file within the kubelet's sync period, and no pod restarts."""
    if not pipeline.model.loras:
        return [], []
    source = {"name": object_name(pipeline.name, LORA_COMPONENT)}
    return [{"name": "loras", "configMap": source}], [
        {"name": "loras", "mountPath": LORA_CATALOG_MOUNT, "readOnly": True}
    ]


def keys_secret_name(pipeline: PipelineSpec) -> str:
    return object_name(pipeline.name, KEYS_COMPONENT)


def control_keys_secret(pipeline: PipelineSpec, files: Mapping[str, str]) -> Manifest:
    """The pipeline's control-plane key set (triptych.security.new_key_set). Created once and never
    rewritten: deleting it is how keys are rotated (the operator makes new ones and rolls every pod)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(pipeline, KEYS_COMPONENT, keys_secret_name(pipeline)),
        "type": "Opaque",
        "stringData": dict(files),
    }


def _keys_volume(pipeline: PipelineSpec, side: Side) -> tuple[Manifest, Manifest]:
    """(volume, mount) of the key files one side needs: its own pair and the other side's public key.
    A worker never holds the head's secret key, nor the head a worker's."""
    items = [{"key": name, "path": name} for name in key_files(side)]
    secret = {"secretName": keys_secret_name(pipeline), "defaultMode": KEYS_FILE_MODE, "items": items}
    return {"name": KEYS_VOLUME, "secret": secret}, {"name": KEYS_VOLUME, "mountPath": KEYS_MOUNT, "readOnly": True}


def _template_annotations(keys_fingerprint: str) -> dict[str, str]:
    return {KEYS_FINGERPRINT_ANNOTATION: keys_fingerprint} if keys_fingerprint else {}


def _probes(check: Manifest) -> dict[str, Manifest]:
    """Startup (long: the model loads), readiness and liveness, all with the same check."""
    probe = {**check, "periodSeconds": PROBE_PERIOD_S}
    return {
        "startupProbe": {**probe, "failureThreshold": STARTUP_GRACE_S // PROBE_PERIOD_S},
        "readinessProbe": {**probe, "failureThreshold": 3},
        "livenessProbe": {**probe, "failureThreshold": 6},
    }


def _pod_security() -> Manifest:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER}


def _resources(user: Mapping[str, Any], extended: Mapping[str, int]) -> Manifest:
    """User requests/limits plus the extended resources the role needs (the operator's counts win)."""
    limits = {**(user.get("limits") or {}), **{k: v for k, v in extended.items()}}
    out: Manifest = {"limits": limits} if limits else {}
    requests = {k: v for k, v in (user.get("requests") or {}).items() if k not in extended}
    if requests:
        out["requests"] = requests
    return out


def _role_refs(pipeline: PipelineSpec, role: Role) -> list[ObjectRef]:
    """The children one role's pool consists of."""
    name = object_name(pipeline.name, role.dns_name)
    return [
        ObjectRef("apps/v1", "Deployment", name),
        ObjectRef("v1", "Service", name),
        ObjectRef("autoscaling/v2", "HorizontalPodAutoscaler", name),
    ]


def rank_env(ranks: int, user_env: Sequence[Mapping[str, Any]] = ()) -> list[Manifest]:
    """Env for a role of several ranks (one process per GPU, all in this pod): their collectives stay on
    loopback, never on the pod or RDMA network; the user's own values for these names win."""
    if ranks <= 1:
        return []
    chosen = {e.get("name") for e in user_env}
    return [{"name": name, "value": "lo"} for name in RANK_INTERFACE_ENV if name not in chosen]


def shm_volume(ranks: int) -> Manifest:
    """/dev/shm in memory; with several ranks, SHM_PER_RANK_GIB for each (NCCL's buffers between them)."""
    empty_dir: Manifest = {"medium": "Memory"}
    if ranks > 1:
        empty_dir["sizeLimit"] = f"{SHM_PER_RANK_GIB * ranks}Gi"
    return {"name": "shm", "emptyDir": empty_dir}


def worker_deployment(pipeline: PipelineSpec, role: Role, argv: list[str], keys_fingerprint: str = "") -> Manifest:
    """The Deployment of one worker role: GPU-pinned, or a CPU role (gpusPerReplica 0) that asks for no GPU."""
    spec = pipeline.roles[role]
    transfer = pipeline.transfer
    # Denoisers and prompt encoders load the adapters: hub ids among them download into a cache, with the model's token.
    hub_adapters = role in LORA_WORKERS and any(not e.partition("=")[2].startswith("/") for e in pipeline.model.loras)
    volumes, mounts, model_env = _model_volume(pipeline, downloads=hub_adapters)
    keys_volume, keys_mount = _keys_volume(pipeline, "worker")
    if role in LORA_WORKERS:  # the roles that load adapters
        lora_volumes, lora_mounts = lora_catalog_volume(pipeline)
        volumes, mounts = [*volumes, *lora_volumes], [*mounts, *lora_mounts]
    extended = {GPU_RESOURCE: spec.gpus_per_replica} if spec.gpus_per_replica else {}
    moves_tensors = not pipeline.full_pipeline  # a full-pipeline worker runs no Mooncake: no NIC, no pinned pool
    if transfer.rdma and moves_tensors:
        extended[transfer.rdma_resource_name] = transfer.rdma_resource_count
    container: Manifest = {
        "name": role.dns_name,
        "image": pipeline.image_for(role),
        "command": list(SERVE_COMMAND),
        "args": argv,
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *model_env,
            *rank_env(spec.num_devices, spec.env),
            *spec.env,
        ],
        "ports": [{"name": "work", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        "resources": _resources(spec.resources, extended),
        # Mooncake registers (pins) transfer buffers, which needs locked memory.
        "securityContext": {
            "allowPrivilegeEscalation": False,
            **({"capabilities": {"add": ["IPC_LOCK"]}} if moves_tensors else {}),
        },
        # A refused start-up ends the log with one line naming the flag; the status shows it (and its CR field).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [*mounts, {"name": "shm", "mountPath": SHM_MOUNT}, keys_mount],
        # The worker binds its work socket only after loading its model, so "open" means "can take work".
        **_probes({"tcpSocket": {"port": "work"}}),
    }
    # GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule; a GPU pod may always go there, a
    # CPU pod stays off them unless the user's own tolerations say otherwise.
    gpu_toleration = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
    tolerations = [*([gpu_toleration] if spec.gpus_per_replica else []), *spec.tolerations]
    pod_spec: Manifest = {
        "securityContext": _pod_security(),
        "enableServiceLinks": False,
        # SIGTERM starts the worker's drain (no new work, finish and push what it holds, exit 0); the
        # kubelet kills it this much later. A terminating pod leaves the headless Service's ready
        # addresses at once (Kubernetes does that, whatever the probe says), so no new work is routed to it.
        "terminationGracePeriodSeconds": spec.drain_seconds,
        "containers": [container],
        # NCCL and torch.multiprocessing share tensors through /dev/shm; the default 64 MiB is too small.
        "volumes": [*volumes, shm_volume(spec.num_devices), keys_volume],
        "tolerations": tolerations,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.affinity:
        pod_spec["affinity"] = dict(spec.affinity)
    template_meta: Manifest = {"labels": labels(pipeline, crd_field(role))}
    annotations = _template_annotations(keys_fingerprint)
    if transfer.network_annotation and moves_tensors:
        annotations[MULTUS_NETWORKS_ANNOTATION] = transfer.network_annotation
    if annotations:
        template_meta["annotations"] = annotations
    deployment_spec: Manifest = {
        "selector": {"matchLabels": labels(pipeline, crd_field(role))},
        # No surge: a surge pod needs GPUs that are usually all taken, and would sit Pending.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": spec.rolling_update()},
        "progressDeadlineSeconds": PROGRESS_DEADLINE_S,
        "template": {"metadata": template_meta, "spec": pod_spec},
    }
    # With an HPA the replica count is its field; applying ours would fight it.
    if not spec.autoscaling.enabled:
        deployment_spec["replicas"] = spec.replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(pipeline, crd_field(role), object_name(pipeline.name, role.dns_name)),
        "spec": deployment_spec,
    }


def worker_service(pipeline: PipelineSpec, role: Role) -> Manifest:
    """Headless Service: its DNS name resolves to the ready workers, which the head discovers via dns://."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(pipeline, crd_field(role), object_name(pipeline.name, role.dns_name)),
        "spec": {
            "clusterIP": "None",
            "selector": labels(pipeline, crd_field(role)),
            "ports": [{"name": "work", "port": WORKER_PORT, "targetPort": "work", "protocol": "TCP"}],
        },
    }


# Scale-up: react at once, at most doubling (or +4 pods) a minute: a new GPU pod takes minutes to
# load its model, and its arrival is what the next evaluation should see.
SCALE_UP_BEHAVIOR: Manifest = {
    "stabilizationWindowSeconds": 0,
    "selectPolicy": "Max",
    "policies": [
        {"type": "Percent", "value": 100, "periodSeconds": 60},
        {"type": "Pods", "value": 4, "periodSeconds": 60},
    ],
}


def worker_hpa(pipeline: PipelineSpec, role: Role) -> Manifest | None:
    """An autoscaling/v2 HPA on the role's pending work, when the role asks for one.

    The metric is an Object metric on the role's own Deployment (served by triptych-metrics-api
    from the head): the device-seconds of queued and running work. With an AverageValue target
    the HPA keeps replicas = ceil(pending work / target per replica).
    """
    auto = pipeline.roles[role].autoscaling
    if not auto.enabled:
        return None
    name = object_name(pipeline.name, role.dns_name)
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(pipeline, crd_field(role), object_name(pipeline.name, role.dns_name)),
        "spec": {
            "scaleTargetRef": deployment,
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [
                {
                    "type": "Object",
                    "object": {
                        "describedObject": deployment,
                        "metric": {"name": PENDING_WORK_METRIC},
                        "target": {"type": "AverageValue", "averageValue": str(auto.target_work_seconds_per_replica)},
                    },
                }
            ],
            "behavior": {
                "scaleUp": SCALE_UP_BEHAVIOR,
                "scaleDown": {
                    "stabilizationWindowSeconds": auto.scale_down_stabilization_seconds,
                    "selectPolicy": "Max",
                    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
                },
            },
        },
    }


def _result_port_name(role: Role) -> str:
    # Port names are at most 15 characters: "result-denoiser" is exactly that; the split encoders
    # are named by their offset (result-plus4: --scheduler-port + 4).
    name = f"result-{role.dns_name}"
    return name if len(name) <= 15 else f"result-plus{role.spec.result_port_offset}"


def _head_ports(pipeline: PipelineSpec) -> list[Manifest]:
    """HTTP and the result ports workers push to. The frontend (the scheduler port itself) is the
    head's in-process socket on loopback; workers only derive the result ports from its number."""
    ports = [{"name": "http", "containerPort": pipeline.head.port}]
    ports += [
        {"name": _result_port_name(role), "containerPort": result_port(HEAD_SCHEDULER_PORT, role)}
        for role in pipeline.roles
    ]
    return [{**p, "protocol": "TCP"} for p in ports]


def _head_probes() -> dict[str, Manifest]:
    """Liveness (and startup) on /health, which stays 200 while the head drains so it is not killed
    mid-drain; readiness on /ready, which fails at once on SIGTERM so the api Service drops it."""
    probes = _probes({"httpGet": {"path": HEAD_HEALTH_PATH, "port": "http"}})
    probes["readinessProbe"] = {
        "httpGet": {"path": HEAD_READY_PATH, "port": "http"},
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


def head_results_env(pipeline: PipelineSpec) -> list[Manifest]:
    """The bucket's credentials, as the head's S3 client reads them: references to the Secret's keys,
    so the values are in no Deployment (and `kubectl get deploy -o yaml` shows none)."""
    s3 = pipeline.head.results.s3
    if s3 is None or s3.credentials is None:
        return []
    creds = s3.credentials
    return [
        {"name": env, "valueFrom": {"secretKeyRef": {"name": creds.name, "key": key}}}
        for env, key in ((S3_ACCESS_KEY_ENV, creds.access_key_id_key), (S3_SECRET_KEY_ENV, creds.secret_access_key_key))
    ]


def head_api_keys_volume(pipeline: PipelineSpec) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, mounts) of head.apiKeysSecret: its key as the file --api-keys-file names. A Secret
    update reaches the mounted file within the kubelet's sync period; the head re-reads it then."""
    ref = pipeline.head.api_keys_secret
    if ref is None:
        return [], []
    items = [{"key": ref.key, "path": API_KEYS_FILE.rsplit("/", 1)[1]}]
    volume = {"name": "api-keys", "secret": {"secretName": ref.name, "items": items, "defaultMode": 0o440}}
    return [volume], [{"name": "api-keys", "mountPath": API_KEYS_MOUNT, "readOnly": True}]


def head_deployment(pipeline: PipelineSpec, argv: list[str], keys_fingerprint: str = "") -> Manifest:
    """The GPU-less head: HTTP API plus the scheduler frontend and result sockets."""
    head = pipeline.head
    volumes, mounts, model_env = _model_volume(pipeline)
    keys_volume, keys_mount = _keys_volume(pipeline, "head")
    api_key_volumes, api_key_mounts = head_api_keys_volume(pipeline)
    lora_volumes, lora_mounts = lora_catalog_volume(pipeline)
    volumes, mounts = [*volumes, *lora_volumes], [*mounts, *lora_mounts]
    container: Manifest = {
        "name": HEAD_COMPONENT,
        "image": pipeline.head_image,
        "command": list(SERVE_COMMAND),
        "args": argv,
        "env": [*model_env, *head_results_env(pipeline), *head.env],
        "ports": _head_ports(pipeline),
        "resources": _resources(head.resources, {}),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [*mounts, {"name": "outputs", "mountPath": OUTPUT_MOUNT}, keys_mount, *api_key_mounts],
        **_head_probes(),
        # Deleted, it keeps serving while every Service and proxy stops routing to it; SIGTERM (the
        # drain: new requests get a 503) comes after, when none should arrive. Part of the grace period.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(HEAD_UNROUTE_S)]}}},
    }
    pod_spec: Manifest = {
        "securityContext": _pod_security(),
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
        head_template_meta["annotations"] = _template_annotations(keys_fingerprint)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(pipeline, HEAD_COMPONENT),
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
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in _head_ports(pipeline)]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(pipeline, HEAD_COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": labels(pipeline, HEAD_COMPONENT),
            # A draining head (not ready by design) still holds work whose metrics count, and which
            # workers must reach to report; readiness governs only the public api Service.
            "publishNotReadyAddresses": True,
            "ports": [{**p, "protocol": "TCP"} for p in ports],
        },
    }


def heads_service(pipeline: PipelineSpec) -> Manifest:
    """Headless Service of every head pod: its name resolves to each head's address, which is what a
    worker's `--disagg-server-addr dns://<name>-heads...:5555` serves (it derives the result ports from
    5555). Not-ready heads are listed too: a draining head must still get the reports of the work it
    is finishing, and a new head must be found before it can be ready."""
    ports = [p for p in _head_ports(pipeline) if p["name"] != "http"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(pipeline, HEAD_COMPONENT, object_name(pipeline.name, HEADS_SERVICE)),
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
        "metadata": _metadata(pipeline, HEAD_COMPONENT),
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
        "metadata": {**_metadata(pipeline, HEAD_COMPONENT, object_name(pipeline.name, API_COMPONENT))},
        "spec": {
            "type": pipeline.head.service_type,
            "selector": labels(pipeline, HEAD_COMPONENT),
            "ports": [{"name": "http", "port": pipeline.head.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _workers_selector(pipeline: PipelineSpec) -> Manifest:
    """Every worker pod of this pipeline, whatever its role."""
    common = {k: v for k, v in labels(pipeline, "").items() if k != LABEL_COMPONENT}
    roles = [crd_field(role) for role in pipeline.roles]
    return {"matchLabels": common, "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": roles}]}


def _head_selector(pipeline: PipelineSpec) -> Manifest:
    return {"matchLabels": labels(pipeline, HEAD_COMPONENT)}


def worker_network_policy(pipeline: PipelineSpec) -> Manifest:
    """Workers accept their work port from the pipeline's head only, and Mooncake's ports (handshake
    and TCP data, both from MOONCAKE_PORT_RANGE) from the pipeline's other workers only. RDMA
    traffic bypasses the kernel and is not subject to NetworkPolicy."""
    low, high = MOONCAKE_PORT_RANGE
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(pipeline, WORKERS_POLICY),
        "spec": {
            "podSelector": _workers_selector(pipeline),
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": _head_selector(pipeline)}],
                    "ports": [{"protocol": "TCP", "port": WORKER_PORT}],
                },
                {
                    "from": [{"podSelector": _workers_selector(pipeline)}],
                    "ports": [{"protocol": "TCP", "port": low, "endPort": high}],
                },
            ],
        },
    }


def head_network_policy(pipeline: PipelineSpec) -> Manifest:
    """The head accepts its result ports from the pipeline's workers only, one per role the pipeline
    has (scheduler port +1..+5: encoder, denoiser, decoder, prompt_encoder, image_encoder); its HTTP
    port from anyone (clients, the Ingress controller, the metrics API server's scrape). The frontend
    port is loopback."""
    result_ports = [{"protocol": "TCP", "port": result_port(HEAD_SCHEDULER_PORT, role)} for role in pipeline.roles]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(pipeline, HEAD_COMPONENT, object_name(pipeline.name, HEAD_POLICY)),
        "spec": {
            "podSelector": _head_selector(pipeline),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": _workers_selector(pipeline)}], "ports": result_ports},
                {"ports": [{"protocol": "TCP", "port": pipeline.head.port}]},
            ],
        },
    }


def head_ingress(pipeline: PipelineSpec) -> Manifest | None:
    ingress = pipeline.head.ingress
    if not ingress.enabled:
        return None
    name = object_name(pipeline.name, API_COMPONENT)
    backend = {"service": {"name": name, "port": {"name": "http"}}}
    spec: Manifest = {
        "rules": [{"host": ingress.host, "http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": backend}]}}]
    }
    if ingress.class_name:
        spec["ingressClassName"] = ingress.class_name
    if ingress.tls_secret_name:
        spec["tls"] = [{"hosts": [ingress.host], "secretName": ingress.tls_secret_name}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": _metadata(pipeline, HEAD_COMPONENT, name),
        "spec": spec,
    }
