"""The operator against a real API server (tests/cluster): kwok runs the pods on fake GPU/RDMA nodes.

The operator runs in-process with kopf's KopfRunner, namespaced to the test's namespace. Every
wait is bounded and polls.
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner

from tests.cluster.fixtures import CommandError, KubeCluster, poll
from tests.operator.helpers import REPO, example
from triptych.security import public_fingerprint

pytestmark = pytest.mark.cluster

CRD = REPO / "crds" / "diffusionpipelines.yaml"
CHART = REPO / "charts" / "triptych"
GPU_NODES = {"gpu-node-0", "gpu-node-1"}
COMPONENTS = ("encoder", "denoiser", "decoder", "head")


@pytest.fixture(scope="module")
def crd(kube_cluster: KubeCluster) -> KubeCluster:
    kube_cluster.apply_crd(CRD)
    return kube_cluster


@pytest.fixture
def operator(crd: KubeCluster, kube_namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[KopfRunner]:
    """The operator, running in this process and watching only the test namespace."""
    monkeypatch.setenv("KUBECONFIG", crd.kubeconfig)
    args = ["run", "--standalone", "--namespace", kube_namespace, "-m", "triptych_operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        yield runner
    assert runner.exception is None, runner.output


def pipeline_manifest(name: str, **changes: Any) -> dict[str, Any]:
    """The FLUX example made runnable here: a (fake) model directory on the node instead of the hub."""
    cr = example("flux-t2i.yaml")
    cr["metadata"] = {"name": name}
    cr["spec"]["model"] = {"path": "tiny-flux", "volume": {"hostPath": {"path": "/var/lib/triptych/models"}}}
    cr["spec"].update(changes)
    return cr


def without_combined_encoder(name: str, **changes: Any) -> dict[str, Any]:
    """pipeline_manifest with its pools in `changes` (promptEncoder and imageEncoder), and no `encoder`."""
    cr = pipeline_manifest(name, **changes)
    del cr["spec"]["encoder"]
    return cr


def apply(cluster: KubeCluster, namespace: str, manifest: dict[str, Any]) -> None:
    cluster.apply(json.dumps(manifest), namespace=namespace)


def get(cluster: KubeCluster, namespace: str, *what: str) -> dict[str, Any] | None:
    proc = cluster.kubectl("get", "-n", namespace, *what, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def condition(cr: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for cond in ((cr or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return cond
    return {}


def wait_phase(cluster: KubeCluster, namespace: str, name: str, phase: str, timeout: float = 90) -> dict[str, Any]:
    def current() -> dict[str, Any] | None:
        cr = get(cluster, namespace, "dp", name)
        return cr if cr and (cr.get("status") or {}).get("phase") == phase else None

    return poll(current, timeout=timeout, what=f"DiffusionPipeline {name} to be {phase}")


def children(cluster: KubeCluster, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    """kind/name -> object for everything labelled as this pipeline's."""
    kinds = "deployments,services,hpa,ingresses,poddisruptionbudgets,configmaps"
    listing = get(cluster, namespace, kinds, "-l", f"app.kubernetes.io/instance={name}")
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in (listing or {}).get("items", [])}


def container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


