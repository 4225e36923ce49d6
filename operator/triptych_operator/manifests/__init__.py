"""Desired children of a DiffusionPipeline, as plain dicts: `PipelineSpec -> manifests`.

Nothing here talks to the API server, so every object the operator writes can be unit-tested.
Each role's objects depend only on that role's spec (and the shared model/transfer/images), so
editing one role rolls only that role's Deployment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import kopf

from triptych_operator.constants import HEAD_COMPONENT, LORA_COMPONENT, PIPELINE_ROLES
from triptych_operator.manifests.head import (
    API_COMPONENT,
    api_service,
    head_deployment,
    head_disruption_budget,
    head_ingress,
    head_service,
    heads_service,
)
from triptych_operator.manifests.network import head_network_policy, worker_network_policy
from triptych_operator.manifests.parts import Children, Manifest, ObjectRef, control_keys_secret, lora_catalog
from triptych_operator.manifests.workers import role_refs, worker_deployment, worker_hpa, worker_service
from triptych_operator.serve_args import head_argv, object_name, worker_argv
from triptych_operator.spec.model import PipelineSpec

__all__ = ["Children", "Manifest", "ObjectRef", "control_keys_secret", "render"]


def render(pipeline: PipelineSpec, owner: Mapping[str, Any] | None = None, keys_fingerprint: str = "") -> Children:
    """Every child of `pipeline`; argv are validated first, so an invalid spec renders nothing.

    With `owner` (the DiffusionPipeline body), each child gets a controller owner reference so
    deleting the pipeline garbage-collects it. `keys_fingerprint` (of the control-keys Secret,
    which the handler creates once, see `control_keys_secret`) goes into every pod template, so
    new keys roll every pod.
    """
    argvs = {role: worker_argv(pipeline, role) for role in pipeline.roles}
    head_args, head_flags = head_argv(pipeline)
    children = Children()
    for role in PIPELINE_ROLES:
        if role not in pipeline.roles:  # the other encoder shape: remove its pool if it was declared before
            children.delete += role_refs(pipeline, role)
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
    ingress = head_ingress(pipeline, head_flags)
    if ingress is None:
        children.delete.append(ObjectRef("networking.k8s.io/v1", "Ingress", object_name(pipeline.name, API_COMPONENT)))
    else:
        children.apply.append(ingress)
    if owner is not None:
        # The owner-reference half of kopf.adopt: adopt would also copy the pipeline's labels onto
        # every child, so relabelling a pipeline would rewrite all of its objects.
        kopf.append_owner_reference(children.apply, owner=kopf.Body(cast(kopf.RawBody, dict(owner))))
    return children
