"""spec -> manifests: what each child looks like, checked without a cluster."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from tests.operator.helpers import NAMESPACE, OWNER, example, minimal_spec, pipeline
from triptych.cli import build_parser
from triptych.config import HEAD_SHUTDOWN_OVERHEAD_S, ServeArgs
from triptych.ports import MOONCAKE_PORT_RANGE
from triptych.roles import Role
from triptych_operator.constants import GPU_RESOURCE, HEAD_HTTP_PORT, HEAD_SCHEDULER_PORT, OUTPUT_MOUNT, WORKER_PORT
from triptych_operator.manifests import Manifest, render
from triptych_operator.manifests.head import head_ingress
from triptych_operator.manifests.parts import SECRET_FILE_MODE
from triptych_operator.serve_args import head_argv
from triptych_operator.spec.model import SpecError

ROLES = (Role.ENCODER, Role.DENOISER, Role.DECODER)


def children(spec: dict[str, Any] | None = None) -> dict[tuple[str, str], Manifest]:
    return {(m["kind"], m["metadata"]["name"]): m for m in render(pipeline(spec), owner=OWNER).apply}


def container(deployment: Manifest) -> Manifest:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def parse_serve(container_: Manifest) -> ServeArgs:
    """Parse a container's command line exactly as the `triptych` console script does."""
    assert container_["command"] == ["triptych", "serve"]
    ns = build_parser().parse_args(["serve", *container_["args"]])
    return ServeArgs.from_namespace(ns)