def test_pipeline_becomes_ready_on_gpu_nodes_and_kubectl_shows_it(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    ns = kube_namespace
    apply(crd, ns, pipeline_manifest("flux"))
    cr = wait_phase(crd, ns, "flux", "Ready")
    assert condition(cr, "Ready")["status"] == "True"
    assert cr["status"]["observedGeneration"] == cr["metadata"]["generation"]

    objs = children(crd, ns, "flux")
    for component in COMPONENTS:
        assert f"Deployment/flux-{component}" in objs
    assert {"Service/flux-encoder", "Service/flux-denoiser", "Service/flux-decoder", "Service/flux-head"} <= set(objs)
    assert objs["Service/flux-denoiser"]["spec"]["clusterIP"] == "None"
    head_args = container(objs["Deployment/flux-head"])["args"]
    assert f"dns://flux-denoiser.{ns}.svc.cluster.local:19000" in head_args

    pods = get(crd, ns, "pods", "-l", "app.kubernetes.io/instance=flux")
    assert pods is not None
    workers = [p for p in pods["items"] if p["metadata"]["labels"]["app.kubernetes.io/component"] != "head"]
    assert len(workers) == 4  # 1 encoder + 2 denoisers + 1 decoder
    for pod in workers:
        assert pod["spec"]["nodeName"] in GPU_NODES, pod["metadata"]["name"]
        assert pod["status"]["phase"] == "Running"

    table = crd.kubectl("get", "dp", "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "ENCODER", "DENOISER", "DECODER", "AGE"]
    assert table[1].split()[:5] == ["flux", "Ready", "1/1", "2/2", "1/1"]
    assert crd.kubectl("get", "dpipe", "-n", ns, "-o", "name").stdout.strip() == "diffusionpipeline.triptych.ai/flux"


def test_a_four_pool_pipeline_runs_split_encoders_behind_the_head(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    """promptEncoder + imageEncoder instead of encoder: five Deployments, the head lists both encoder Services."""
    ns = kube_namespace
    cr = without_combined_encoder("kontext", promptEncoder={"replicas": 2}, imageEncoder={"gpusPerReplica": 0})
    apply(crd, ns, cr)
    ready = wait_phase(crd, ns, "kontext", "Ready")
    assert ready["status"]["promptEncoder"]["ready"] == "2/2" and ready["status"]["imageEncoder"]["ready"] == "1/1"
    assert condition(ready, "PromptEncoderReady")["status"] == "True"
    objs = children(crd, ns, "kontext")
    deployments = sorted(k for k in objs if k.startswith("Deployment/"))
    assert deployments == [
        f"Deployment/kontext-{c}" for c in ("decoder", "denoiser", "head", "image-encoder", "prompt-encoder")
    ]
    for role, flag in (("prompt-encoder", "prompt_encoder"), ("image-encoder", "image_encoder")):
        args = container(objs[f"Deployment/kontext-{role}"])["args"]
        assert args[args.index("--disagg-role") + 1] == flag
        assert objs[f"Service/kontext-{role}"]["spec"]["clusterIP"] == "None"
    assert "--device" in container(objs["Deployment/kontext-image-encoder"])["args"]
    head = container(objs["Deployment/kontext-head"])["args"]
    assert head[head.index("--prompt-encoder-urls") + 1] == f"dns://kontext-prompt-encoder.{ns}.svc.cluster.local:19000"
    assert head[head.index("--image-encoder-urls") + 1] == f"dns://kontext-image-encoder.{ns}.svc.cluster.local:19000"
    assert "--encoder-urls" not in head
    wide = crd.kubectl("get", "dp", "-n", ns, "-o", "wide").stdout.splitlines()
    assert "PROMPTENCODER" in wide[0].split() and "IMAGEENCODER" in wide[0].split()


def test_api_server_rejects_both_encoder_shapes(crd: KubeCluster, kube_namespace: str) -> None:
    with pytest.raises(CommandError) as info:
        apply(crd, kube_namespace, pipeline_manifest("both", promptEncoder={"replicas": 1}))
    assert "declare encoder (three roles) or promptEncoder and imageEncoder" in info.value.stderr
    cr = without_combined_encoder("image-only", imageEncoder={"replicas": 1})
    with pytest.raises(CommandError) as info:
        apply(crd, kube_namespace, cr)
    assert "spec.imageEncoder needs spec.promptEncoder" in info.value.stderr


def test_rdma_pipeline_pins_gpus_and_rdma_devices(crd: KubeCluster, kube_namespace: str, operator: KopfRunner) -> None:
    """Each node has one rdma/ib device: two RDMA workers fit, the third waits and the status says so."""
    ns = kube_namespace
    manifest = pipeline_manifest(
        "wan",
        transfer={"mode": "rdma", "ibDevice": "mlx5_0", "poolSize": "512MiB"},
        encoder={"replicas": 1},
        denoiser={"replicas": 1, "gpusPerReplica": 4, "parallelism": {"sp": 4, "ulysses": 2, "ring": 2}},
        decoder={"replicas": 1},
    )
    apply(crd, ns, manifest)
    deployments = poll(
        lambda: (lambda o: o if sum(k.startswith("Deployment/") for k in o) == 4 else None)(children(crd, ns, "wan")),
        what="the four Deployments",
    )
    denoiser = container(deployments["Deployment/wan-denoiser"])
    assert denoiser["resources"]["limits"] == {"nvidia.com/gpu": "4", "rdma/ib": "1"}
    assert denoiser["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    args = denoiser["args"]
    for flag, value in [("--disagg-ib-device", "mlx5_0"), ("--num-gpus", "4"), ("--denoiser-ulysses", "2")]:
        assert args[args.index(flag) + 1] == value
    assert args[args.index("--disagg-p2p-hostname") + 1] == "$(POD_IP)"

    def placement() -> tuple[list[str], list[dict[str, Any]]] | None:
        pods = (get(crd, ns, "pods", "-l", "app.kubernetes.io/instance=wan") or {}).get("items", [])
        workers = [p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/component"] != "head"]
        running = [p["spec"]["nodeName"] for p in workers if p["status"].get("phase") == "Running"]
        pending = [p for p in workers if p["status"].get("phase") == "Pending" and not p["spec"].get("nodeName")]
        return (running, pending) if len(running) == 2 and len(pending) == 1 else None

    running, pending = poll(placement, what="two RDMA workers running and one pending")
    assert sorted(running) == sorted(GPU_NODES)  # one RDMA device per node: one worker per node
    unschedulable = condition(pending[0], "PodScheduled")
    assert "rdma/ib" in unschedulable.get("message", ""), unschedulable

    cr = wait_phase(crd, ns, "wan", "Degraded")
    assert condition(cr, "Ready")["status"] == "False"
    degraded = condition(cr, "Degraded")
    assert degraded["reason"] == "Unschedulable"
    assert f"pod {pending[0]['metadata']['name']} cannot be scheduled" in degraded["message"]
    assert "rdma/ib" in degraded["message"]


def test_head_drains_before_its_successor_starts_and_keeps_results_on_the_claim(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    ns = kube_namespace
    results = {"persistentVolumeClaim": {"claimName": "drain-results"}, "maxBytes": "1GiB"}
    # One head on a claim that may be ReadWriteOnce: drained before its successor starts (Recreate).
    apply(crd, ns, pipeline_manifest("drain", head={"replicas": 1, "drainSeconds": 90, "results": results}))
    objs = poll(
        lambda: (o := children(crd, ns, "drain")) and "Deployment/drain-head" in o and o,
        timeout=60,
        what="the head Deployment",
    )
    head = objs["Deployment/drain-head"]
    pod = head["spec"]["template"]["spec"]
    assert head["spec"]["strategy"]["type"] == "Recreate"
    assert pod["terminationGracePeriodSeconds"] == 90
    assert float(container(head)["args"][container(head)["args"].index("--disagg-drain-timeout") + 1]) < 90 - 15
    assert container(head)["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container(head)["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {"name": "outputs", "persistentVolumeClaim": {"claimName": "drain-results"}} in pod["volumes"]
    assert objs["Service/drain-head"]["spec"]["publishNotReadyAddresses"] is True


def test_replicated_heads_get_a_budget_a_headless_service_and_lose_the_budget_at_one(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    ns = kube_namespace
    secret = {"AWS_ACCESS_KEY_ID": "ha-key", "AWS_SECRET_ACCESS_KEY": "ha-secret"}
    crd.kubectl(
        "create", "secret", "generic", "ha-s3", "-n", ns, *(f"--from-literal={k}={v}" for k, v in secret.items())
    )
    s3 = {
        "url": "s3://triptych-results/ha",
        "endpoint": "http://seaweedfs:8333",
        "credentialsSecret": {"name": "ha-s3"},
    }
    apply(crd, ns, pipeline_manifest("ha", head={"replicas": 2, "results": {"s3": s3}}))
    wanted = {"Deployment/ha-head", "PodDisruptionBudget/ha-head", "Service/ha-heads", "Service/ha-head"}
    objs = poll(
        lambda: (o := children(crd, ns, "ha")) and wanted <= set(o) and o, timeout=60, what="the heads' objects"
    )
    head = objs["Deployment/ha-head"]
    assert head["spec"]["replicas"] == 2
    assert head["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    env = {e["name"]: e.get("value") for e in container(head)["env"]}
    assert env["AWS_SECRET_ACCESS_KEY_FILE"] == "/etc/triptych/s3/secret-access-key"
    [volume] = [v for v in head["spec"]["template"]["spec"]["volumes"] if v["name"] == "s3-credentials"]
    assert volume["secret"]["secretName"] == "ha-s3"
    assert "ha-secret" not in json.dumps(head)  # a file of the Secret, never a value in the Deployment
    args = container(head)["args"]
    assert args[args.index("--results-store") + 1] == "s3://triptych-results/ha"
    pdb = objs["PodDisruptionBudget/ha-head"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == head["spec"]["selector"]
    heads = objs["Service/ha-heads"]["spec"]
    assert heads["clusterIP"] == "None" and heads["publishNotReadyAddresses"] is True
    worker_args = container(objs["Deployment/ha-denoiser"])["args"]
    assert worker_args[worker_args.index("--disagg-server-addr") + 1] == f"dns://ha-heads.{ns}.svc.cluster.local:5555"
    wait_phase(crd, ns, "ha", "Ready")
    # The API server computes the budget over both heads (kwok runs them): one may go at a time.
    poll(
        lambda: (get(crd, ns, "pdb", "ha-head") or {}).get("status", {}).get("disruptionsAllowed") == 1,
        timeout=60,
        what="the heads' budget to allow one disruption",
    )

    crd.kubectl("patch", "dp", "ha", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"head": {"replicas": 1}}}))
    poll(
        lambda: "PodDisruptionBudget/ha-head" not in children(crd, ns, "ha"),
        timeout=60,
        what="the budget to be removed at one head",
    )
    after = children(crd, ns, "ha")
    assert after["Deployment/ha-head"]["spec"]["replicas"] == 1
    assert "Service/ha-heads" in after  # the workers keep finding their one head there
    # Only the head changed: the workers were not rolled.
    for role in ("encoder", "denoiser", "decoder"):
        key = f"Deployment/ha-{role}"
        assert after[key]["metadata"]["generation"] == objs[key]["metadata"]["generation"], key
    wait_phase(crd, ns, "ha", "Ready")


def test_editing_one_role_rolls_only_that_role(crd: KubeCluster, kube_namespace: str, operator: KopfRunner) -> None:
    ns = kube_namespace
    apply(crd, ns, pipeline_manifest("edit"))
    wait_phase(crd, ns, "edit", "Ready")
    before = {k: v["metadata"] for k, v in children(crd, ns, "edit").items()}

    patch = {"spec": {"denoiser": {"replicas": 3, "image": "registry.example/triptych-worker:canary"}}}
    crd.kubectl("patch", "dp", "edit", "-n", ns, "--type=merge", "-p", json.dumps(patch))

    def rolled() -> dict[str, Any] | None:
        dep = get(crd, ns, "deployment", "edit-denoiser")
        ok = dep and dep["spec"]["replicas"] == 3 and container(dep)["image"].endswith(":canary")
        return dep if ok else None

    poll(rolled, what="the denoiser Deployment to take the edit")
    wait_phase(crd, ns, "edit", "Ready")
    after = {k: v["metadata"] for k, v in children(crd, ns, "edit").items()}
    assert after["Deployment/edit-denoiser"]["generation"] > before["Deployment/edit-denoiser"]["generation"]
    for key, meta in before.items():
        if key != "Deployment/edit-denoiser":
            assert after[key]["resourceVersion"] == meta["resourceVersion"], f"{key} was rewritten"
            assert after[key].get("generation") == meta.get("generation"), f"{key} rolled"


def test_children_deleted_or_edited_by_hand_are_restored(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    ns = kube_namespace
    apply(crd, ns, pipeline_manifest("drift"))
    wait_phase(crd, ns, "drift", "Ready")
    old = children(crd, ns, "drift")

    crd.kubectl("delete", "deployment/drift-encoder", "service/drift-decoder", "-n", ns, "--wait=false")
    crd.kubectl("scale", "deployment", "drift-denoiser", "-n", ns, "--replicas=5")

    def restored() -> bool:
        now = children(crd, ns, "drift")
        return (
            all(k in now for k in ("Deployment/drift-encoder", "Service/drift-decoder"))
            and now["Deployment/drift-encoder"]["metadata"]["uid"] != old["Deployment/drift-encoder"]["metadata"]["uid"]
            and now["Deployment/drift-denoiser"]["spec"]["replicas"] == 2
        )

    poll(restored, timeout=60, what="the deleted and scaled children to be restored")
    wait_phase(crd, ns, "drift", "Ready")
    events = crd.kubectl("get", "events", "-n", ns, "--field-selector", "involvedObject.name=drift").stdout
    assert "Restored" in events


def test_optional_children_follow_the_spec(crd: KubeCluster, kube_namespace: str, operator: KopfRunner) -> None:
    ns = kube_namespace
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetWorkSecondsPerReplica": 30}
    issuer = {"cert-manager.io/cluster-issuer": "letsencrypt"}
    ingress = {"enabled": True, "host": "opt.example.com", "className": "nginx", "annotations": issuer}
    apply(crd, ns, pipeline_manifest("opt", denoiser={"autoscaling": auto}, head={"ingress": ingress}))
    objs = poll(
        lambda: (lambda o: o if {"HorizontalPodAutoscaler/opt-denoiser", "Ingress/opt-api"} <= set(o) else None)(
            children(crd, ns, "opt")
        ),
        what="the HPA and the Ingress",
    )
    assert objs["HorizontalPodAutoscaler/opt-denoiser"]["spec"]["maxReplicas"] == 3
    assert objs["Ingress/opt-api"]["spec"]["rules"][0]["host"] == "opt.example.com"
    annotations = objs["Ingress/opt-api"]["metadata"]["annotations"]
    assert annotations["cert-manager.io/cluster-issuer"] == "letsencrypt"
    assert annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "660"

    # Fields the spec no longer sets leave the live object (they stayed for good before).
    fewer = {"spec": {"head": {"ingress": {"className": None, "annotations": None}}}}
    crd.kubectl("patch", "dp", "opt", "-n", ns, "--type=merge", "-p", json.dumps(fewer))

    def without_them() -> bool:
        ingress = children(crd, ns, "opt")["Ingress/opt-api"]
        return "ingressClassName" not in ingress["spec"] and "cert-manager.io/cluster-issuer" not in (
            ingress["metadata"].get("annotations") or {}
        )

    poll(without_them, what="the Ingress to lose its class and the issuer annotation")

    off = {"spec": {"denoiser": {"autoscaling": {"enabled": False}}, "head": {"ingress": {"enabled": False}}}}
    crd.kubectl("patch", "dp", "opt", "-n", ns, "--type=merge", "-p", json.dumps(off))
    poll(
        lambda: not {"HorizontalPodAutoscaler/opt-denoiser", "Ingress/opt-api"} & set(children(crd, ns, "opt")),
        what="the HPA and the Ingress to be removed",
    )


def test_turning_on_autoscaling_keeps_the_replicas_that_run(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    """The operator stops setting replicas and the HPA takes over from the pods that run: server-side
    apply must not reset them to 1 on the way (they were the operator's field alone)."""
    ns = kube_namespace
    apply(crd, ns, pipeline_manifest("grow"))  # two denoisers
    wait_phase(crd, ns, "grow", "Ready")
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 4}
    patch = {"spec": {"denoiser": {"autoscaling": auto}}}
    crd.kubectl("patch", "dp", "grow", "-n", ns, "--type=merge", "-p", json.dumps(patch))
    # The HPA is applied after the Deployment in the same reconcile; without a metric it scales nothing.
    objs = poll(
        lambda: (lambda o: o if "HorizontalPodAutoscaler/grow-denoiser" in o else None)(children(crd, ns, "grow")),
        what="the denoiser's HPA",
    )
    assert objs["Deployment/grow-denoiser"]["spec"]["replicas"] == 2


def test_lora_adapters_become_a_catalogue_configmap_that_an_edit_changes_and_emptying_removes(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    ns = kube_namespace
    model = {"path": "tiny-flux", "volume": {"hostPath": {"path": "/var/lib/triptych/models"}}}
    apply(crd, ns, pipeline_manifest("lora", model={**model, "loras": ["ink=/models/loras/ink"]}))
    catalogue = poll(lambda: children(crd, ns, "lora").get("ConfigMap/lora-loras"), what="the catalogue ConfigMap")
    assert list(catalogue["data"].values()) == ["ink=/models/loras/ink\n"], catalogue["data"]
    denoiser = poll(lambda: children(crd, ns, "lora").get("Deployment/lora-denoiser"), what="the denoiser")
    generation = denoiser["metadata"]["generation"]
    apply(crd, ns, pipeline_manifest("lora", model={**model, "loras": ["ink=/models/loras/ink", "paper=/m/p"]}))
    poll(
        lambda: (
            "paper=/m/p" in "".join(children(crd, ns, "lora").get("ConfigMap/lora-loras", {}).get("data", {}).values())
        ),
        what="the added adapter in the catalogue",
    )
    # An added adapter reaches the pods through the mounted file: their template is unchanged.
    assert children(crd, ns, "lora")["Deployment/lora-denoiser"]["metadata"]["generation"] == generation
    apply(crd, ns, pipeline_manifest("lora", model=model))
    poll(lambda: "ConfigMap/lora-loras" not in children(crd, ns, "lora"), what="the catalogue to be removed")


def test_deleting_the_pipeline_removes_everything(crd: KubeCluster, kube_namespace: str, operator: KopfRunner) -> None:
    ns = kube_namespace
    apply(crd, ns, pipeline_manifest("gone"))
    poll(lambda: len(children(crd, ns, "gone")) >= 9, what="the children")
    crd.kubectl("delete", "dp", "gone", "-n", ns, "--timeout=60s", timeout=70)
    poll(lambda: not children(crd, ns, "gone"), timeout=90, what="garbage collection of the children")
    pods = get(crd, ns, "pods", "-l", "app.kubernetes.io/instance=gone") or {}
    poll(
        lambda: not (get(crd, ns, "pods", "-l", "app.kubernetes.io/instance=gone") or {}).get("items"),
        timeout=90,
        what=f"the pods to go (had {len(pods.get('items', []))})",
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decoder": {"replicas": -1}}, "spec.decoder.replicas"),
        ({"head": {"dispatchPolicy": "random"}}, 'Unsupported value: "random"'),
        ({"denoiser": {"gpusPerReplica": 4, "parallelism": {"tp": 2, "sp": 4}}}, "must equal gpusPerReplica"),
        ({"encoder": {"parallelism": {"ulysses": 1}}}, "apply to the denoiser only"),
        ({"denoiser": {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}}, "minReplicas must be"),
        ({"transfer": {"mode": "rdma"}}, "ibDevice is required with mode rdma"),
        ({"transfer": {"poolSize": "lots"}}, "poolSize is a byte count"),
        ({"denoiser": {"gpusPerReplica": 0, "parallelism": {"tp": 2}}}, "gpusPerReplica 0 runs the role on CPU"),
        ({"decoder": {"gpusPerReplica": -1}}, "spec.decoder.gpusPerReplica"),
        ({"encoder": {"gpusPerReplica": 2}}, "an encoder runs on one device"),
        ({"decoder": {"gpusPerReplica": 2, "parallelism": {"tp": 2}}}, "the decoder splits its work by sp only"),
        ({"denoiser": {"gpusPerReplica": 4, "parallelism": {"cfg": 4}}}, "at most 2 guidance branches"),
        ({"transfer": {"poolSize": "0"}}, "poolSize is a byte count"),
        ({"transfer": {"mode": "rdma", "ibDevice": ""}}, "spec.transfer.ibDevice"),
        ({"model": {"hubId": "not a hub id!!"}}, "spec.model.hubId"),
        ({"head": {"drainSeconds": 10**6}}, "spec.head.drainSeconds"),
        ({"denoiser": {"resources": {"limits": {"cpu": "lots"}}}}, "spec.denoiser.resources.limits.cpu"),
        ({"head": {"resources": {"requests": {"memory": -1}}}}, "spec.head.resources.requests.memory"),
        ({"model": {"path": "m", "volume": {"hostPath": {"path": "/"}}}}, "path must be an absolute folder other"),
        ({"model": {"path": "m", "volume": {"hostPath": {"path": "/srv/../etc"}}}}, "path must be an absolute folder"),
        ({"head": {"ingress": {"paths": [{"path": "v1"}]}}}, "path must start with '/'"),
        ({"head": {"ingress": {"paths": [{"path": "/v1"}, {"path": "/v1"}]}}}, "spec.head.ingress.paths[1]: Duplicate"),
    ],
    ids=[
        "negative-replicas",
        "unknown-policy",
        "degrees-vs-gpus",
        "encoder-ulysses",
        "min-over-max",
        "rdma-no-device",
        "bad-pool",
        "cpu-role-with-tp",
        "negative-gpus",
        "encoder-gpus",
        "decoder-tp",
        "cfg-above-2",
        "zero-pool",
        "empty-ib-device",
        "bad-hub-id",
        "endless-drain",
        "bad-quantity",
        "negative-quantity",
        "host-root",
        "host-dot-dot",
        "relative-ingress-path",
        "duplicate-ingress-path",
    ],
)
def test_api_server_rejects_invalid_pipelines(
    crd: KubeCluster, kube_namespace: str, change: dict[str, Any], message: str
) -> None:
    with pytest.raises(CommandError) as info:
        apply(crd, kube_namespace, pipeline_manifest("bad", **change))
    assert message in info.value.stderr


def test_api_server_accepts_cpu_roles(crd: KubeCluster, kube_namespace: str) -> None:
    cpu = {"gpusPerReplica": 0, "parallelism": {"sp": 1}}
    apply(crd, kube_namespace, pipeline_manifest("cpu", encoder={"gpusPerReplica": 0}, denoiser=cpu))
    stored = get(crd, kube_namespace, "diffusionpipeline", "cpu")
    assert stored is not None
    assert stored["spec"]["encoder"]["gpusPerReplica"] == 0 and stored["spec"]["decoder"]["gpusPerReplica"] == 1


def test_api_server_accepts_kubernetes_sizes_and_hub_ids(crd: KubeCluster, kube_namespace: str) -> None:
    model = {"hubId": "black-forest-labs/FLUX.1-dev"}
    quantities = {"requests": {"cpu": "500m", "memory": "1.5Gi", "ephemeral-storage": "1e9"}, "limits": {"cpu": 2}}
    head = {"results": {"maxBytes": "1Gi"}, "resources": quantities}
    apply(crd, kube_namespace, pipeline_manifest("sizes", model=model, transfer={"poolSize": "256Mi"}, head=head))
    stored = get(crd, kube_namespace, "diffusionpipeline", "sizes")
    assert stored is not None and stored["spec"]["transfer"]["poolSize"] == "256Mi"
    assert stored["spec"]["head"]["resources"] == quantities


def test_api_server_rejects_names_too_long_for_service_names(crd: KubeCluster, kube_namespace: str) -> None:
    with pytest.raises(CommandError) as info:
        apply(crd, kube_namespace, pipeline_manifest("a" * 55))
    assert "metadata.name: Too long" in info.value.stderr
    assert "54" in info.value.stderr


def test_degrees_the_schema_cannot_check_mark_the_pipeline_degraded(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    ns = kube_namespace
    bad = {"replicas": 1, "gpusPerReplica": 4, "parallelism": {"sp": 4, "ulysses": 2, "ring": 1}}
    apply(crd, ns, pipeline_manifest("odd", denoiser=bad))
    cr = wait_phase(crd, ns, "odd", "Invalid")
    degraded = condition(cr, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert degraded["message"].startswith("spec.denoiser.parallelism: ulysses=2 x ring=1 must equal sp=4")
    assert not children(crd, ns, "odd"), "nothing is created for an invalid pipeline"

    crd.kubectl(
        "patch", "dp", "odd", "-n", ns, "--type=merge", "-p", '{"spec":{"denoiser":{"parallelism":{"ring":2}}}}'
    )
    cr = wait_phase(crd, ns, "odd", "Ready")
    assert condition(cr, "Degraded")["status"] == "False"


def test_an_invalid_edit_leaves_the_running_pipeline_untouched(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    ns = kube_namespace
    apply(crd, ns, pipeline_manifest("keep"))
    wait_phase(crd, ns, "keep", "Ready")
    before = {k: v["metadata"]["resourceVersion"] for k, v in children(crd, ns, "keep").items()}

    bad = {"spec": {"denoiser": {"gpusPerReplica": 2, "parallelism": {"sp": 2, "ulysses": 2, "ring": 2}}}}
    crd.kubectl("patch", "dp", "keep", "-n", ns, "--type=merge", "-p", json.dumps(bad))
    cr = wait_phase(crd, ns, "keep", "Invalid")
    assert condition(cr, "Degraded")["message"].startswith(
        "spec.denoiser.parallelism: ulysses=2 x ring=2 must equal sp=2"
    )
    assert condition(cr, "Ready")["status"] == "True"  # the last valid objects still serve
    after = {k: v["metadata"]["resourceVersion"] for k, v in children(crd, ns, "keep").items()}
    assert after == before


def test_an_object_in_the_way_is_reported_not_taken_over(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    ns = kube_namespace
    crd.kubectl("create", "service", "clusterip", "clash-api", "--tcp=80:80", "-n", ns)
    apply(crd, ns, pipeline_manifest("clash"))
    cr = wait_phase(crd, ns, "clash", "Degraded")
    degraded = condition(cr, "Degraded")
    assert degraded["reason"] == "ApplyFailed"
    assert "Service clash-api already exists and is not managed by triptych-operator" in degraded["message"]
    theirs = get(crd, ns, "service", "clash-api")
    assert theirs is not None and "ownerReferences" not in theirs["metadata"]

    crd.kubectl("delete", "service", "clash-api", "-n", ns)
    wait_phase(crd, ns, "clash", "Ready", timeout=120)  # the handler retries
    ours = get(crd, ns, "service", "clash-api")
    assert ours is not None and ours["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "triptych-operator"


def test_a_pipeline_whose_object_name_another_pipeline_has_is_reported_not_fought_over(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    """svc's split prompt encoder and svc-prompt's combined encoder are both Deployment svc-prompt-encoder."""
    ns = kube_namespace
    split = without_combined_encoder("svc", promptEncoder={"gpusPerReplica": 0}, imageEncoder={"gpusPerReplica": 0})
    apply(crd, ns, split)
    wait_phase(crd, ns, "svc", "Ready")
    apply(crd, ns, pipeline_manifest("svc-prompt"))
    degraded = condition(wait_phase(crd, ns, "svc-prompt", "Degraded"), "Degraded")
    assert degraded["reason"] == "ApplyFailed"
    assert (
        "svc-prompt-encoder already belongs to DiffusionPipeline svc: metadata.name 'svc-prompt'" in degraded["message"]
    )
    theirs = get(crd, ns, "deployment", "svc-prompt-encoder")
    assert theirs is not None and theirs["metadata"]["labels"]["app.kubernetes.io/instance"] == "svc"
    assert [ref["name"] for ref in theirs["metadata"]["ownerReferences"]] == ["svc"]


def test_helm_install_reconciles_the_example_and_uninstall_cleans_up(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    """The chart's operator pod is a kwok pod (nothing runs in it); the in-process operator does the work."""
    ns = kube_namespace
    release = f"r{ns[-6:]}"
    crd.helm(
        "install", release, str(CHART), "--namespace", ns, "--wait", "--timeout", "90s",
        "--set", f"watchNamespaces={{{ns}}}", "--set", "examplePipeline.enabled=true",
        timeout=120,
    )  # fmt: skip
    operator_deploy = get(crd, ns, "deployment", f"{release}-triptych")
    assert operator_deploy is not None
    assert container(operator_deploy)["command"] == ["triptych-operator"]
    assert get(crd, ns, "role", f"{release}-triptych") is not None

    cr = wait_phase(crd, ns, "example", "Ready")
    assert cr["status"]["head"]["ready"] == "1/1"

    crd.helm("uninstall", release, "--namespace", ns, "--wait", "--timeout", "90s", timeout=120)
    poll(lambda: get(crd, ns, "dp", "example") is None, what="the example pipeline to be deleted")
    poll(lambda: not children(crd, ns, "example"), timeout=90, what="the example's children to be collected")
    assert get(crd, ns, "deployment", f"{release}-triptych") is None
    assert crd.kubectl("get", "clusterrole", f"{release}-triptych-discovery", check=False).returncode != 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def service_account_kubeconfig(cluster: KubeCluster, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig that acts as `account`: the admin's server and CA with the account's token."""
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": admin["clusters"][0]["name"], "user": account}}],
        "current-context": account,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_charts_rbac_is_all_the_operator_needs(crd: KubeCluster, kube_namespace: str, tmp_path: Path) -> None:
    """`triptych-operator`, run as the chart's ServiceAccount, reconciles, restores and reports liveness."""
    ns = kube_namespace
    release = f"r{ns[-6:]}"
    # Without the metrics API: its APIServices are cluster-wide, and kwok pods could not serve them
    # (test_autoscaling_cluster.py runs that server).
    flags = ["--set", f"watchNamespaces={{{ns}}}", "--set", "metricsApi.enabled=false"]
    crd.helm("install", release, str(CHART), "--namespace", ns, *flags, timeout=120)
    proc: subprocess.Popen[bytes] | None = None
    log = (tmp_path / "operator.log").open("w+")
    try:
        kubeconfig = service_account_kubeconfig(crd, ns, f"{release}-triptych", tmp_path / "operator.kubeconfig")
        port = free_port()
        env = {**crd.env, "KUBECONFIG": str(kubeconfig)}
        command = [*operator_command(ns, port), "--log-format", "json"]
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        poll(lambda: _healthz(port), timeout=60, what="the operator's liveness endpoint")
        # Its denoiser scales to zero: the operator asks for its metric (none here) too.
        sleepy = {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2}}
        apply(crd, ns, pipeline_manifest("rbac", denoiser=sleepy))
        wait_phase(crd, ns, "rbac", "Ready")
        poll(lambda: "no triptych_pending_work_seconds" in log_text(log), what="the scale-to-zero pass to ask for it")
        crd.kubectl("delete", "deployment/rbac-decoder", "-n", ns, "--wait=false")
        poll(lambda: "Deployment/rbac-decoder" in children(crd, ns, "rbac"), what="the decoder to be restored")
        wait_phase(crd, ns, "rbac", "Ready")
        # The other encoder shape: the combined encoder's Deployment and Service are deleted.
        split = without_combined_encoder("rbac", denoiser=sleepy, promptEncoder={}, imageEncoder={"gpusPerReplica": 0})
        apply(crd, ns, split)
        encoder = {"Deployment/rbac-encoder", "Service/rbac-encoder"}
        poll(lambda: not encoder & set(children(crd, ns, "rbac")), what="the combined encoder's pool to be deleted")
        wait_phase(crd, ns, "rbac", "Ready")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        crd.helm("uninstall", release, "--namespace", ns, timeout=120)
    log.seek(0)
    output = log.read()
    # kopf logs a refused request as APIForbiddenError('... is forbidden: User ...').
    assert "forbidden" not in output.lower(), output[-3000:]
    # --log-format json: every line is the pipeline's kind of object, kopf's about a resource naming it.
    lines = [json.loads(line) for line in output.splitlines()]
    assert all(line["process"] == "operator" and {"time", "level", "logger", "message"} <= set(line) for line in lines)
    assert any(line.get("object", {}).get("name") == "rbac" for line in lines), output[-3000:]


def log_text(log: Any) -> str:
    log.flush()
    return Path(log.name).read_text(errors="replace")


def operator_command(namespace: str, port: int) -> list[str]:
    """The operator as a local process watching `namespace`, its liveness endpoint on `port` (_healthz)."""
    return [
        str(REPO / ".venv" / "bin" / "triptych-operator"),
        "-n",
        namespace,
        "--liveness",
        f"http://127.0.0.1:{port}/healthz",
    ]


def _healthz(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as rsp:
            return bool(rsp.status == 200)
    except OSError:
        return False


def test_pipeline_gets_control_keys_network_policies_and_pods_that_mount_and_use_them(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    """The key Secret is created once (a reconcile never rewrites it), every pod mounts its part of it
    read-only and runs with --disagg-keys-dir, the NetworkPolicies select the pipeline's pods and
    ports; deleting the Secret gives new keys, which roll every pod."""
    ns = kube_namespace
    apply(crd, ns, pipeline_manifest("sec"))

    def ready() -> tuple[dict[str, Any], dict[str, dict[str, Any]]] | None:
        secret = get(crd, ns, "secret", "sec-control-keys")
        objs = children(crd, ns, "sec")
        policies = get(crd, ns, "networkpolicies", "-l", "app.kubernetes.io/instance=sec") or {}
        objs.update({f"NetworkPolicy/{p['metadata']['name']}": p for p in policies.get("items", [])})
        wanted = [f"Deployment/sec-{c}" for c in COMPONENTS] + ["NetworkPolicy/sec-workers", "NetworkPolicy/sec-head"]
        return (secret, objs) if secret and all(w in objs for w in wanted) else None

    secret, objs = poll(ready, what="the key Secret, the NetworkPolicies and the Deployments")
    assert sorted(secret["data"]) == ["head.key", "head.key_secret", "worker.key", "worker.key_secret"]
    assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "triptych-operator"
    assert [r["kind"] for r in secret["metadata"]["ownerReferences"]] == ["DiffusionPipeline"]
    fingerprint = public_fingerprint({k: base64.b64decode(v).decode() for k, v in secret["data"].items()})

    for component in COMPONENTS:
        deployment = objs[f"Deployment/sec-{component}"]
        template = deployment["spec"]["template"]
        assert template["metadata"]["annotations"]["triptych.ai/control-keys"] == fingerprint
        [volume] = [v for v in template["spec"]["volumes"] if v.get("secret")]
        side = "head" if component == "head" else "worker"
        other = "worker" if side == "head" else "head"
        assert volume["secret"]["secretName"] == "sec-control-keys"
        assert [i["key"] for i in volume["secret"]["items"]] == [f"{side}.key", f"{side}.key_secret", f"{other}.key"]
        [mount] = [m for m in container(deployment)["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] is True
        args = container(deployment)["args"]
        assert args[args.index("--disagg-keys-dir") + 1] == mount["mountPath"]
        assert "--disagg-insecure" not in args

    workers = objs["NetworkPolicy/sec-workers"]["spec"]
    head = objs["NetworkPolicy/sec-head"]["spec"]
    head_selector = {
        "app.kubernetes.io/name": "triptych",
        "app.kubernetes.io/instance": "sec",
        "app.kubernetes.io/component": "head",
        "app.kubernetes.io/managed-by": "triptych-operator",
    }
    assert head["podSelector"] == {"matchLabels": head_selector}
    assert workers["podSelector"]["matchExpressions"][0]["values"] == ["encoder", "denoiser", "decoder"]
    work, mooncake = workers["ingress"]
    assert work["from"] == [{"podSelector": {"matchLabels": head_selector}}]
    assert work["ports"] == [{"protocol": "TCP", "port": 19000}]
    assert mooncake["from"] == [{"podSelector": workers["podSelector"]}]
    assert mooncake["ports"] == [{"protocol": "TCP", "port": 15000, "endPort": 17000}]
    results, http = head["ingress"]
    assert results["from"] == [{"podSelector": workers["podSelector"]}]
    assert sorted(p["port"] for p in results["ports"]) == [5556, 5557, 5558]
    assert http == {"ports": [{"protocol": "TCP", "port": 30000}]}
    # Each selector matches exactly the pipeline's pods of that kind (kwok runs them, once the
    # Deployment and ReplicaSet controllers have created them all).
    expected = ["decoder", "denoiser", "denoiser", "encoder", "head"]

    def components() -> list[str]:
        pods = (get(crd, ns, "pods", "-l", "app.kubernetes.io/instance=sec") or {}).get("items", [])
        return sorted(p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods)

    poll(lambda: components() == expected or None, what=f"the pipeline's pods {expected}")

    # A reconcile (here: an edit of the pipeline) leaves the keys alone.
    crd.kubectl("patch", "dp", "sec", "-n", ns, "--type=merge", "-p", '{"spec": {"decoder": {"replicas": 2}}}')
    poll(lambda: (children(crd, ns, "sec")["Deployment/sec-decoder"]["spec"].get("replicas") == 2) or None,
         what="the decoder to scale")  # fmt: skip
    assert get(crd, ns, "secret", "sec-control-keys")["data"] == secret["data"]  # type: ignore[index]

    # Rotation: delete the Secret and nudge the pipeline; new keys, and every pod template changes.
    crd.kubectl("delete", "secret", "sec-control-keys", "-n", ns)
    crd.kubectl("annotate", "dp", "sec", "-n", ns, "triptych.ai/rotate-keys=1", "--overwrite")

    def rotated() -> dict[str, Any] | None:
        new = get(crd, ns, "secret", "sec-control-keys")
        return new if new and new["data"] != secret["data"] else None

    new = poll(rotated, what="new keys")
    new_fingerprint = public_fingerprint({k: base64.b64decode(v).decode() for k, v in new["data"].items()})
    assert new_fingerprint != fingerprint

    def rolled() -> bool | None:
        objs = children(crd, ns, "sec")
        notes = [objs[f"Deployment/sec-{c}"]["spec"]["template"]["metadata"]["annotations"] for c in COMPONENTS]
        return all(n["triptych.ai/control-keys"] == new_fingerprint for n in notes) or None

    poll(rolled, what="every Deployment to carry the new keys' fingerprint")


def full_pipeline_manifest(name: str) -> dict[str, Any]:
    cr = pipeline_manifest(name, fullPipeline={"replicas": 2})
    for pool in ("encoder", "denoiser", "decoder"):
        del cr["spec"][pool]
    return cr


@pytest.mark.parametrize("pool", ["encoder", "denoiser", "decoder", "promptEncoder"])
def test_api_server_rejects_a_full_pipeline_pool_beside_a_role_pool(
    crd: KubeCluster, kube_namespace: str, pool: str
) -> None:
    cr = full_pipeline_manifest("both-shapes")
    cr["spec"][pool] = {"replicas": 1}
    with pytest.raises(CommandError) as info:
        apply(crd, kube_namespace, cr)
    assert "spec.fullPipeline: declare a full-pipeline pool or role pools" in info.value.stderr


def test_api_server_checks_a_full_pipeline_pool_s_degrees_against_its_gpus(
    crd: KubeCluster, kube_namespace: str
) -> None:
    cr = full_pipeline_manifest("two-gpus")
    cr["spec"]["fullPipeline"].update(gpusPerReplica=2, parallelism={"cfg": 4})
    with pytest.raises(CommandError) as info:
        apply(crd, kube_namespace, cr)
    assert "spec.fullPipeline: Invalid value" in info.value.stderr
    assert "parallelism: tp x sp x cfg must equal gpusPerReplica" in info.value.stderr
    cr["spec"]["fullPipeline"]["parallelism"] = {"cfg": 2}
    apply(crd, kube_namespace, cr)  # two GPUs a pod, denoising on both (CFG parallel)
    stored = crd.kubectl("get", "dp", "two-gpus", "-n", kube_namespace, "-o", "json").stdout
    assert json.loads(stored)["spec"]["fullPipeline"]["gpusPerReplica"] == 2


def test_a_full_pipeline_pipeline_becomes_one_worker_pool_behind_a_head_with_only_denoiser_urls(
    crd: KubeCluster, kube_namespace: str, operator: KopfRunner
) -> None:
    ns = kube_namespace
    apply(crd, ns, full_pipeline_manifest("whole"))
    ready = wait_phase(crd, ns, "whole", "Ready")
    assert ready["status"]["denoiser"]["ready"] == "2/2" and "encoder" not in ready["status"]
    objs = children(crd, ns, "whole")
    assert sorted(k for k in objs if k.startswith("Deployment/")) == [
        "Deployment/whole-denoiser",
        "Deployment/whole-head",
    ]
    assert "--disagg-full-pipeline" in container(objs["Deployment/whole-denoiser"])["args"]
    head = container(objs["Deployment/whole-head"])["args"]
    assert head[head.index("--denoiser-urls") + 1] == f"dns://whole-denoiser.{ns}.svc.cluster.local:19000"
    assert "--encoder-urls" not in head and "--decoder-urls" not in head
