"""What every child's manifest is made of: labels and metadata, probes, pod security, resources, and
the volumes more than one kind of pod mounts (the model, the control-plane keys, the LoRA catalogue)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from triptych.env_secrets import HUB_TOKEN_PATH_ENV, file_variable
from triptych.lora import parse_entries
from triptych.security import Side, key_files
from triptych_operator.constants import (
    APP_NAME,
    HF_CACHE_MOUNT,
    HUB_TOKEN_FILE,
    HUB_TOKEN_MOUNT,
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
    RUN_AS_USER,
    TMP_MOUNT,
)
from triptych_operator.serve_args import object_name
from triptych_operator.spec.model import PipelineSpec, SpecError

Manifest = dict[str, Any]

# Model loading takes minutes; the startup probe allows this long before liveness applies.
STARTUP_GRACE_S = 1800
# A rollout is reported stuck only after the startup grace has run out, not while a model loads.
PROGRESS_DEADLINE_S = STARTUP_GRACE_S + 600
PROBE_PERIOD_S = 10
KEYS_VOLUME = "control-keys"
# Every Secret the pods mount: owner root, group the pod's fsGroup (the process): nobody else reads them.
SECRET_FILE_MODE = 0o440
HUB_TOKEN_VOLUME = "hub-token"
TMP_VOLUME = "tmp"


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


def object_metadata(pipeline: PipelineSpec, component: str, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or object_name(pipeline.name, component),
        "namespace": pipeline.namespace,
        "labels": labels(pipeline, component),
    }


def merged_env(operator_env: Sequence[Manifest], user_env: Sequence[Mapping[str, Any]]) -> list[Manifest]:
    """A container's env: the operator's entries, less those whose name the user's `env` sets, then the
    user's. The user's value wins (a token from another Secret, a cache elsewhere), and no name appears
    twice, which server-side apply refuses. A value the user gives also replaces the operator's file of it
    (AWS_ACCESS_KEY_ID the operator's AWS_ACCESS_KEY_ID_FILE), which the head would refuse beside it. Names
    the operator cannot give up are refused by the spec's rules instead (POD_IP)."""
    chosen = {e.get("name") for e in user_env}
    replaced = chosen | {file_variable(name) for name in chosen if name}
    return [*(e for e in operator_env if e["name"] not in replaced), *(dict(e) for e in user_env)]


def model_volume_mounts(
    pipeline: PipelineSpec, downloads: bool = False
) -> tuple[list[Manifest], list[Manifest], list[Manifest]]:
    """(volumes, mounts, env) that give a container the model; a hub model needs a cache and a token (a
    Secret file), as does a denoiser of a model on a volume (`downloads`) that may fetch hub-id LoRA adapters."""
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
        model_volumes, model_mounts, _ = model_volume_mounts(pipeline)
        volumes, mounts = [*model_volumes, *volumes], [*model_mounts, *mounts]
    env: list[Manifest] = [{"name": "HF_HOME", "value": f"{HF_CACHE_MOUNT}/huggingface"}]
    if model.token_secret_name:  # a file HF_TOKEN_PATH names, not an HF_TOKEN value every child process inherits
        token = [(model.token_secret_key, file_name(HUB_TOKEN_FILE))]
        volume, mount = secret_files_volume(HUB_TOKEN_VOLUME, model.token_secret_name, token, HUB_TOKEN_MOUNT)
        volumes, mounts = [*volumes, volume], [*mounts, mount]
        env.append({"name": HUB_TOKEN_PATH_ENV, "value": HUB_TOKEN_FILE})
    return volumes, mounts, env


def lora_catalog(pipeline: PipelineSpec) -> Manifest | None:
    """spec.model.loras as the ConfigMap the head, the denoisers and the prompt encoders read their --lora-catalog from;
    None without adapters. SpecError naming the field for an entry the processes would not take."""
    loras = pipeline.model.loras
    if not loras:
        return None
    where = "spec.model.loras"
    try:
        parse_entries(loras, where)
    except ValueError as exc:  # "<where> 'entry' ..." or "<where>: ...": the SpecError names the field once
        raise SpecError(where, str(exc).removeprefix(where).lstrip(": ")) from None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_metadata(pipeline, LORA_COMPONENT, object_name(pipeline.name, LORA_COMPONENT)),
        "data": {file_name(LORA_CATALOG_FILE): "".join(f"{entry}\n" for entry in loras)},
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
        "metadata": object_metadata(pipeline, KEYS_COMPONENT, keys_secret_name(pipeline)),
        "type": "Opaque",
        "stringData": dict(files),
    }