def test_every_role_gets_a_deployment_and_a_headless_service_and_the_head_two_services() -> None:
    names = set(children())
    for role in ROLES:
        assert ("Deployment", f"wan-t2v-{role.value}") in names
        assert ("Service", f"wan-t2v-{role.value}") in names
    assert {("Deployment", "wan-t2v-head"), ("Service", "wan-t2v-head"), ("Service", "wan-t2v-api")} <= names
    assert children()[("Service", "wan-t2v-denoiser")]["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.value)
def test_worker_args_parse_and_validate_as_triptych_serve(role: Role) -> None:
    args = parse_serve(container(children()[("Deployment", f"wan-t2v-{role.value}")]))
    assert args.disagg_role is role
    # Every head, as the headless Service resolves: the workers serve them all.
    assert args.disagg_server_addr == f"dns://wan-t2v-heads.{NAMESPACE}.svc.cluster.local:{HEAD_SCHEDULER_PORT}"
    assert args.scheduler_port == WORKER_PORT
    assert args.disagg_p2p_hostname == "$(POD_IP)"
    assert args.disagg_ib_device == "mlx5_0"
    assert args.disagg_transfer_pool_size == 1 << 30
    assert args.model_path == "/models/Wan2.1-T2V-14B-Diffusers"


def test_denoiser_args_carry_its_parallelism_and_gpu_count() -> None:
    args = parse_serve(container(children()[("Deployment", "wan-t2v-denoiser")]))
    assert (args.num_gpus, args.denoiser_sp, args.denoiser_ulysses, args.denoiser_ring) == (4, 4, 2, 2)
    assert args.master_port is not None
    assert args.parallelism().sp == 4


def test_head_args_list_workers_by_dns_discovery() -> None:
    args = parse_serve(container(children()[("Deployment", "wan-t2v-head")]))
    assert args.disagg_role is Role.SERVER
    for role in ROLES:
        assert args.urls_for(role) == [f"dns://wan-t2v-{role.value}.{NAMESPACE}.svc.cluster.local:{WORKER_PORT}"]
    assert (args.disagg_dispatch_policy, args.disagg_timeout, args.host) == ("max_free_slots", 900.0, "0.0.0.0")


def test_head_priority_scheduling_comes_from_the_spec() -> None:
    default = parse_serve(container(children(minimal_spec())[("Deployment", "wan-t2v-head")]))
    assert (default.disagg_priority_aging, default.disagg_preemption) == (30.0, "on")
    spec = minimal_spec(head={"priority": {"agingSeconds": 12, "preemption": False}})
    args = parse_serve(container(children(spec)[("Deployment", "wan-t2v-head")]))
    assert (args.disagg_priority_aging, args.disagg_preemption) == (12.0, "off")
    with pytest.raises(SpecError, match=r"spec\.head\.priority\.agingSeconds"):
        children(minimal_spec(head={"priority": {"agingSeconds": 0}}))


def test_workers_are_pinned_to_gpus_and_rdma() -> None:
    denoiser = container(children()[("Deployment", "wan-t2v-denoiser")])
    assert denoiser["resources"]["limits"] == {GPU_RESOURCE: 4, "rdma/ib": 1}
    assert denoiser["resources"]["requests"] == {"cpu": "8", "memory": "64Gi"}
    assert container(children()[("Deployment", "wan-t2v-encoder")])["resources"]["limits"] == {
        GPU_RESOURCE: 1,
        "rdma/ib": 1,
    }


def test_tcp_mode_requests_no_rdma_and_names_no_ib_device() -> None:
    c = container(children(minimal_spec())[("Deployment", "wan-t2v-encoder")])
    assert c["resources"]["limits"] == {GPU_RESOURCE: 1}
    assert "--disagg-ib-device" not in c["args"]


def test_a_cpu_role_requests_and_tolerates_no_gpu_and_runs_on_cpu() -> None:
    spec = minimal_spec(encoder={"gpusPerReplica": 0, "resources": {"limits": {"cpu": "2"}}})
    deployments = children(spec)
    cpu_pod = deployments[("Deployment", "wan-t2v-encoder")]["spec"]["template"]["spec"]
    c = cpu_pod["containers"][0]
    assert c["resources"]["limits"] == {"cpu": "2"}
    assert cpu_pod["tolerations"] == []
    args = parse_serve(c)
    assert (args.device, args.num_gpus, args.resolved_device) == ("cpu", 1, "cpu")
    assert args.master_port is None
    gpu_pod = deployments[("Deployment", "wan-t2v-denoiser")]["spec"]["template"]["spec"]
    assert gpu_pod["containers"][0]["resources"]["limits"] == {GPU_RESOURCE: 1}
    assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in gpu_pod["tolerations"]
    assert parse_serve(gpu_pod["containers"][0]).device == "cuda"


def test_each_role_computes_in_its_own_dtype_auto_by_default() -> None:
    made = children(minimal_spec(denoiser={"dtype": "bfloat16"}, decoder={"dtype": "float32"}))
    dtypes = {role: parse_serve(container(made[("Deployment", f"wan-t2v-{role.value}")])).dtype for role in ROLES}
    assert dtypes == {Role.ENCODER: "auto", Role.DENOISER: "bfloat16", Role.DECODER: "float32"}
    with pytest.raises(SpecError) as err:
        pipeline(minimal_spec(decoder={"dtype": "fp8"}))
    assert err.value.field == "spec.decoder.dtype" and "fp8" in str(err.value), err.value


def test_a_cpu_role_keeps_the_users_own_tolerations() -> None:
    user = {"key": "dedicated", "operator": "Equal", "value": "ci", "effect": "NoSchedule"}
    pod = children(minimal_spec(decoder={"gpusPerReplica": 0, "tolerations": [user]}))[
        ("Deployment", "wan-t2v-decoder")
    ]["spec"]["template"]["spec"]
    assert pod["tolerations"] == [user]
    assert GPU_RESOURCE not in pod["containers"][0].get("resources", {}).get("limits", {})


def test_worker_pod_has_shm_pod_ip_and_model_volume() -> None:
    pod = children()[("Deployment", "wan-t2v-decoder")]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert pod["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize(
    "spec",
    [minimal_spec(transfer={"mode": "rdma", "ibDevice": "mlx5_0"}), minimal_spec(fullPipeline={})],
    ids=["rdma-roles", "full-pipeline"],
)
def test_heads_and_workers_run_without_capabilities_token_or_unfiltered_syscalls(spec: dict[str, Any]) -> None:
    """Pod Security "restricted"'s pod and container settings; neither calls the Kubernetes API."""
    deployments = [obj for key, obj in children(spec).items() if key[0] == "Deployment"]
    assert len(deployments) > 1
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, deployment["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"]:
            assert c["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }


@pytest.mark.parametrize(
    "spec",
    [minimal_spec(), example("flux-t2i.yaml")["spec"], minimal_spec(fullPipeline={})],
    ids=["model-on-a-claim", "hub-model", "full-pipeline"],
)
def test_on_a_read_only_root_every_folder_the_processes_write_is_a_mounted_volume(spec: dict[str, Any]) -> None:
    """/tmp (HOME: torch's and triton's caches, a bucket's staging), the hub cache, the head's results and
    /dev/shm are volumes the pod mounts writable; the model, keys and catalogue stay read-only."""
    deployments = [obj for key, obj in children(spec).items() if key[0] == "Deployment"]
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        c = pod["containers"][0]
        writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        hf_home = next((e["value"] for e in c["env"] if e["name"] == "HF_HOME"), None)
        if hf_home is not None:
            assert any(hf_home.startswith(path + "/") for path in writable), (deployment["metadata"]["name"], hf_home)
        if c["name"] == "head":
            assert OUTPUT_MOUNT in writable
        else:
            assert "/dev/shm" in writable


def test_a_multi_gpu_role_gets_a_master_port_loopback_collectives_and_shm_for_its_ranks() -> None:
    pod = children()[("Deployment", "wan-t2v-denoiser")]["spec"]["template"]["spec"]  # 4 GPUs
    c = pod["containers"][0]
    args = parse_serve(c)
    low, high = MOONCAKE_PORT_RANGE
    assert args.master_port not in (WORKER_PORT, WORKER_PORT + 1) and not low <= args.master_port < high
    assert {"name": "NCCL_SOCKET_IFNAME", "value": "lo"} in c["env"]
    assert {"name": "GLOO_SOCKET_IFNAME", "value": "lo"} in c["env"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]


def test_a_single_gpu_role_gets_no_rank_settings() -> None:
    pod = children()[("Deployment", "wan-t2v-decoder")]["spec"]["template"]["spec"]  # 1 GPU
    c = pod["containers"][0]
    assert parse_serve(c).master_port is None
    assert not {e["name"] for e in c["env"]} & {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}


def test_the_users_interface_env_wins_over_the_rank_default() -> None:
    env = [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}]
    spec = minimal_spec(denoiser={"gpusPerReplica": 2, "env": env})
    c = container(children(spec)[("Deployment", "wan-t2v-denoiser")])
    assert [e for e in c["env"] if e["name"] == "NCCL_SOCKET_IFNAME"] == env
    assert {"name": "GLOO_SOCKET_IFNAME", "value": "lo"} in c["env"]


def test_the_users_env_replaces_the_operators_entry_of_the_same_name() -> None:
    """Server-side apply refuses a container whose env names a variable twice; the user's entry wins."""
    hub = {"hubId": "org/model", "tokenSecretRef": {"name": "hf"}}
    mine = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "other", "key": "t"}}}]
    mine.append({"name": "HF_HOME", "value": "/cache/hf"})
    creds = {"url": "s3://bucket/x", "credentialsSecret": {"name": "results-s3"}}
    head_env = [{"name": "AWS_ACCESS_KEY_ID", "value": "minio"}]
    spec = minimal_spec(model=hub, decoder={"env": mine}, head={"env": head_env, "results": {"s3": creds}})
    objs = children(spec)
    for deployment, own in (("wan-t2v-decoder", mine), ("wan-t2v-head", head_env)):
        env = container(objs[("Deployment", deployment)])["env"]
        names = [e["name"] for e in env]
        assert len(names) == len(set(names)), names
        assert all(e in env for e in own)
    head_env_names = {e["name"] for e in container(objs[("Deployment", "wan-t2v-head")])["env"]}
    assert {"HF_HOME", "HF_TOKEN_PATH", "AWS_SECRET_ACCESS_KEY_FILE"} <= head_env_names  # the operator's, kept
    # The access key the user gives is not read from the Secret, which need not hold it: a volume naming a
    # key the Secret lacks keeps the pod from starting.
    volumes = objs[("Deployment", "wan-t2v-head")]["spec"]["template"]["spec"]["volumes"]
    (s3_files,) = [v["secret"]["items"] for v in volumes if v.get("secret", {}).get("secretName") == "results-s3"]
    assert [item["key"] for item in s3_files] == ["AWS_SECRET_ACCESS_KEY"]


@pytest.mark.parametrize(
    ("section", "env", "message"),
    [
        (
            "denoiser",
            [{"name": "POD_IP", "value": "10.0.0.1"}],
            "spec.denoiser.env[0].name: POD_IP is set by the operator",
        ),
        ("head", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], "spec.head.env[1].name: A is set twice"),
    ],
)
def test_an_env_the_pod_cannot_take_is_refused_naming_the_entry(
    section: str, env: list[dict[str, str]], message: str
) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        pipeline(minimal_spec(**{section: {"env": env}}))


