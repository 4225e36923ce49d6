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


def test_a_refused_apply_of_a_new_shape_keeps_the_old_shape_s_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """A switch to split encoders whose first new pool is refused (its name is another pipeline's)
    deleted the combined encoder's pool anyway: the head, still pointed at it, had no encoder at all."""
    deleted: list[str] = []

    def get_managed(api_version: str, kind: str, name: str, namespace: str, pipeline: str) -> None:
        if name == "p-prompt-encoder":
            raise kube.ApplyError(f"{kind} {name} already belongs to DiffusionPipeline p-prompt")

    monkeypatch.setattr(kube, "get_managed", get_managed)
    monkeypatch.setattr(kube, "apply", lambda obj, before: pytest.fail(f"applied {obj['metadata']['name']}"))
    monkeypatch.setattr(kube, "delete", lambda api_version, kind, name, namespace: deleted.append(f"{kind} {name}"))
    monkeypatch.setattr(handlers, "_post", lambda *args, **kwargs: None)
    encoder = {"metadata": {"name": "p-encoder", "namespace": NAMESPACE}}
    indexes: dict[str, Any] = {index: {} for *_, index in handlers.CHILD_KINDS.values()}
    indexes[handlers.DEPLOYMENT_INDEX] = {(NAMESPACE, "p"): [encoder]}
    indexes[handlers.CHILD_KINDS[("v1", "Service")][3]] = {(NAMESPACE, "p"): [encoder]}
    autoscaler = {"metadata": {"name": "p-denoiser", "namespace": NAMESPACE}}  # autoscaling was turned off
    indexes[handlers.CHILD_KINDS[("autoscaling/v2", "HorizontalPodAutoscaler")][3]] = {(NAMESPACE, "p"): [autoscaler]}
    states = PipelineStates()
    states.get((NAMESPACE, "p")).keys_fingerprint = "fp"

    async def reconcile() -> str | None:
        return await handlers.reconcile(four_pool_pipeline(), states, indexes, trigger="child-modified", logger=LOG)

    assert asyncio.run(reconcile()) == "Deployment p-prompt-encoder already belongs to DiffusionPipeline p-prompt"
    assert deleted == ["HorizontalPodAutoscaler p-denoiser"]  # the rest goes: it would fight the replicas applied


def test_while_the_spec_is_invalid_the_status_reports_the_roles_that_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """An invalid edit of a four-pool pipeline reported the default shape: the running split encoders
    dropped out of the status and a combined encoder that does not exist was 'not created'."""
    patches: list[dict[str, Any]] = []
    monkeypatch.setattr(kube, "patch_pipeline_status", lambda name, namespace, status: patches.append(dict(status)))
    monkeypatch.setattr(handlers, "_post", lambda *args, **kwargs: None)

    def running(component: str, name: str) -> dict[str, Any]:
        meta = {"name": name, "generation": 1, "labels": {"app.kubernetes.io/component": component}}
        ready = {"observedGeneration": 1, "readyReplicas": 1, "updatedReplicas": 1}
        return {"metadata": meta, "spec": {"replicas": 1}, "status": ready}

    components = {"promptEncoder": "p-prompt-encoder", "imageEncoder": "p-image-encoder", "denoiser": "p-denoiser"}
    deployments = [running(c, n) for c, n in {**components, "decoder": "p-decoder", "head": "p-head"}.items()]
    indexes = {handlers.DEPLOYMENT_INDEX: {(NAMESPACE, "p"): deployments}, handlers.POD_INDEX: {}}
    state = PipelineStates().get((NAMESPACE, "p"))
    pipeline = four_pool_pipeline()
    handlers._validate(pipeline, state, logger=LOG)
    asyncio.run(handlers._write_status(pipeline, state, indexes))
    pipeline["metadata"]["generation"] = 3
    pipeline["spec"]["denoiser"] = {"gpusPerReplica": 2, "parallelism": {"tp": 3}}  # 3 does not divide 2 GPUs
    handlers._validate(pipeline, state, logger=LOG)
    assert state.spec is None and state.spec_error
    asyncio.run(handlers._write_status(pipeline, state, indexes))
    status = patches[-1]
    assert status["promptEncoder"]["ready"] == "1/1" and status["imageEncoder"]["ready"] == "1/1"
    assert "encoder" not in status or status["encoder"] is None


