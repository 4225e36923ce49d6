"""The objects of one worker role's pool: its GPU-pinned Deployment, its headless Service (how the
heads discover its pods) and its HPA on the role's pending work."""

from __future__ import annotations

from triptych.flag_roles import LORA_WORKERS
from triptych.roles import Role
from triptych_operator.constants import (
    GPU_RESOURCE,
    MULTUS_NETWORKS_ANNOTATION,
    PENDING_WORK_METRIC,
    POD_IP_ENV,
    RANK_INTERFACE_ENV,
    SHM_MOUNT,
    SHM_PER_RANK_GIB,
    WORKER_PORT,
    crd_field,
)
from triptych_operator.manifests.parts import (
    PROGRESS_DEADLINE_S,
    Manifest,
    ObjectRef,
    container_resources,
    container_security,
    control_keys_volume,
    labels,
    lora_catalog_volume,
    merged_env,
    model_volume_mounts,
    object_metadata,
    pod_security,
    standard_probes,
    template_annotations,
    tmp_volume,
)
from triptych_operator.serve_args import SERVE_COMMAND, object_name
from triptych_operator.spec.model import PipelineSpec


def role_refs(pipeline: PipelineSpec, role: Role) -> list[ObjectRef]:
    """The children one role's pool consists of."""
    name = object_name(pipeline.name, role.dns_name)
    return [
        ObjectRef("apps/v1", "Deployment", name),
        ObjectRef("v1", "Service", name),
        ObjectRef("autoscaling/v2", "HorizontalPodAutoscaler", name),
    ]


def rank_env(ranks: int) -> list[Manifest]:
    """Env for a role of several ranks (one process per GPU, all in this pod): their collectives stay on
    loopback, never on the pod or RDMA network (the user's own values for these names win: merged_env)."""
    if ranks <= 1:
        return []
    return [{"name": name, "value": "lo"} for name in RANK_INTERFACE_ENV]


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
    # Denoisers and prompt encoders load the adapters: hub ids among them download into a cache, with the
    # model's token. They always have the cache, so an adapter added to the catalogue rolls no pod.
    volumes, mounts, model_env = model_volume_mounts(pipeline, downloads=role in LORA_WORKERS)
    keys_volume, keys_mount = control_keys_volume(pipeline, "worker")
    tmp, tmp_mount = tmp_volume()
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
        # POD_IP is the operator's alone (the spec's rules refuse it in a role's env); the rest the user may override.
        "env": [
            {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *merged_env([*model_env, *rank_env(spec.num_devices)], spec.env),
        ],
        "ports": [{"name": "work", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        "resources": container_resources(spec.resources, extended),
        "securityContext": container_security(),
        # A refused start-up ends the log with one line naming the flag; the status shows it (and its CR field).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [*mounts, {"name": "shm", "mountPath": SHM_MOUNT}, tmp_mount, keys_mount],
        # The worker binds its work socket only after loading its model, so "open" means "can take work".
        **standard_probes({"tcpSocket": {"port": "work"}}),
    }
    # GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule; a GPU pod may always go there, a
    # CPU pod stays off them unless the user's own tolerations say otherwise.
    gpu_toleration = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
    tolerations = [*([gpu_toleration] if spec.gpus_per_replica else []), *spec.tolerations]
    pod_spec: Manifest = {
        "securityContext": pod_security(),
        "automountServiceAccountToken": False,  # a worker never calls the Kubernetes API
        "enableServiceLinks": False,
        # SIGTERM starts the worker's drain (no new work, finish and push what it holds, exit 0); the
        # kubelet kills it this much later. A terminating pod leaves the headless Service's ready
        # addresses at once (Kubernetes does that, whatever the probe says), so no new work is routed to it.
        "terminationGracePeriodSeconds": spec.drain_seconds,
        "containers": [container],
        # NCCL and torch.multiprocessing share tensors through /dev/shm; the default 64 MiB is too small.
        "volumes": [*volumes, shm_volume(spec.num_devices), tmp, keys_volume],
        "tolerations": tolerations,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.affinity:
        pod_spec["affinity"] = dict(spec.affinity)
    template_meta: Manifest = {"labels": labels(pipeline, crd_field(role))}
    annotations = template_annotations(keys_fingerprint)
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
        "metadata": object_metadata(pipeline, crd_field(role), object_name(pipeline.name, role.dns_name)),
        "spec": deployment_spec,
    }


def worker_service(pipeline: PipelineSpec, role: Role) -> Manifest:
    """Headless Service: its DNS name resolves to the ready workers, which the head discovers via dns://."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(pipeline, crd_field(role), object_name(pipeline.name, role.dns_name)),
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
        "metadata": object_metadata(pipeline, crd_field(role), object_name(pipeline.name, role.dns_name)),
        "spec": {
            "scaleTargetRef": deployment,
            "minReplicas": max(auto.min_replicas, 1),  # 0 is the operator's to make (wake.py), not the HPA's
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