def test_worker_probes_check_the_work_port() -> None:
    c = container(children()[("Deployment", "wan-t2v-encoder")])
    assert c["ports"] == [{"name": "work", "containerPort": WORKER_PORT, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"] == {"port": "work"}


def test_head_is_ready_on_its_readiness_route_and_alive_on_its_health_route() -> None:
    c = container(children()[("Deployment", "wan-t2v-head")])
    for probe in ("startupProbe", "livenessProbe"):  # /health stays 200 while it drains: never killed mid-drain
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # /ready fails the moment it drains; the api Service drops it within seconds.
    ready = c["readinessProbe"]
    assert ready["httpGet"] == {"path": "/ready", "port": "http"}
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 5


def test_an_old_head_drains_within_its_grace_period_after_its_successor_is_up() -> None:
    deployment = children(minimal_spec(head={"drainSeconds": 300}))[("Deployment", "wan-t2v-head")]
    # The successor first (a surge pod, ready before the old one gets SIGTERM): test_head_replicas.py.
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    # drainSeconds is the grace period, as for the roles; the head's own deadline leaves it time to
    # answer its last clients and save its jobs before the kubelet's SIGKILL.
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 300
    drain = parse_serve(container(deployment)).disagg_drain_timeout
    assert 300 - 60 <= drain <= 300 - HEAD_SHUTDOWN_OVERHEAD_S - 5, "the kubelet would kill the head mid-drain"


def test_workers_reach_a_draining_head_through_its_internal_service() -> None:
    assert children()[("Service", "wan-t2v-head")]["spec"]["publishNotReadyAddresses"] is True
    assert "publishNotReadyAddresses" not in children()[("Service", "wan-t2v-api")]["spec"]


def _outputs_volume(spec: dict[str, Any]) -> Manifest:
    pod = children(spec)[("Deployment", "wan-t2v-head")]["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "outputs")
    assert mount["mountPath"] == parse_serve(pod["containers"][0]).output_path
    return next(v for v in pod["volumes"] if v["name"] == "outputs")


def test_head_results_live_on_the_claim_the_cr_names_with_its_retention() -> None:
    results = {"persistentVolumeClaim": {"claimName": "dp-results"}, "maxAgeSeconds": 3600, "maxBytes": "2GiB"}
    spec = minimal_spec(head={"results": results})
    assert _outputs_volume(spec) == {"name": "outputs", "persistentVolumeClaim": {"claimName": "dp-results"}}
    args = parse_serve(container(children(spec)[("Deployment", "wan-t2v-head")]))
    assert (args.results_max_age, args.results_max_bytes) == (3600, 2 << 30)


def test_tracing_reaches_the_head_and_every_worker_and_is_off_by_default() -> None:
    url = "http://otel-collector.observability:4318"
    made = children(minimal_spec(tracing={"otlpEndpoint": url}))
    for name in ("head", *(role.value for role in ROLES)):
        assert parse_serve(container(made[("Deployment", f"wan-t2v-{name}")])).otlp_endpoint == url, name
    for name in ("head", *(role.value for role in ROLES)):
        assert "--otlp-endpoint" not in container(children()[("Deployment", f"wan-t2v-{name}")])["args"], name


def test_json_logs_reach_the_head_and_every_worker_text_is_the_default_and_extra_args_cannot_differ() -> None:
    made = children(minimal_spec(logging={"format": "json"}))
    for name in ("head", *(role.value for role in ROLES)):
        assert parse_serve(container(made[("Deployment", f"wan-t2v-{name}")])).log_format == "json", name
        assert parse_serve(container(children()[("Deployment", f"wan-t2v-{name}")])).log_format == "text", name
    with pytest.raises(SpecError) as err:
        pipeline(minimal_spec(logging={"format": "xml"}))
    assert err.value.field == "spec.logging.format" and "xml" in str(err.value), err.value
    with pytest.raises(SpecError, match=r"spec\.logging\.format"):
        render(pipeline(minimal_spec(head={"extraArgs": ["--log-format", "json"]})))


@pytest.mark.parametrize("url", ["otel:4318", "grpc://otel:4317", "http://"])
def test_a_collector_that_is_not_an_http_url_is_refused_naming_the_field(url: str) -> None:
    with pytest.raises(SpecError) as err:
        pipeline(minimal_spec(tracing={"otlpEndpoint": url}))
    assert err.value.field == "spec.tracing.otlpEndpoint" and url in str(err.value), err.value


def test_head_results_default_to_an_empty_dir() -> None:
    assert _outputs_volume(minimal_spec()) == {"name": "outputs", "emptyDir": {}}


def test_head_service_exposes_http_and_the_result_ports_workers_push_to() -> None:
    ports = {p["name"]: p["port"] for p in children()[("Service", "wan-t2v-head")]["spec"]["ports"]}
    assert ports == {
        "http": 30000,
        "result-encoder": HEAD_SCHEDULER_PORT + 1,
        "result-denoiser": HEAD_SCHEDULER_PORT + 2,
        "result-decoder": HEAD_SCHEDULER_PORT + 3,
    }
    api = children()[("Service", "wan-t2v-api")]["spec"]
    assert [p["name"] for p in api["ports"]] == ["http"]  # the scheduler protocol stays internal


def test_every_child_is_owned_by_the_pipeline_and_labelled() -> None:
    for (_, name), obj in children().items():
        meta = obj["metadata"]
        assert meta["namespace"] == NAMESPACE
        [ref] = meta["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "DiffusionPipeline",
            "wan-t2v",
            OWNER["metadata"]["uid"],
            True,
        ), name
        assert meta["labels"]["app.kubernetes.io/name"] == "triptych"
        assert meta["labels"]["app.kubernetes.io/instance"] == "wan-t2v"
        # "workers": the NetworkPolicy that covers every role's pods
        assert meta["labels"]["app.kubernetes.io/component"] in {"encoder", "denoiser", "decoder", "head", "workers"}


def test_changing_one_role_changes_only_that_roles_deployment() -> None:
    before = children()
    spec = example("wan-t2v.yaml")["spec"]
    spec["denoiser"]["replicas"] = 3
    spec["denoiser"]["image"] = "registry.example/worker:canary"
    after = children(spec)
    changed = {key for key in before if before[key] != after[key]}
    assert changed == {("Deployment", "wan-t2v-denoiser")}


def test_autoscaling_adds_an_hpa_on_the_roles_pending_work_and_leaves_replicas_to_it() -> None:
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetWorkSecondsPerReplica": 90}
    objs = children(minimal_spec(denoiser={"autoscaling": auto}))
    hpa = objs[("HorizontalPodAutoscaler", "wan-t2v-denoiser")]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 4)
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "wan-t2v-denoiser"}
    assert hpa["scaleTargetRef"] == deployment
    assert hpa["metrics"] == [
        {
            "type": "Object",
            "object": {
                "describedObject": deployment,
                "metric": {"name": "triptych_pending_work_seconds"},
                "target": {"type": "AverageValue", "averageValue": "90"},
            },
        }
    ]
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    assert hpa["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 0
    # The operator never writes the replica count of an autoscaled role: the HPA owns it.
    assert "replicas" not in objs[("Deployment", "wan-t2v-denoiser")]["spec"]
    assert objs[("Deployment", "wan-t2v-encoder")]["spec"]["replicas"] == 1


def test_a_role_that_scales_to_zero_gets_an_hpa_from_one_and_a_head_that_waits_for_it_to_wake() -> None:
    auto = {"enabled": True, "minReplicas": 0, "maxReplicas": 4}
    objs = children(minimal_spec(denoiser={"autoscaling": auto}))
    # An HPA cannot go below 1 (without an alpha feature gate): 0 and back are the operator's steps (wake.py).
    assert objs[("HorizontalPodAutoscaler", "wan-t2v-denoiser")]["spec"]["minReplicas"] == 1
    assert "replicas" not in objs[("Deployment", "wan-t2v-denoiser")]["spec"]
    head = parse_serve(container(objs[("Deployment", "wan-t2v-head")]))
    assert head.disagg_no_instance_wait == head.disagg_timeout == 600  # a request waits for a pod as long as it lives
    plain = parse_serve(container(children(minimal_spec())[("Deployment", "wan-t2v-head")]))
    assert plain.disagg_no_instance_wait == ServeArgs.disagg_no_instance_wait  # the default, where nothing sleeps


def test_scale_down_stabilization_comes_from_the_cr() -> None:
    auto = {"enabled": True, "maxReplicas": 4, "scaleDownStabilizationSeconds": 30}
    hpa = children(minimal_spec(decoder={"autoscaling": auto}))[("HorizontalPodAutoscaler", "wan-t2v-decoder")]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 30
    assert hpa["spec"]["metrics"][0]["object"]["target"]["averageValue"] == "60"  # the default target


def test_the_deprecated_queue_depth_fields_are_accepted_and_ignored() -> None:
    auto = {"enabled": True, "maxReplicas": 4, "targetQueueDepth": 3, "metricName": "triptych_worker_queue_depth"}
    hpa = children(minimal_spec(denoiser={"autoscaling": auto}))[("HorizontalPodAutoscaler", "wan-t2v-denoiser")]
    assert hpa["spec"]["metrics"][0]["object"]["metric"]["name"] == "triptych_pending_work_seconds"


@pytest.mark.parametrize(("role", "grace"), [("encoder", 120), ("denoiser", 300), ("decoder", 120)])
def test_each_role_drains_within_its_grace_period(role: str, grace: int) -> None:
    deployment = children(minimal_spec())[("Deployment", f"wan-t2v-{role}")]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == grace
    args = pod["containers"][0]["args"]
    # The worker's own deadline leaves it time to exit before the kubelet's SIGKILL.
    assert float(args[args.index("--disagg-drain-timeout") + 1]) == grace - 15
    # A draining pod leaves the Service by Kubernetes' own doing; the probe stays the TCP check.
    assert pod["containers"][0]["readinessProbe"]["tcpSocket"] == {"port": "work"}


def test_drain_seconds_is_per_role() -> None:
    objs = children(minimal_spec(denoiser={"drainSeconds": 1800}))
    pod = objs[("Deployment", "wan-t2v-denoiser")]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 1800
    assert objs[("Deployment", "wan-t2v-encoder")]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120


def test_disabled_optional_children_are_listed_for_deletion() -> None:
    gone = {(ref.kind, ref.name) for ref in render(pipeline(minimal_spec())).delete}
    assert ("Ingress", "wan-t2v-api") in gone
    assert ("HorizontalPodAutoscaler", "wan-t2v-encoder") in gone


def test_ingress_routes_to_the_api_service_with_tls() -> None:
    head = {"ingress": {"enabled": True, "host": "wan.example.com", "className": "nginx", "tls": {"secretName": "t"}}}
    ing = children(minimal_spec(head=head))[("Ingress", "wan-t2v-api")]["spec"]
    assert ing["ingressClassName"] == "nginx"
    assert ing["rules"][0]["http"]["paths"][0]["backend"]["service"] == {
        "name": "wan-t2v-api",
        "port": {"name": "http"},
    }
    assert ing["tls"] == [{"hosts": ["wan.example.com"], "secretName": "t"}]


def routed(paths: list[Manifest], url: str) -> bool:
    """Whether an Ingress with these `paths` sends `url` on: Exact is the whole path, Prefix whole elements."""
    return any(
        url == p["path"]
        if p["pathType"] == "Exact"
        else p["path"] == "/" or url == p["path"] or url.startswith(p["path"].rstrip("/") + "/")
        for p in paths
    )


def test_the_ingress_publishes_the_api_and_the_playground_but_not_metrics_health_or_ready_by_default() -> None:
    """What the OpenAI SDK and the playground's page request goes through; what tells worker addresses and load
    (/metrics, /health, /ready: for probes and scrapers inside the cluster) and FastAPI's /docs do not."""
    ingress = {"enabled": True, "host": "wan.example.com"}
    paths = children(minimal_spec(head={"ingress": ingress}))[("Ingress", "wan-t2v-api")]["spec"]["rules"][0]["http"][
        "paths"
    ]
    backend = {"service": {"name": "wan-t2v-api", "port": {"name": "http"}}}
    assert paths == [
        {"path": "/v1", "pathType": "Prefix", "backend": backend},
        {"path": "/static", "pathType": "Prefix", "backend": backend},
        {"path": "/", "pathType": "Exact", "backend": backend},
    ]
    for url in ("/v1/images/generations", "/v1/videos/v_1/content", "/v1/files/images/a.png", "/", "/static/app.js"):
        assert routed(paths, url), url
    for url in ("/metrics", "/health", "/ready", "/docs", "/openapi.json", "/v1x", "/staticfoo"):
        assert not routed(paths, url), url


def test_the_ingress_publishes_the_paths_the_spec_lists() -> None:
    ingress = {
        "enabled": True,
        "host": "wan.example.com",
        "paths": [{"path": "/v1/images"}, {"path": "/", "pathType": "Exact"}],
    }
    rule = children(minimal_spec(head={"ingress": ingress}))[("Ingress", "wan-t2v-api")]["spec"]["rules"][0]
    assert [(p["path"], p["pathType"]) for p in rule["http"]["paths"]] == [("/v1/images", "Prefix"), ("/", "Exact")]
    everything = {**ingress, "paths": [{"path": "/"}]}
    rule = children(minimal_spec(head={"ingress": everything}))[("Ingress", "wan-t2v-api")]["spec"]["rules"][0]
    assert [(p["path"], p["pathType"]) for p in rule["http"]["paths"]] == [("/", "Prefix")]


def test_the_ingress_lets_requests_through_as_the_heads_take_them_and_the_spec_s_annotations_win() -> None:
    """ingress-nginx would refuse a body over 1 MiB (an edit's upload) and cut an answer after 60 s."""
    ingress = {"enabled": True, "host": "wan.example.com"}
    annotations = children(minimal_spec(head={"ingress": ingress}))[("Ingress", "wan-t2v-api")]["metadata"][
        "annotations"
    ]
    nginx = "nginx.ingress.kubernetes.io/"
    assert annotations == {
        nginx + "proxy-body-size": "16m",  # --max-request-bytes' default
        nginx + "proxy-read-timeout": "660",  # timeoutSeconds' default (600) and a minute
        nginx + "proxy-send-timeout": "660",
        nginx + "proxy-buffering": "off",
    }
    head = {
        "timeoutSeconds": 1800,
        "extraArgs": ["--max-request-bytes", "64MiB"],
        "ingress": {
            **ingress,
            "annotations": {"cert-manager.io/cluster-issuer": "letsencrypt", nginx + "proxy-buffering": "on"},
        },
    }
    annotations = children(minimal_spec(head=head))[("Ingress", "wan-t2v-api")]["metadata"]["annotations"]
    assert annotations[nginx + "proxy-body-size"] == "64m" and annotations[nginx + "proxy-read-timeout"] == "1860"
    assert annotations["cert-manager.io/cluster-issuer"] == "letsencrypt"
    assert annotations[nginx + "proxy-buffering"] == "on"  # the spec's own win


def hub_token_file(deployment: Manifest) -> tuple[str, str] | None:
    """(Secret name, key) of the hub token file HF_TOKEN_PATH names in the pod, None without one; the
    token is never an env value (every child process would inherit it), and its file is read-only 0440."""
    c = container(deployment)
    assert all(e["name"] not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN") for e in c["env"])
    path = next((e["value"] for e in c["env"] if e["name"] == "HF_TOKEN_PATH"), None)
    if path is None:
        return None
    folder, name = path.rsplit("/", 1)
    [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == folder]
    assert mount["readOnly"] is True and "subPath" not in mount
    [volume] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["defaultMode"] == 0o440  # root and the pod's fsGroup; nobody else
    [item] = [i for i in volume["secret"]["items"] if i["path"] == name]
    return volume["secret"]["secretName"], item["key"]


def test_hub_model_gets_token_and_cache_instead_of_a_volume() -> None:
    objs = children(example("flux-t2i.yaml")["spec"])
    for name in ("head", "encoder", "denoiser", "decoder"):
        assert hub_token_file(objs[("Deployment", f"wan-t2v-{name}")]) == ("hf-token", "token"), name
    assert parse_serve(container(objs[("Deployment", "wan-t2v-encoder")])).model_path == "black-forest-labs/FLUX.1-dev"


def test_lora_adapters_are_a_catalogue_configmap_the_head_the_denoisers_and_the_encoders_read() -> None:
    spec = minimal_spec()
    spec["model"]["loras"] = ["ink=/models/loras/ink", "paper=org/paper-lora"]
    objs = children(spec)
    assert objs[("ConfigMap", "wan-t2v-loras")]["data"] == {
        "catalog.txt": "ink=/models/loras/ink\npaper=org/paper-lora\n"
    }
    for name in ("head", "encoder", "denoiser"):  # the encoder applies adapters' text-encoder parts
        c = container(objs[("Deployment", f"wan-t2v-{name}")])
        assert parse_serve(c).lora_catalog == "/etc/triptych/loras/catalog.txt"
        assert {"name": "loras", "mountPath": "/etc/triptych/loras", "readOnly": True} in c["volumeMounts"]
    decoder = container(objs[("Deployment", "wan-t2v-decoder")])
    assert parse_serve(decoder).lora_catalog is None and all(m["name"] != "loras" for m in decoder["volumeMounts"])

    # Another adapter changes the ConfigMap only: no pod template changes, so no pod restarts.
    spec["model"]["loras"] = [*spec["model"]["loras"], "wool=/models/loras/wool"]
    more = children(spec)
    assert more[("ConfigMap", "wan-t2v-loras")] != objs[("ConfigMap", "wan-t2v-loras")]
    for name in ("head", "encoder", "denoiser", "decoder"):
        key = ("Deployment", f"wan-t2v-{name}")
        assert more[key]["spec"]["template"] == objs[key]["spec"]["template"], name
    # So does the first hub id among adapters that were all paths: the download cache is always there.
    spec["model"]["loras"] = ["ink=/models/loras/ink"]
    paths_only = children(spec)
    spec["model"]["loras"] = ["ink=/models/loras/ink", "paper=org/paper-lora"]
    with_hub = children(spec)
    for name in ("head", "encoder", "denoiser", "decoder"):
        key = ("Deployment", f"wan-t2v-{name}")
        assert with_hub[key]["spec"]["template"] == paths_only[key]["spec"]["template"], name


def test_denoisers_and_encoders_download_hub_adapters_into_a_cache_with_the_model_s_token() -> None:
    spec = minimal_spec()
    spec["model"].update(loras=["paper=org/paper-lora"], tokenSecretRef={"name": "hf"})
    objs = children(spec)
    for name in ("denoiser", "encoder"):
        c = container(objs[("Deployment", f"wan-t2v-{name}")])
        assert hub_token_file(objs[("Deployment", f"wan-t2v-{name}")]) == ("hf", "token"), name
        assert {"name": "hf-cache", "mountPath": "/cache"} in c["volumeMounts"], name
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"], name
    decoder = objs[("Deployment", "wan-t2v-decoder")]
    assert hub_token_file(decoder) is None and all(m["name"] != "hf-cache" for m in container(decoder)["volumeMounts"])


def test_a_pipeline_without_adapters_has_no_catalogue_and_a_bad_entry_renders_nothing() -> None:
    assert ("ConfigMap", "wan-t2v-loras") in {(r.kind, r.name) for r in render(pipeline(minimal_spec())).delete}
    spec = minimal_spec()
    spec["model"]["loras"] = ["no-source"]
    with pytest.raises(SpecError, match=r"^spec\.model\.loras: 'no-source' is not NAME=SOURCE"):
        render(pipeline(spec))


def test_multus_network_annotation_lands_on_worker_pods() -> None:
    spec = minimal_spec(transfer={"mode": "rdma", "ibDevice": "mlx5_0", "networkAnnotation": "rdma-net"})
    meta = children(spec)[("Deployment", "wan-t2v-encoder")]["spec"]["template"]["metadata"]
    assert meta["annotations"] == {"k8s.v1.cni.cncf.io/networks": "rdma-net"}


def test_extra_args_are_appended_and_validated_like_the_process_does() -> None:
    ok = container(
        children(minimal_spec(decoder={"extraArgs": ["--log-level", "debug"]}))[("Deployment", "wan-t2v-decoder")]
    )
    assert parse_serve(ok).log_level == "debug"
    with pytest.raises(SpecError) as info:
        render(pipeline(minimal_spec(decoder={"extraArgs": ["--log-level", "loud"]})))
    assert info.value.field == "spec.decoder"
    assert "loud" in str(info.value)


def test_an_invalid_extra_arg_renders_nothing() -> None:
    with pytest.raises(SpecError):
        render(pipeline(minimal_spec(head={"extraArgs": ["--no-such-flag"]})))


def test_port_names_are_valid_service_port_names() -> None:
    for obj in children().values():
        pod = obj["spec"].get("template", {}).get("spec")
        ports = [p for c in pod["containers"] for p in c["ports"]] if pod else obj["spec"].get("ports", [])
        for port in ports:
            assert re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?", port["name"]), (obj["metadata"]["name"], port)


def test_a_slow_model_load_is_not_reported_as_a_stuck_rollout() -> None:
    for (kind, name), obj in children().items():
        if kind == "Deployment":
            probe = container(obj)["startupProbe"]
            startup_s = probe["periodSeconds"] * probe["failureThreshold"]
            assert obj["spec"]["progressDeadlineSeconds"] > startup_s, name


def test_head_api_keys_come_from_the_secret_the_cr_names_mounted_where_the_flag_points() -> None:
    spec = minimal_spec(head={"apiKeysSecret": {"name": "dp-api-keys", "key": "clients"}})
    deployment = children(spec)[("Deployment", "wan-t2v-head")]
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "dp-api-keys"
    assert volume["secret"]["items"] == [{"key": "clients", "path": "keys"}]
    mount = next(m for m in container(deployment)["volumeMounts"] if m["name"] == "api-keys")
    # A whole-volume mount (never subPath): Secret updates reach the file, and the head re-reads it.
    assert mount["readOnly"] is True and "subPath" not in mount
    assert parse_serve(container(deployment)).api_keys_file == f"{mount['mountPath']}/keys"


def test_without_api_keys_the_head_mounts_no_secret_and_gets_no_keys_flag() -> None:
    deployment = children()[("Deployment", "wan-t2v-head")]
    assert parse_serve(container(deployment)).api_keys_file is None
    assert all(v["name"] != "api-keys" for v in deployment["spec"]["template"]["spec"]["volumes"])


def test_head_webhook_posts_to_the_cr_s_url_signed_with_the_secret_mounted_where_the_flag_points() -> None:
    hook = {"url": "https://hooks.example.com/triptych", "secret": {"name": "wan-hook", "key": "signing"}}
    deployment = children(minimal_spec(head={"webhook": hook}))[("Deployment", "wan-t2v-head")]
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "webhook")
    assert volume["secret"]["secretName"] == "wan-hook" and volume["secret"]["items"] == [
        {"key": "signing", "path": "secret"}
    ]
    mount = next(m for m in container(deployment)["volumeMounts"] if m["name"] == "webhook")
    assert mount["readOnly"] is True and "subPath" not in mount
    args = parse_serve(container(deployment))
    assert (args.webhook_url, args.webhook_secret_file) == (hook["url"], f"{mount['mountPath']}/secret")
    plain = children()[("Deployment", "wan-t2v-head")]  # none declared: no flags, no volume
    assert parse_serve(container(plain)).webhook_url is None
    assert all(v["name"] != "webhook" for v in plain["spec"]["template"]["spec"]["volumes"])


@pytest.mark.parametrize(
    ("hook", "field", "says"),
    [
        ({"url": "ftp://hooks.example.com/x", "secret": {"name": "s"}}, "spec.head", "is not an http(s) URL"),
        ({"url": "https://hooks.example.com/x"}, "spec.head.webhook.secret", "required"),
        ({"url": "https://hooks.example.com/x", "secret": {}}, "spec.head.webhook.secret.name", "required"),
    ],
)
def test_a_webhook_that_cannot_work_is_refused_naming_its_field(hook: dict[str, Any], field: str, says: str) -> None:
    with pytest.raises(SpecError) as info:
        render(pipeline(minimal_spec(head={"webhook": hook})))
    assert info.value.field.startswith(field) and says in str(info.value), str(info.value)


def test_head_tls_serves_https_from_the_secret_and_everything_that_reaches_the_api_speaks_it() -> None:
    head = {"tls": {"secretName": "wan-head-tls"}, "ingress": {"enabled": True, "host": "wan.example.com"}}
    objs = children(minimal_spec(head=head))
    deployment = objs[("Deployment", "wan-t2v-head")]
    c = container(deployment)
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "wan-head-tls"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    assert mount["readOnly"] is True and "subPath" not in mount  # a renewal reaches the files; the head reloads
    args = parse_serve(c)
    assert (args.ssl_certfile, args.ssl_keyfile) == (f"{mount['mountPath']}/tls.crt", f"{mount['mountPath']}/tls.key")
    assert {"name": "https", "containerPort": HEAD_HTTP_PORT, "protocol": "TCP"} in c["ports"]
    assert all(p["name"] != "http" for p in c["ports"])
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS" and c[probe]["httpGet"]["port"] == "https", probe
    https = {"name": "https", "port": HEAD_HTTP_PORT, "targetPort": "https", "protocol": "TCP", "appProtocol": "https"}
    assert objs[("Service", "wan-t2v-api")]["spec"]["ports"] == [https]
    assert https in objs[("Service", "wan-t2v-head")]["spec"]["ports"]
    assert all(p["name"] != "https" for p in objs[("Service", "wan-t2v-heads")]["spec"]["ports"])
    ingress = objs[("Ingress", "wan-t2v-api")]
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"] == {"name": "https"}
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "HTTPS"


def test_without_head_tls_the_api_is_http_and_nothing_mentions_tls() -> None:
    objs = children(minimal_spec(head={"ingress": {"enabled": True, "host": "wan.example.com"}}))
    c = container(objs[("Deployment", "wan-t2v-head")])
    assert parse_serve(c).ssl_certfile is None and all(m["name"] != "tls" for m in c["volumeMounts"])
    assert "scheme" not in c["readinessProbe"]["httpGet"]
    assert objs[("Service", "wan-t2v-api")]["spec"]["ports"] == [
        {"name": "http", "port": HEAD_HTTP_PORT, "targetPort": "http", "protocol": "TCP"}
    ]
    assert (
        "nginx.ingress.kubernetes.io/backend-protocol"
        not in objs[("Ingress", "wan-t2v-api")]["metadata"]["annotations"]
    )


# --- control-plane keys and NetworkPolicies -------------------------------------------------


def pod_spec(deployment: Manifest) -> Manifest:
    return deployment["spec"]["template"]["spec"]


def keys_volume(deployment: Manifest) -> Manifest:
    [volume] = [v for v in pod_spec(deployment)["volumes"] if v["name"] == "control-keys"]
    return volume


@pytest.mark.parametrize(
    ("component", "files"),
    [
        ("head", ["head.key", "head.key_secret", "worker.key"]),
        ("encoder", ["worker.key", "worker.key_secret", "head.key"]),
        ("denoiser", ["worker.key", "worker.key_secret", "head.key"]),
        ("decoder", ["worker.key", "worker.key_secret", "head.key"]),
    ],
)
def test_each_pod_mounts_only_its_own_key_pair_and_the_other_sides_public_key(component: str, files: list[str]) -> None:
    deployment = children()[("Deployment", f"wan-t2v-{component}")]
    secret = keys_volume(deployment)["secret"]
    assert secret["secretName"] == "wan-t2v-control-keys"
    assert [item["key"] for item in secret["items"]] == files
    assert secret["defaultMode"] & 0o007 == 0  # nobody but the owner and the pod's group reads them
    [mount] = [m for m in container(deployment)["volumeMounts"] if m["name"] == "control-keys"]
    assert mount["readOnly"] is True
    args = parse_serve(container(deployment))
    assert args.disagg_keys_dir == mount["mountPath"]
    assert not args.disagg_insecure


def test_the_keys_fingerprint_goes_into_every_pod_template_so_new_keys_roll_every_pod() -> None:
    applied = render(pipeline(), owner=OWNER, keys_fingerprint="abc123").apply
    deployments = [m for m in applied if m["kind"] == "Deployment"]
    assert len(deployments) == 4
    for deployment in deployments:
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["triptych.ai/control-keys"] == "abc123"


def test_the_keys_secret_holds_a_key_set_the_processes_can_load(tmp_path) -> None:
    from triptych.security import load_keys, new_key_set
    from triptych_operator.manifests import control_keys_secret

    secret = control_keys_secret(pipeline(), new_key_set())
    assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", "wan-t2v-control-keys")
    for name, text in secret["stringData"].items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(SECRET_FILE_MODE)  # as the pods' Secret volume gives them
    head, worker = load_keys(tmp_path, "head"), load_keys(tmp_path, "worker")
    assert head.peer_public == worker.public and worker.peer_public == head.public


def policy(name: str) -> Manifest:
    return children()[("NetworkPolicy", name)]["spec"]


WORKERS = {
    "matchLabels": {
        "app.kubernetes.io/name": "triptych",
        "app.kubernetes.io/instance": "wan-t2v",
        "app.kubernetes.io/managed-by": "triptych-operator",
    },
    "matchExpressions": [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["encoder", "denoiser", "decoder"]}
    ],
}
HEAD = {"matchLabels": {**WORKERS["matchLabels"], "app.kubernetes.io/component": "head"}}


def test_workers_accept_work_from_their_head_and_mooncake_from_their_peers_only() -> None:
    spec = policy("wan-t2v-workers")
    assert spec["podSelector"] == WORKERS and spec["policyTypes"] == ["Ingress"]
    work, mooncake = spec["ingress"]
    assert work == {"from": [{"podSelector": HEAD}], "ports": [{"protocol": "TCP", "port": WORKER_PORT}]}
    assert mooncake == {
        "from": [{"podSelector": WORKERS}],
        "ports": [{"protocol": "TCP", "port": 15000, "endPort": 17000}],
    }


def test_full_pipeline_workers_take_only_their_heads_work() -> None:
    # They start no Mooncake engine (NoTransport): nothing of theirs listens on its ports.
    spec = children(minimal_spec(fullPipeline={}))[("NetworkPolicy", "wan-t2v-workers")]["spec"]
    (work,) = spec["ingress"]
    assert work["ports"] == [{"protocol": "TCP", "port": WORKER_PORT}]


def test_the_head_accepts_results_from_its_workers_only_and_http_from_anyone() -> None:
    spec = policy("wan-t2v-head")
    assert spec["podSelector"] == HEAD and spec["policyTypes"] == ["Ingress"]
    results, http = spec["ingress"]
    assert results["from"] == [{"podSelector": WORKERS}]
    assert sorted(p["port"] for p in results["ports"]) == [HEAD_SCHEDULER_PORT + i for i in (1, 2, 3)]
    assert http == {"ports": [{"protocol": "TCP", "port": 30000}]}  # no "from": every source


def test_the_policies_select_exactly_the_pods_the_deployments_run() -> None:
    objs = children()
    for component in ("encoder", "denoiser", "decoder"):
        pod_labels = objs[("Deployment", f"wan-t2v-{component}")]["spec"]["template"]["metadata"]["labels"]
        assert WORKERS["matchLabels"].items() <= pod_labels.items()
        assert pod_labels["app.kubernetes.io/component"] in WORKERS["matchExpressions"][0]["values"]
    head_labels = objs[("Deployment", "wan-t2v-head")]["spec"]["template"]["metadata"]["labels"]
    assert HEAD["matchLabels"].items() <= head_labels.items()
    assert container(objs[("Deployment", "wan-t2v-encoder")])["ports"][0]["containerPort"] == WORKER_PORT


def test_a_rollout_never_takes_a_role_to_zero_by_default() -> None:
    one = render(pipeline(minimal_spec(encoder={"replicas": 1}, denoiser={"replicas": 3})))
    strategies = {
        m["metadata"]["name"]: m["spec"]["strategy"]["rollingUpdate"]
        for m in one.apply
        if m["kind"] == "Deployment" and m["metadata"]["labels"]["app.kubernetes.io/component"] != "head"
    }
    assert strategies["wan-t2v-encoder"] == {"maxUnavailable": 0, "maxSurge": 1}  # one pod: replaced by a surge pod
    assert strategies["wan-t2v-denoiser"] == {"maxUnavailable": 1, "maxSurge": 0}  # several: one at a time


def test_an_autoscaled_role_that_may_idle_at_one_pod_rolls_by_surge() -> None:
    def strategy(min_replicas: int) -> dict[str, int]:
        auto = {"enabled": True, "minReplicas": min_replicas, "maxReplicas": 8}
        spec = minimal_spec(denoiser={"replicas": 3, "autoscaling": auto})  # replicas: ignored while autoscaled
        deployment = next(m for m in render(pipeline(spec)).apply if m["metadata"]["name"] == "wan-t2v-denoiser")
        return dict(deployment["spec"]["strategy"]["rollingUpdate"])

    assert strategy(0) == strategy(1) == {"maxUnavailable": 0, "maxSurge": 1}  # its only pod stays until replaced
    assert strategy(2) == {"maxUnavailable": 1, "maxSurge": 0}


def test_one_rollout_value_set_to_zero_makes_the_other_one() -> None:
    def strategy(replicas: int, rollout: dict[str, int]) -> dict[str, int]:
        spec = minimal_spec(decoder={"replicas": replicas, "rollout": rollout})
        deployment = next(m for m in render(pipeline(spec)).apply if m["metadata"]["name"] == "wan-t2v-decoder")
        return dict(deployment["spec"]["strategy"]["rollingUpdate"])

    assert strategy(3, {"maxUnavailable": 0}) == {"maxUnavailable": 0, "maxSurge": 1}
    assert strategy(1, {"maxSurge": 0}) == {"maxUnavailable": 1, "maxSurge": 0}
    assert strategy(1, {"maxUnavailable": 0}) == {"maxUnavailable": 0, "maxSurge": 1}  # the defaults, unchanged
    assert strategy(3, {"maxSurge": 0}) == {"maxUnavailable": 1, "maxSurge": 0}


def test_a_roles_rollout_can_be_set_and_both_zero_is_rejected() -> None:
    spec = minimal_spec(decoder={"replicas": 4, "rollout": {"maxUnavailable": 2}})
    deployment = next(m for m in render(pipeline(spec)).apply if m["metadata"]["name"] == "wan-t2v-decoder")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 2, "maxSurge": 0}
    with pytest.raises(SpecError, match="maxUnavailable and maxSurge cannot both be 0"):
        pipeline(minimal_spec(denoiser={"rollout": {"maxUnavailable": 0, "maxSurge": 0}}))