def file_name(path: str) -> str:
    """The last element of a file's path in a pod: the name a volume item gives it in its mount."""
    return path.rsplit("/", 1)[1]


def secret_files_volume(
    volume: str, secret_name: str, files: Sequence[tuple[str, str]], mount_path: str
) -> tuple[Manifest, Manifest]:
    """(volume, mount) of a Secret's keys as files (`files`: (key, file name) pairs) in `mount_path`: read-only,
    SECRET_FILE_MODE, and mounted whole (never subPath) so that a Secret update reaches the files."""
    items = [{"key": key, "path": name} for key, name in files]
    secret = {"secretName": secret_name, "items": items, "defaultMode": SECRET_FILE_MODE}
    return {"name": volume, "secret": secret}, {"name": volume, "mountPath": mount_path, "readOnly": True}


def control_keys_volume(pipeline: PipelineSpec, side: Side) -> tuple[Manifest, Manifest]:
    """(volume, mount) of the key files one side needs: its own pair and the other side's public key.
    A worker never holds the head's secret key, nor the head a worker's."""
    files = [(name, name) for name in key_files(side)]
    return secret_files_volume(KEYS_VOLUME, keys_secret_name(pipeline), files, KEYS_MOUNT)


def template_annotations(keys_fingerprint: str) -> dict[str, str]:
    return {KEYS_FINGERPRINT_ANNOTATION: keys_fingerprint} if keys_fingerprint else {}


def standard_probes(check: Manifest) -> dict[str, Manifest]:
    """Startup (long: the model loads), readiness and liveness, all with the same check."""
    probe = {**check, "periodSeconds": PROBE_PERIOD_S}
    return {
        "startupProbe": {**probe, "failureThreshold": STARTUP_GRACE_S // PROBE_PERIOD_S},
        "readinessProbe": {**probe, "failureThreshold": 3},
        "livenessProbe": {**probe, "failureThreshold": 6},
    }


def pod_security() -> Manifest:
    """The pod securityContext of heads and workers: the images' non-root uid, the runtime's default seccomp filter."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> Manifest:
    """The container securityContext of heads and workers: no capability at all, and a read-only root
    filesystem (what the processes write goes to mounted volumes: tmp_volume, the hub cache, the results,
    /dev/shm). A worker's Mooncake pins its transfer buffers under RLIMIT_MEMLOCK: CAP_IPC_LOCK would not
    reach a non-root process anyway (only ambient capabilities would, which Kubernetes does not set)."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def tmp_volume() -> tuple[Manifest, Manifest]:
    """(volume, mount) of /tmp, the images' HOME, writable on the read-only root filesystem: torch's and
    triton's caches, the temporary files of libraries, a head's staging of results for its bucket."""
    return {"name": TMP_VOLUME, "emptyDir": {}}, {"name": TMP_VOLUME, "mountPath": TMP_MOUNT}


def container_resources(user: Mapping[str, Any], extended: Mapping[str, int]) -> Manifest:
    """User requests/limits plus the extended resources the role needs (the operator's counts win)."""
    limits = {**(user.get("limits") or {}), **{k: v for k, v in extended.items()}}
    out: Manifest = {"limits": limits} if limits else {}
    requests = {k: v for k, v in (user.get("requests") or {}).items() if k not in extended}
    if requests:
        out["requests"] = requests
    return out
