"""spec.fullPipeline -> manifests: one worker Deployment and Service whose pods run every stage, a head
with only --denoiser-urls, an HPA like a role's; checked without a cluster (the API server's CEL
rules: test_operator_cluster.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.operator.helpers import OWNER, minimal_spec, pipeline
from tests.operator.test_manifests import container, parse_serve
from triptych.config import DEFAULT_POOL_SIZE
from triptych.roles import Role
from triptych_operator.constants import GPU_RESOURCE, MULTUS_NETWORKS_ANNOTATION
from triptych_operator.manifests import Manifest, render
from triptych_operator.spec.model import SpecError


def rendered(spec: dict[str, Any]) -> tuple[dict[tuple[str, str], Manifest], list[tuple[str, str]]]:
    children = render(pipeline(spec), owner=OWNER)
    return {(m["kind"], m["metadata"]["name"]): m for m in children.apply}, [(r.kind, r.name) for r in children.delete]


def test_a_full_pipeline_pool_is_one_worker_deployment_and_service_and_the_other_pools_are_removed() -> None:
    applied, deleted = rendered(minimal_spec(fullPipeline={"replicas": 3}))
    deployments = sorted(name for kind, name in applied if kind == "Deployment")
    assert deployments == ["wan-t2v-denoiser", "wan-t2v-head"]
    assert applied[("Service", "wan-t2v-denoiser")]["spec"]["clusterIP"] == "None"
    assert applied[("Deployment", "wan-t2v-denoiser")]["spec"]["replicas"] == 3
    for pool in ("encoder", "decoder", "prompt-encoder", "image-encoder"):
        assert ("Deployment", f"wan-t2v-{pool}") in deleted and ("Service", f"wan-t2v-{pool}") in deleted


def test_its_workers_run_the_whole_pipeline_and_the_head_lists_only_them() -> None:
    applied, _ = rendered(minimal_spec(fullPipeline={"gpusPerReplica": 0}))
    worker = parse_serve(container(applied[("Deployment", "wan-t2v-denoiser")]))
    assert worker.disagg_role is Role.DENOISER and worker.disagg_full_pipeline and worker.device == "cpu"
    head = parse_serve(container(applied[("Deployment", "wan-t2v-head")]))
    assert head.denoiser_urls and not (head.encoder_urls or head.decoder_urls or head.prompt_encoder_urls)


def test_its_pods_take_no_rdma_device_or_network_since_nothing_moves_between_them() -> None:
    rdma = {"mode": "rdma", "ibDevice": "mlx5_0", "networkAnnotation": "rdma-net", "poolSize": "1GiB"}
    applied, _ = rendered(minimal_spec(fullPipeline={}, transfer=rdma))
    pod = applied[("Deployment", "wan-t2v-denoiser")]["spec"]["template"]
    worker = pod["spec"]["containers"][0]
    assert set(worker["resources"]["limits"]) == {GPU_RESOURCE}
    assert MULTUS_NETWORKS_ANNOTATION not in pod["metadata"].get("annotations", {})
    assert parse_serve(worker).disagg_ib_device is None
    assert parse_serve(worker).disagg_transfer_pool_size == DEFAULT_POOL_SIZE  # no pool: the worker refuses a size
    roles, _ = rendered(minimal_spec(transfer=rdma))  # the same transfer settings on role pools: all applied
    role_worker = container(roles[("Deployment", "wan-t2v-denoiser")])
    assert "rdma/ib" in role_worker["resources"]["limits"]


def test_role_pool_workers_do_not_run_the_whole_pipeline() -> None:
    applied, _ = rendered(minimal_spec())
    assert not parse_serve(container(applied[("Deployment", "wan-t2v-denoiser")])).disagg_full_pipeline


def test_autoscaling_a_full_pipeline_pool_adds_an_hpa_on_its_pending_work() -> None:
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 5}
    applied, _ = rendered(minimal_spec(fullPipeline={"autoscaling": auto}))
    hpa = applied[("HorizontalPodAutoscaler", "wan-t2v-denoiser")]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 5)
    assert hpa["metrics"][0]["object"]["metric"]["name"] == "triptych_pending_work_seconds"
    assert "replicas" not in applied[("Deployment", "wan-t2v-denoiser")]["spec"]


@pytest.mark.parametrize(
    ("sections", "field", "message"),
    [
        ({"fullPipeline": {}, "denoiser": {}}, "spec.fullPipeline", "declare a full-pipeline pool or role pools"),
        ({"fullPipeline": {}, "encoder": {}}, "spec.fullPipeline", "not both"),
        ({"fullPipeline": {"extraArgs": ["--simulate"]}}, "spec.fullPipeline", "--disagg-full-pipeline does not"),
        ({"fullPipeline": {"gpusPerReplica": 2, "parallelism": {"tp": 3}}}, "spec.fullPipeline.parallelism", "2"),
    ],
    ids=["with-denoiser", "with-encoder", "simulated", "degrees-beyond-the-gpus"],
)
def test_a_full_pipeline_pool_beside_role_pools_or_that_cannot_start_is_rejected(sections, field, message) -> None:
    with pytest.raises(SpecError) as info:
        render(pipeline(minimal_spec(**sections)))  # argv are checked as the process would check them
    assert info.value.field == field and message in str(info.value)


def test_a_full_pipeline_pool_on_several_gpus_denoises_on_all_of_them() -> None:
    """gpusPerReplica 2: two GPUs per pod and `--num-gpus 2` with the denoiser's degrees (encode and
    decode run on the first GPU, parallel/full.py)."""
    applied, _ = rendered(minimal_spec(fullPipeline={"gpusPerReplica": 2, "parallelism": {"cfg": 2}}))
    worker = container(applied[("Deployment", "wan-t2v-denoiser")])
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    args = parse_serve(worker)
    assert args.disagg_full_pipeline and args.num_gpus == 2 and args.cfg_parallel_size == 2