def test_batching_renders_each_roles_size_to_its_workers_and_dynamic_grouping_to_the_head() -> None:
    spec = minimal_spec(
        denoiser={"batching": {"maxSize": 8}}, decoder={"batching": {"maxSize": 4}}, head={"batching": {"delayMs": 20}}
    )
    kids = children(spec)
    sizes = {role: parse_serve(container(kids[("Deployment", f"wan-t2v-{role.value}")])).batching_max_size
             for role in ROLES}  # fmt: skip
    assert sizes == {Role.ENCODER: 1, Role.DENOISER: 8, Role.DECODER: 4}
    head = parse_serve(container(kids[("Deployment", "wan-t2v-head")]))
    assert (head.batching_mode, head.batching_max_size, head.batching_delay_ms) == ("dynamic", 8, 20.0)
    assert head.enable_batching_metrics
    assert head.role_batching_delays_ms() == {}


def test_a_roles_own_batching_delay_reaches_the_head_for_that_role_only() -> None:
    spec = minimal_spec(
        encoder={"batching": {"maxSize": 4, "delayMs": 2}}, denoiser={"batching": {"maxSize": 8, "delayMs": 120}}
    )
    head = parse_serve(container(children(spec)[("Deployment", "wan-t2v-head")]))
    assert head.role_batching_delays_ms() == {Role.ENCODER: 2.0, Role.DENOISER: 120.0}
    assert head.batching_delay_ms == 30.0  # the decoder's, and every role's without one
    with pytest.raises(SpecError, match="delayMs"):
        pipeline(minimal_spec(decoder={"batching": {"maxSize": 2, "delayMs": -1}}))