def test_an_edit_that_only_removes_a_field_is_applied_also_by_an_operator_started_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Removing the head's nodeSelector changed the manifest, but the live object projected onto the new
    manifest (which lacks the field) equalled it: nothing was applied, then or after a restart."""
    live: dict[tuple[str, str], dict[str, Any]] = {}

    def apply(obj: dict[str, Any], before: Any) -> tuple[kube.ApplyResult, dict[str, Any]]:
        live[(obj["kind"], obj["metadata"]["name"])] = json.loads(json.dumps(obj))  # a server-side apply's result
        return kube.ApplyResult.UPDATED, live[(obj["kind"], obj["metadata"]["name"])]

    monkeypatch.setattr(kube, "get_managed", lambda *args: None)
    monkeypatch.setattr(kube, "apply", apply)
    monkeypatch.setattr(handlers, "_post", lambda *args, **kwargs: None)

    def indexes() -> dict[str, Any]:
        found: dict[str, Any] = {}
        for (_, kind), (*_, index) in handlers.CHILD_KINDS.items():
            found[index] = {(NAMESPACE, "p"): [obj for (k, _), obj in live.items() if k == kind]}
        return found

    def reconcile(states: PipelineStates, head: dict[str, Any]) -> None:
        pipeline = four_pool_pipeline()
        pipeline["spec"]["head"], pipeline["metadata"]["generation"] = head, 3 if head else 4
        asyncio.run(handlers.reconcile(pipeline, states, indexes(), trigger="child-modified", logger=LOG))

    def selector() -> Any:
        return live[("Deployment", "p-head")]["spec"]["template"]["spec"].get("nodeSelector")

    for restarted in (False, True):
        states = PipelineStates()
        states.get((NAMESPACE, "p")).keys_fingerprint = "fp"
        reconcile(states, {"nodeSelector": {"pool": "cpu"}})
        assert selector() == {"pool": "cpu"}
        if restarted:
            states = PipelineStates()  # no record of what was applied
            states.get((NAMESPACE, "p")).keys_fingerprint = "fp"
        reconcile(states, {})
        assert selector() is None, f"restarted={restarted}"


def test_a_key_secret_of_an_earlier_pipeline_of_the_name_is_waited_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline deleted and created again at once found its predecessor's key Secret, which the
    garbage collector then removed: every pod started later stayed in ContainerCreating."""
    applied: list[str] = []
    old_owner = {"apiVersion": "triptych.ai/v1alpha1", "kind": "DiffusionPipeline", "name": "p", "uid": "u0"}
    earlier = {"metadata": {"name": "p-control-keys", "ownerReferences": [old_owner]}, "data": {}}
    monkeypatch.setattr(kube, "create_once", lambda obj: (earlier, False))
    monkeypatch.setattr(kube, "get_managed", lambda *args: None)
    monkeypatch.setattr(kube, "apply", lambda obj, before: applied.append(obj["metadata"]["name"]))
    monkeypatch.setattr(handlers, "_post", lambda *args, **kwargs: None)
    indexes: dict[str, Any] = {index: {} for *_, index in handlers.CHILD_KINDS.values()}

    async def reconcile() -> str | None:
        return await handlers.reconcile(four_pool_pipeline(), PipelineStates(), indexes, trigger="pipeline", logger=LOG)

    error = asyncio.run(reconcile())
    assert error is not None and error.startswith("Secret p-control-keys belongs to an earlier DiffusionPipeline")
    assert "uid u0" in error and applied == []
