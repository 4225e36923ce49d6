"""Status computation from Deployments: phase, per-role counts, conditions a person can act on."""

from __future__ import annotations

from typing import Any

from triptych_operator.status import compute_status

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"
COMPONENTS = ("encoder", "denoiser", "decoder", "head")


def deployment(name: str, *, desired: int = 1, ready: int = 1, updated: int | None = None, **status: Any) -> dict:
    return {
        "metadata": {"name": name, "generation": 2},
        "spec": {"replicas": desired},
        "status": {
            "observedGeneration": 2,
            "readyReplicas": ready,
            "updatedReplicas": desired if updated is None else updated,
            **status,
        },
    }


def all_ready() -> dict[str, dict]:
    return {c: deployment(f"p-{c}") for c in COMPONENTS}


def cond(status: dict, type_: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_all_components_ready_means_phase_ready() -> None:
    status = compute_status(3, all_ready(), now=NOW)
    assert status["phase"] == "Ready"
    assert status["observedGeneration"] == 3
    assert status["denoiser"] == {"ready": "1/1", "readyReplicas": 1, "replicas": 1}
    assert cond(status, "Ready")["status"] == "True"
    assert cond(status, "Degraded")["status"] == "False"
    assert cond(status, "DenoiserReady")["reason"] == "AllReplicasReady"


def test_waiting_pods_mean_progressing_with_counts() -> None:
    deps = all_ready()
    deps["denoiser"] = deployment("p-denoiser", desired=2, ready=1)
    status = compute_status(1, deps, now=NOW)
    assert status["phase"] == "Progressing"
    assert status["denoiser"]["ready"] == "1/2"
    assert cond(status, "DenoiserReady") | {"lastTransitionTime": None} == {
        "type": "DenoiserReady",
        "status": "False",
        "reason": "WaitingForPods",
        "message": "p-denoiser: 1/2 pods ready, 2/2 updated",
        "lastTransitionTime": None,
        "observedGeneration": 1,
    }
    assert cond(status, "Progressing")["status"] == "True"
    assert "denoiser (WaitingForPods)" in cond(status, "Ready")["message"]


def test_a_stalled_rollout_is_degraded_and_points_at_the_pods() -> None:
    deps = all_ready()
    stalled = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]
    deps["encoder"] = deployment("p-encoder", ready=0, conditions=stalled)
    status = compute_status(1, deps, now=NOW)
    assert status["phase"] == "Degraded"
    degraded = cond(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "RolloutStuck")
    assert "kubectl describe pods" in degraded["message"]


def test_an_invalid_spec_with_nothing_created_is_invalid_and_says_why() -> None:
    status = compute_status(1, {}, spec_error="spec.denoiser.parallelism: tp=3 ...", now=NOW)
    assert status["phase"] == "Invalid"
    assert cond(status, "Ready")["reason"] == "InvalidSpec"
    degraded = cond(status, "Degraded")
    assert degraded["status"] == "True"
    assert degraded["message"].startswith("spec.denoiser.parallelism: tp=3")
    assert cond(status, "EncoderReady")["reason"] == "InvalidSpec"


def test_an_invalid_edit_keeps_reporting_the_running_objects() -> None:
    status = compute_status(4, all_ready(), spec_error="spec.head.port: ...", now=NOW)
    assert status["phase"] == "Invalid"
    assert cond(status, "Ready")["status"] == "True"  # the previous spec still serves
    assert cond(status, "Degraded")["reason"] == "InvalidSpec"


def test_a_deployment_not_yet_observed_is_not_ready() -> None:
    deps = all_ready()
    deps["head"]["metadata"]["generation"] = 3
    assert cond(compute_status(1, deps, now=NOW), "HeadReady")["reason"] == "RolloutPending"


def test_scaled_to_zero_says_the_pipeline_cannot_serve() -> None:
    deps = all_ready()
    deps["decoder"] = deployment("p-decoder", desired=0, ready=0)
    c = cond(compute_status(1, deps, now=NOW), "DecoderReady")
    assert c["reason"] == "ScaledToZero"
    assert "cannot serve" in c["message"]


def test_a_role_that_scales_to_zero_is_ready_at_zero_while_idle() -> None:
    deps = all_ready()
    deps["decoder"] = deployment("p-decoder", desired=0, ready=0)
    status = compute_status(1, deps, now=NOW, scaling_to_zero={"decoder"})
    c = cond(status, "DecoderReady")
    assert (c["status"], c["reason"]) == ("True", "IdleAtZero") and "the first request" in c["message"]
    assert status["phase"] == "Ready" and status["decoder"]["ready"] == "0/0"
    deps["decoder"] = deployment("p-decoder", desired=1, ready=0)  # woken: waiting for its pod like any role
    assert cond(compute_status(1, deps, now=NOW, scaling_to_zero={"decoder"}), "DecoderReady")["reason"] == (
        "WaitingForPods"
    )