def test_without_batching_the_head_and_workers_get_no_batching_flags() -> None:
    for obj in children(minimal_spec()).values():
        if obj["kind"] == "Deployment":
            assert not any(arg.startswith("--batching") for arg in container(obj)["args"]), obj["metadata"]["name"]


def test_batching_on_a_multi_gpu_role_batches_on_every_rank() -> None:
    objs = children(minimal_spec(denoiser={"gpusPerReplica": 2, "batching": {"maxSize": 4}}))
    args = parse_serve(container(objs[("Deployment", "wan-t2v-denoiser")]))
    assert (args.num_gpus, args.batching_max_size) == (2, 4)  # a group is one batched forward on both ranks


@pytest.mark.parametrize(
    ("section", "extra", "flag", "source"),
    [
        ("denoiser", ["--disagg-role", "decoder"], "--disagg-role", "the field it is declared in"),
        ("denoiser", ["--scheduler-port", "1234"], "--scheduler-port", "the heads discover workers"),
        ("denoiser", ["--num-gpus", "4"], "--num-gpus", "spec.denoiser.gpusPerReplica"),
        ("denoiser", ["--device=cpu"], "--device", "spec.denoiser.gpusPerReplica"),
        ("denoiser", ["--disagg-server-addr", "tcp://192.0.2.1:5555"], "--disagg-server-addr", "headless Service"),
        ("denoiser", ["--base-gpu-id", "3"], "--base-gpu-id", "spec.denoiser.gpusPerReplica"),
        ("denoiser", ["--denoiser-ulysses", "1"], "--denoiser-ulysses", "spec.denoiser.parallelism.ulysses"),
        ("decoder", ["--disagg-drain-timeout", "1e12"], "--disagg-drain-timeout", "spec.decoder.drainSeconds"),
        ("encoder", ["--disagg-ib-device", "mlx5_0"], "--disagg-ib-device", "spec.transfer.ibDevice"),
        ("fullPipeline", ["--dtype", "float16"], "--dtype", "spec.fullPipeline.dtype"),
        ("head", ["--port", "8080"], "--port", "spec.head.port"),
        ("head", ["--scheduler-port", "6000"], "--scheduler-port", "workers report to this port"),
        ("head", ["--disagg-timeout", "nan"], "--disagg-timeout", "spec.head.timeoutSeconds"),
        ("head", ["--encoder-urls", "tcp://1.2.3.4:5"], "--encoder-urls", "worker pools"),
        ("head", ["--api-keys-file", "/keys"], "--api-keys-file", "spec.head.apiKeysSecret"),
        ("head", ["--webhook-url", "https://h.example/x"], "--webhook-url", "spec.head.webhook.url"),
    ],
)
def test_extra_args_may_not_change_a_flag_the_operator_sets_and_the_refusal_names_its_field(
    section: str, extra: list[str], flag: str, source: str
) -> None:
    with pytest.raises(SpecError) as info:
        render(pipeline(minimal_spec(**{section: {"extraArgs": extra}})))
    assert info.value.field == f"spec.{section}.extraArgs"
    assert str(info.value).startswith(f"spec.{section}.extraArgs: {flag} ")
    assert source in str(info.value)


