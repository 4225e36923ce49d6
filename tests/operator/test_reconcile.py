"""One reconcile (handlers.reconcile) with the API server stubbed: what it records when a write is
refused. The same against a real API server is tests/operator/test_operator_cluster.py."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from kubernetes.client import ApiException
from kubernetes.dynamic.exceptions import DynamicApiError

from tests.operator.helpers import NAMESPACE, minimal_spec
from triptych_operator import handlers, kube
from triptych_operator.pipeline_state import PipelineStates

LOG = logging.getLogger("test-reconcile")


def four_pool_pipeline() -> dict[str, Any]:
    meta = {"name": "p", "namespace": NAMESPACE, "uid": "u1", "generation": 2}
    spec = minimal_spec(promptEncoder={}, imageEncoder={})
    return {"apiVersion": "triptych.ai/v1alpha1", "kind": "DiffusionPipeline", "metadata": meta, "spec": spec}


def test_a_refused_deletion_is_reported_as_an_apply_error_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a switch to the four-pool shape the combined encoder's pool goes; a 403 on its deletion
    (RBAC without `delete`) ends in the pipeline's status, like a refused apply."""
    applied: list[str] = []

    def apply(obj: dict[str, Any], before: Any) -> tuple[kube.ApplyResult, dict[str, Any]]:
        applied.append(f"{obj['kind']} {obj['metadata']['name']}")
        return kube.ApplyResult.CREATED, {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}

    class Forbidden:
        def delete(self, name: str, namespace: str) -> None:
            body = json.dumps({"message": f'deployments.apps "{name}" is forbidden'})
            raise DynamicApiError(ApiException(403, "Forbidden", body=body))

    monkeypatch.setattr(kube, "get_managed", lambda *args: None)
    monkeypatch.setattr(kube, "apply", apply)
    monkeypatch.setattr(kube, "_resource", lambda api_version, kind: Forbidden())
    monkeypatch.setattr(handlers, "_post", lambda *args, **kwargs: None)
    old_encoder = {"metadata": {"name": "p-encoder", "namespace": NAMESPACE}}
    indexes: dict[str, Any] = {index: {} for *_, index in handlers.CHILD_KINDS.values()}
    indexes[handlers.DEPLOYMENT_INDEX] = {(NAMESPACE, "p"): [old_encoder]}
    states = PipelineStates()
    states.get((NAMESPACE, "p")).keys_fingerprint = "fp"  # the key Secret was read before

    async def reconcile() -> str | None:
        return await handlers.reconcile(four_pool_pipeline(), states, indexes, trigger="child-modified", logger=LOG)

    error = asyncio.run(reconcile())
    assert error == 'the deletion of Deployment p-encoder: deployments.apps "p-encoder" is forbidden'
    assert states.get((NAMESPACE, "p")).apply_error == error
    assert "Deployment p-prompt-encoder" in applied  # the rest of the spec was applied


def test_the_status_patch_removes_the_roles_of_the_shape_the_pipeline_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """The status is a merge patch: a key it leaves out stays. After a switch to the four-pool shape the
    combined encoder's entry must go (None), not report its last state forever."""
    patches: list[dict[str, Any]] = []
    monkeypatch.setattr(kube, "patch_pipeline_status", lambda name, namespace, status: patches.append(dict(status)))
    monkeypatch.setattr(handlers, "_post", lambda *args, **kwargs: None)
    pipeline = four_pool_pipeline()
    pipeline["status"] = {"phase": "Ready", "encoder": {"ready": "1/1", "replicas": 1}}
    state = PipelineStates().get((NAMESPACE, "p"))
    handlers._validate(pipeline, state, logger=LOG)
    indexes = {handlers.DEPLOYMENT_INDEX: {}, handlers.POD_INDEX: {}}

    asyncio.run(handlers._write_status(pipeline, state, indexes))
    [patch] = patches
    assert patch["encoder"] is None and patch["promptEncoder"] is not None and patch["imageEncoder"] is not None
    assert {k for k, v in patch.items() if v is None} == {"encoder"}
