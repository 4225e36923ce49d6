"""The pipeline's two NetworkPolicies: who may reach the workers' ports and the head's."""

from __future__ import annotations

from triptych.ports import MOONCAKE_PORT_RANGE, result_port
from triptych_operator.constants import (
    HEAD_COMPONENT,
    HEAD_SCHEDULER_PORT,
    LABEL_COMPONENT,
    WORKER_PORT,
    crd_field,
)
from triptych_operator.manifests.parts import Manifest, labels, object_metadata
from triptych_operator.serve_args import object_name
from triptych_operator.spec.model import PipelineSpec

WORKERS_POLICY = "workers"  # name suffixes of the two NetworkPolicies
HEAD_POLICY = "head"


def _workers_selector(pipeline: PipelineSpec) -> Manifest:
    """Every worker pod of this pipeline, whatever its role."""
    common = {k: v for k, v in labels(pipeline, "").items() if k != LABEL_COMPONENT}
    roles = [crd_field(role) for role in pipeline.roles]
    return {"matchLabels": common, "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": roles}]}


def _head_selector(pipeline: PipelineSpec) -> Manifest:
    return {"matchLabels": labels(pipeline, HEAD_COMPONENT)}


def worker_network_policy(pipeline: PipelineSpec) -> Manifest:
    """Workers accept their work port from the pipeline's head only, and Mooncake's ports (handshake
    and TCP data, both from MOONCAKE_PORT_RANGE) from the pipeline's other workers only; a
    full-pipeline pool's workers start no Mooncake engine, and take nothing from each other. RDMA
    traffic bypasses the kernel and is not subject to NetworkPolicy."""
    low, high = MOONCAKE_PORT_RANGE
    rules: list[Manifest] = [
        {"from": [{"podSelector": _head_selector(pipeline)}], "ports": [{"protocol": "TCP", "port": WORKER_PORT}]}
    ]
    if not pipeline.full_pipeline:
        peers = {"from": [{"podSelector": _workers_selector(pipeline)}]}
        rules.append({**peers, "ports": [{"protocol": "TCP", "port": low, "endPort": high}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_metadata(pipeline, WORKERS_POLICY),
        "spec": {
            "podSelector": _workers_selector(pipeline),
            "policyTypes": ["Ingress"],
            "ingress": rules,
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
        "metadata": object_metadata(pipeline, HEAD_COMPONENT, object_name(pipeline.name, HEAD_POLICY)),
        "spec": {
            "podSelector": _head_selector(pipeline),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": _workers_selector(pipeline)}], "ports": result_ports},
                {"ports": [{"protocol": "TCP", "port": pipeline.head.port}]},
            ],
        },
    }