def test_extra_args_may_set_flags_the_operator_leaves_alone_or_repeat_its_value() -> None:
    head = {"extraArgs": ["--disagg-no-instance-wait", "30", "--max-request-bytes", "64MiB"]}  # docs/autoscaling.md
    decoder = {"extraArgs": ["--disagg-transfer-listen-any", "--device", "cuda", "--num-gpus", "1"]}
    objs = children(minimal_spec(head=head, decoder=decoder))
    assert parse_serve(container(objs[("Deployment", "wan-t2v-head")])).disagg_no_instance_wait == 30
    assert parse_serve(container(objs[("Deployment", "wan-t2v-decoder")])).disagg_transfer_listen_any


def test_a_non_finite_head_timeout_is_refused_naming_the_field_not_a_traceback() -> None:
    p = pipeline(minimal_spec(head={"ingress": {"enabled": True, "host": "wan.example.com"}}))
    _, flags = head_argv(p)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(SpecError) as info:
            head_ingress(p, dataclasses.replace(flags, disagg_timeout=bad))
        assert info.value.field == "spec.head.timeoutSeconds"


def test_a_duplicate_adapter_is_named_once_with_its_field() -> None:
    spec = minimal_spec()
    spec["model"]["loras"] = ["a=/x", "a=/y"]
    with pytest.raises(SpecError) as info:
        render(pipeline(spec))
    assert str(info.value) == "spec.model.loras: adapter 'a' is declared twice"