def test_transition_time_changes_only_when_status_flips() -> None:
    first = compute_status(1, all_ready(), now=NOW)
    again = compute_status(1, all_ready(), previous_conditions=first["conditions"], now=LATER)
    assert again == first
    deps = all_ready()
    deps["head"] = deployment("p-head", ready=0)
    flipped = compute_status(1, deps, previous_conditions=first["conditions"], now=LATER)
    assert cond(flipped, "HeadReady")["lastTransitionTime"] == LATER
    assert cond(flipped, "EncoderReady")["lastTransitionTime"] == NOW


def test_a_refused_child_is_degraded_with_the_servers_words() -> None:
    status = compute_status(1, all_ready(), apply_error="Deployment p-head: exceeded quota", now=NOW)
    assert status["phase"] == "Degraded"
    degraded = cond(status, "Degraded")
    assert (degraded["reason"], degraded["status"]) == ("ApplyFailed", "True")
    assert "exceeded quota" in degraded["message"]


def pod(name: str, **status: Any) -> dict:
    return {"metadata": {"name": name}, "status": status}


def test_an_unschedulable_pod_is_degraded_with_the_schedulers_words() -> None:
    deps = all_ready()
    deps["decoder"] = deployment("p-decoder", ready=0)
    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient rdma/ib.",
    }
    pods = {"decoder": [pod("p-decoder-x", phase="Pending", conditions=[unschedulable])]}
    status = compute_status(1, deps, pods, now=NOW)
    assert status["phase"] == "Degraded"
    decoder = cond(status, "DecoderReady")
    assert decoder["reason"] == "Unschedulable"
    assert decoder["message"] == (
        "p-decoder: 0/1 pods ready; pod p-decoder-x cannot be scheduled: "
        "0/3 nodes are available: 3 Insufficient rdma/ib."
    )
    assert cond(status, "Degraded")["reason"] == "Unschedulable"


def test_a_crash_looping_container_names_the_pod_and_container() -> None:
    deps = all_ready()
    deps["head"] = deployment("p-head", ready=0)
    waiting = {"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting failed container"}
    crashing = pod("p-head-y", containerStatuses=[{"name": "head", "state": {"waiting": waiting}}])
    head = cond(compute_status(1, deps, {"head": [crashing]}, now=NOW), "HeadReady")
    assert head["reason"] == "CrashLoopBackOff"
    assert "pod p-head-y container head is CrashLoopBackOff: back-off" in head["message"]


def crash_looping_denoiser(refusal: str) -> dict[str, Any]:
    """A denoiser pod in CrashLoopBackOff whose last run exited 2 saying `refusal`."""
    waiting = {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}
    last = {"terminated": {"exitCode": 2, "reason": "Error", "message": refusal}}
    return pod("p-denoiser-z", containerStatuses=[{"name": "denoiser", "state": {"waiting": waiting},
                                                   "lastState": last}])  # fmt: skip


def test_a_worker_that_refuses_its_parallelism_is_degraded_naming_the_cr_field() -> None:
    deps = all_ready()
    deps["denoiser"] = deployment("p-denoiser", ready=0)
    refusal = (
        "W1201 topology.cpp:201] No RDMA devices found\n"
        "triptych: error: --cfg-parallel-size 2: flux uses embedded guidance (one transformer pass per step), "
        "there are no two guidance branches to split; use --denoiser-ulysses/--denoiser-ring instead\n"
    )
    crashing = crash_looping_denoiser(refusal)
    status = compute_status(1, deps, {"denoiser": [crashing]}, now=NOW)
    assert status["phase"] == "Degraded"
    degraded = cond(status, "Degraded")
    assert degraded["reason"] == "CrashLoopBackOff"
    assert "it exits with: --cfg-parallel-size 2: flux uses embedded guidance" in degraded["message"]
    assert degraded["message"].endswith("(set by spec.denoiser.parallelism.cfg)")


def test_a_worker_whose_adapter_path_holds_nothing_is_degraded_naming_spec_model_loras() -> None:
    deps = all_ready()
    deps["denoiser"] = deployment("p-denoiser", ready=0)
    refusal = (
        "triptych: error: --lora-catalog /etc/triptych/loras/loras.txt: ink=/models/ink: /models/ink does not exist "
        "on this denoiser (give a folder holding pytorch_lora_weights.safetensors, a .safetensors file or a hub id "
        "such as owner/name, or remove the entry)\n"
    )  # what triptych.lora.LoraCatalog.check_sources makes the process say (tests/unit/test_lora_sources.py)
    crashing = crash_looping_denoiser(refusal)
    degraded = cond(compute_status(1, deps, {"denoiser": [crashing]}, now=NOW), "Degraded")
    exits = "it exits with: --lora-catalog /etc/triptych/loras/loras.txt: ink=/models/ink: /models/ink does not"
    assert exits in degraded["message"]
    assert degraded["message"].endswith("(set by spec.model.loras)")


def test_a_pod_still_starting_is_just_waiting() -> None:
    deps = all_ready()
    deps["encoder"] = deployment("p-encoder", ready=0)
    starting = pod(
        "p-encoder-z", containerStatuses=[{"name": "encoder", "state": {"waiting": {"reason": "ContainerCreating"}}}]
    )
    status = compute_status(1, deps, {"encoder": [starting]}, now=NOW)
    assert status["phase"] == "Progressing"
    assert cond(status, "EncoderReady")["reason"] == "WaitingForPods"
