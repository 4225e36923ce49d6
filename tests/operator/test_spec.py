"""Spec parsing and validation: a bad field is reported by its path with what to do."""

from __future__ import annotations

import pytest

from tests.operator.helpers import NAMESPACE, minimal_spec, pipeline
from triptych.parallelism import Parallelism
from triptych.roles import Role
from triptych_operator.spec.model import SpecError
from triptych_operator.spec.rules import parse_pipeline


def error_for(spec: dict, name: str = "p") -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_pipeline(name, NAMESPACE, spec)
    return info.value


def test_defaults_give_one_single_gpu_replica_per_role_over_tcp() -> None:
    p = pipeline(minimal_spec())
    for role in (Role.ENCODER, Role.DENOISER, Role.DECODER):
        assert p.roles[role].replicas == 1
        assert p.roles[role].gpus_per_replica == 1
        assert p.roles[role].parallelism == Parallelism()
    assert p.transfer.mode == "tcp"
    assert p.head.dispatch_policy == "round_robin"
    assert p.model.model_path == "/models/tiny"


def test_unset_degrees_are_derived_from_the_gpu_count() -> None:
    p = pipeline(minimal_spec(denoiser={"gpusPerReplica": 4, "parallelism": {"tp": 2}}))
    assert p.roles[Role.DENOISER].parallelism == Parallelism(tp=2, sp=2, ulysses=2, ring=1, cfg=1)
    assert p.roles[Role.DENOISER].explicit_degrees == {"tp": 2}


def test_degrees_whose_product_is_not_the_gpu_count_are_rejected_with_the_field() -> None:
    err = error_for(minimal_spec(denoiser={"gpusPerReplica": 4, "parallelism": {"tp": 2, "sp": 4}}))
    assert err.field == "spec.denoiser.parallelism"
    assert str(err).startswith("spec.denoiser.parallelism: tp=2 x sp=4 x cfg=1 = 8, but the role has 4 GPUs")


def test_ulysses_times_ring_must_equal_sp() -> None:
    err = error_for(minimal_spec(denoiser={"gpusPerReplica": 4, "parallelism": {"sp": 4, "ulysses": 2, "ring": 1}}))
    assert "ulysses=2 x ring=1 must equal sp=4" in str(err)


def test_ulysses_is_only_for_the_denoiser() -> None:
    err = error_for(minimal_spec(encoder={"gpusPerReplica": 2, "parallelism": {"ulysses": 2}}))
    assert err.field == "spec.encoder.parallelism.ulysses"
    assert "apply to the denoiser only" in str(err)


def test_model_needs_exactly_one_source() -> None:
    spec = minimal_spec()
    spec["model"]["hubId"] = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert error_for(spec).field == "spec.model"
    assert error_for({"model": {"path": "x"}}).field == "spec.model.volume"


def test_model_path_cannot_leave_the_volume() -> None:
    spec = minimal_spec()
    spec["model"]["path"] = "../etc"
    assert error_for(spec).field == "spec.model.path"


def on_host(path: str) -> dict:
    return {"model": {"path": "tiny", "volume": {"hostPath": {"path": path}}}}


@pytest.mark.parametrize("path", ["/", "//", "models", "models/tiny", "/models/../etc", "/models/..", "/./", "/a//b"])
def test_a_host_path_that_is_not_an_absolute_folder_below_the_root_is_refused_naming_it(path: str) -> None:
    err = error_for(on_host(path))
    assert err.field == "spec.model.volume.hostPath.path"
    assert f"is {path!r}; path must be an absolute folder other than /" in str(err)


# "/srv/..\n": a folder named "..\n", which the API server's rule (RE2: `$` is the end of the text) takes;
# the parser must agree (Python's `$` also matches before a final newline, and refused it).
@pytest.mark.parametrize("path", ["/var/lib/triptych/models", "/mnt/models/", "/srv/.models/m..1", "/srv/..\n"])
def test_absolute_host_folders_are_taken(path: str) -> None:
    assert pipeline(on_host(path)).model.host_path == path


ALLOWED = ("/var/lib/triptych/models", "/mnt/models/")


@pytest.mark.parametrize("path", ["/var/lib/triptych/models", "/var/lib/triptych/models/flux", "/mnt/models"])
def test_with_an_allow_list_a_host_path_under_a_listed_folder_is_taken(path: str) -> None:
    spec = parse_pipeline("p", NAMESPACE, on_host(path), allowed_host_paths=ALLOWED)
    assert spec.model.host_path == path


@pytest.mark.parametrize("path", ["/etc", "/var/lib/triptych/models-other", "/var/lib/triptych", "/mnt/modelsx/a"])
def test_with_an_allow_list_any_other_host_path_is_refused_naming_the_field_the_value_and_the_list(path: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_pipeline("p", NAMESPACE, on_host(path), allowed_host_paths=ALLOWED)
    assert info.value.field == "spec.model.volume.hostPath.path"
    assert f"{path!r} is not under a folder this cluster allows for hostPath volumes" in str(info.value)
    assert "/var/lib/triptych/models, /mnt/models/" in str(info.value)
    assert "persistentVolumeClaim" in str(info.value)  # what to do instead


def test_an_allow_list_leaves_a_model_on_a_claim_or_the_hub_alone() -> None:
    assert parse_pipeline("p", NAMESPACE, minimal_spec(), allowed_host_paths=ALLOWED).model.pvc_claim_name == "models"
    hub = {"model": {"hubId": "black-forest-labs/FLUX.1-dev"}}
    assert (
        parse_pipeline("p", NAMESPACE, hub, allowed_host_paths=ALLOWED).model.hub_id == "black-forest-labs/FLUX.1-dev"
    )


def test_hub_model_uses_the_hub_id_as_model_path() -> None:
    p = pipeline({"model": {"hubId": "black-forest-labs/FLUX.1-dev", "tokenSecretRef": {"name": "hf"}}})
    assert p.model.model_path == "black-forest-labs/FLUX.1-dev"
    assert (p.model.token_secret_name, p.model.token_secret_key) == ("hf", "token")


def test_rdma_needs_an_ib_device() -> None:
    err = error_for(minimal_spec(transfer={"mode": "rdma"}))
    assert err.field == "spec.transfer.ibDevice"


def test_pool_size_accepts_sizes_and_rejects_garbage() -> None:
    assert pipeline(minimal_spec(transfer={"poolSize": "1GiB"})).transfer.pool_size == 1 << 30
    assert error_for(minimal_spec(transfer={"poolSize": "lots"})).field == "spec.transfer.poolSize"


def test_negative_replicas_are_rejected() -> None:
    err = error_for(minimal_spec(decoder={"replicas": -1}))
    assert str(err) == "spec.decoder.replicas: is -1; it must be >= 0"


def test_unknown_dispatch_policy_lists_the_choices() -> None:
    err = error_for(minimal_spec(head={"dispatchPolicy": "random"}))
    assert str(err) == "spec.head.dispatchPolicy: is 'random'; choose one of round_robin, max_free_slots"


def test_autoscaling_min_above_max_is_rejected() -> None:
    spec = minimal_spec(denoiser={"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}})
    err = error_for(spec)
    assert str(err) == "spec.denoiser.autoscaling: minReplicas must be <= maxReplicas"  # the CEL rule's message


def test_a_second_head_without_shared_results_is_rejected_saying_what_to_do() -> None:
    err = error_for(minimal_spec(head={"replicas": 2}))
    assert err.field == "spec.head.replicas"
    assert "spec.head.results.s3" in str(err) and "spec.head.results.persistentVolumeClaim" in str(err)


def test_http_port_cannot_collide_with_scheduler_ports() -> None:
    assert error_for(minimal_spec(head={"port": 5557})).field == "spec.head.port"


@pytest.mark.parametrize("name", ["Upper", "a.b", "x" * 60])
def test_names_that_cannot_prefix_service_names_are_rejected(name: str) -> None:
    assert error_for(minimal_spec(), name=name).field == "metadata.name"


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"drainSeconds": 10}, "spec.denoiser.drainSeconds"),
        ({"autoscaling": {"enabled": True, "maxReplicas": 2, "targetWorkSecondsPerReplica": 0}}, "targetWorkSeconds"),
        ({"autoscaling": {"enabled": True, "maxReplicas": 2, "scaleDownStabilizationSeconds": 4000}}, "scaleDown"),
    ],
    ids=["drain-below-margin", "zero-target", "window-above-hpa-limit"],
)
def test_autoscaling_and_drain_bounds(section: dict, field: str) -> None:
    with pytest.raises(SpecError, match=field):
        pipeline(minimal_spec(denoiser=section))


@pytest.mark.parametrize(
    ("head", "field"),
    [
        ({"drainSeconds": 30}, "spec.head.drainSeconds"),
        ({"results": {"maxBytes": "lots"}}, "spec.head.results.maxBytes"),
        ({"results": {"maxAgeSeconds": 0}}, "spec.head.results.maxAgeSeconds"),
    ],
)
def test_head_drain_and_results_fields_are_checked_naming_the_field(head: dict, field: str) -> None:
    assert error_for(minimal_spec(head=head)).field == field


def test_api_keys_secret_needs_a_name_and_its_key_defaults_to_keys() -> None:
    assert error_for(minimal_spec(head={"apiKeysSecret": {"key": "k"}})).field == "spec.head.apiKeysSecret.name"
    assert error_for(minimal_spec(head={"tls": {}})).field == "spec.head.tls.secretName"
    assert error_for(minimal_spec(head={"tls": {"secretName": ""}})).field == "spec.head.tls.secretName"
    assert pipeline(minimal_spec(head={"tls": {"secretName": "t"}})).head.tls_secret_name == "t"
    ref = pipeline(minimal_spec(head={"apiKeysSecret": {"name": "dp-keys"}})).head.api_keys_secret
    assert ref is not None and (ref.name, ref.key) == ("dp-keys", "keys")
    assert pipeline(minimal_spec()).head.api_keys_secret is None


def test_zero_gpus_per_replica_makes_a_cpu_role_of_one_device() -> None:
    p = pipeline(minimal_spec(encoder={"gpusPerReplica": 0}, decoder={"gpusPerReplica": 0}))
    encoder, denoiser = p.roles[Role.ENCODER], p.roles[Role.DENOISER]
    assert (encoder.gpus_per_replica, encoder.device, encoder.num_devices) == (0, "cpu", 1)
    assert encoder.parallelism == Parallelism()
    assert (denoiser.device, denoiser.num_devices) == ("cuda", 1)


def test_a_cpu_role_takes_no_parallel_degree_above_one() -> None:
    err = error_for(minimal_spec(denoiser={"gpusPerReplica": 0, "parallelism": {"tp": 2}}))
    assert err.field == "spec.denoiser.parallelism.tp"
    assert "gpusPerReplica 0 runs the role on CPU" in str(err)
    p = pipeline(minimal_spec(denoiser={"gpusPerReplica": 0, "parallelism": {"sp": 1}}))
    assert p.roles[Role.DENOISER].parallelism == Parallelism()


def test_negative_gpus_per_replica_is_rejected_with_the_field() -> None:
    err = error_for(minimal_spec(decoder={"gpusPerReplica": -1}))
    assert err.field == "spec.decoder.gpusPerReplica"
    assert "must be >= 0" in str(err)


def test_without_an_encoder_shape_the_pipeline_runs_the_combined_encoder() -> None:
    assert list(pipeline(minimal_spec()).roles) == [Role.ENCODER, Role.DENOISER, Role.DECODER]


def test_split_encoders_replace_the_combined_one_with_their_own_settings() -> None:
    p = pipeline(minimal_spec(promptEncoder={"replicas": 2}, imageEncoder={"gpusPerReplica": 0}))
    assert list(p.roles) == [Role.PROMPT_ENCODER, Role.IMAGE_ENCODER, Role.DENOISER, Role.DECODER]
    assert p.roles[Role.PROMPT_ENCODER].replicas == 2 and p.roles[Role.IMAGE_ENCODER].gpus_per_replica == 0
    assert list(pipeline(minimal_spec(promptEncoder={})).roles) == [Role.PROMPT_ENCODER, Role.DENOISER, Role.DECODER]


def test_both_encoder_shapes_or_an_image_encoder_alone_are_rejected_naming_the_field() -> None:
    assert error_for(minimal_spec(encoder={}, promptEncoder={})).field == "spec.encoder"
    assert error_for(minimal_spec(imageEncoder={})).field == "spec.promptEncoder"


def test_split_encoder_errors_name_their_camel_case_field() -> None:
    err = error_for(minimal_spec(promptEncoder={"parallelism": {"ulysses": 2}, "gpusPerReplica": 2}))
    assert err.field.startswith("spec.promptEncoder")


def test_names_too_long_for_the_split_encoder_services_are_rejected() -> None:
    assert error_for(minimal_spec(promptEncoder={}), name="a" * 50).field == "metadata.name"
    pipeline(minimal_spec(), name="a" * 50)  # the three-role shape's Services fit


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"denoiser": {"batching": {"maxSize": 0}}}, "denoiser.batching.maxSize: is 0; it must be between 1 and 256"),
        ({"head": {"batching": {"delayMs": -5}}}, "head.batching.delayMs: is -5; it must be between 0 and 10000"),
    ],
)
def test_batching_bounds_name_the_field(section: dict, message: str) -> None:
    assert str(error_for(minimal_spec(**section))) == f"spec.{message}"


def test_batching_defaults_to_none_and_the_spec_heads_delay() -> None:
    p = pipeline(minimal_spec(encoder={"batching": {}}))
    assert {spec.batch_max_size for spec in p.roles.values()} == {1}
    assert p.head.batch_delay_ms == 30


def test_an_ingress_annotation_that_is_not_a_string_is_rejected_naming_it() -> None:
    head = {"ingress": {"enabled": True, "host": "a.example.com", "annotations": {"x/timeout": 30}}}
    err = error_for(minimal_spec(head=head))
    assert err.field.startswith("spec.head.ingress.annotations"), err


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"transfer": {"mode": "rdma", "ibDevice": ""}}, "spec.transfer.ibDevice"),
        ({"head": {"ingress": {"enabled": True, "host": ""}}}, "spec.head.ingress.host"),
    ],
    ids=["rdma-ib-device", "ingress-host"],
)
def test_an_empty_string_is_not_a_required_value(section: dict, field: str) -> None:
    err = error_for(minimal_spec(**section))
    assert err.field == field
    assert "must not be empty" in str(err)


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ({"hubId": ""}, "spec.model.hubId"),
        ({"hubId": "org/x", "tokenSecretRef": {"name": ""}}, "spec.model.tokenSecretRef.name"),
    ],
    ids=["hub-id", "token-secret"],
)
def test_an_empty_model_source_or_token_secret_is_refused(model: dict, field: str) -> None:
    err = error_for({"model": model})
    assert err.field == field
    assert "must not be empty" in str(err)


@pytest.mark.parametrize("hub_id", ["not a hub id!!", "org", "/x", "org/x/y", "org/x\n", "ørg/x"])
def test_a_hub_id_that_triptych_serve_would_not_take_is_refused(hub_id: str) -> None:
    err = error_for({"model": {"hubId": hub_id}})
    assert err.field == "spec.model.hubId"
    assert repr(hub_id) in str(err)


@pytest.mark.parametrize("hub_id", ["black-forest-labs/FLUX.1-dev", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "a/b_c"])
def test_hub_ids_like_org_name_are_taken(hub_id: str) -> None:
    assert pipeline({"model": {"hubId": hub_id}}).model.model_path == hub_id


@pytest.mark.parametrize(
    ("section", "field", "message"),
    [
        ({"encoder": {"gpusPerReplica": 2}}, "spec.encoder.gpusPerReplica", "an encoder runs on one device"),
        (
            {"promptEncoder": {"gpusPerReplica": 2, "parallelism": {"cfg": 2}}},
            "spec.promptEncoder.gpusPerReplica",
            "an encoder runs on one device",
        ),
        (
            {"promptEncoder": {}, "imageEncoder": {"gpusPerReplica": 2, "parallelism": {"sp": 2}}},
            "spec.imageEncoder.gpusPerReplica",
            "an encoder runs on one device",
        ),
        (
            {"decoder": {"gpusPerReplica": 2, "parallelism": {"tp": 2}}},
            "spec.decoder.parallelism.tp",
            "the decoder splits its work by sp only",
        ),
        (
            {"decoder": {"gpusPerReplica": 2, "parallelism": {"cfg": 2}}},
            "spec.decoder.parallelism.cfg",
            "the decoder splits its work by sp only",
        ),
        (
            {"denoiser": {"gpusPerReplica": 8, "parallelism": {"cfg": 4}}},
            "spec.denoiser.parallelism.cfg",
            "at most 2 guidance branches",
        ),
        (
            {"fullPipeline": {"gpusPerReplica": 4, "parallelism": {"cfg": 4}}},
            "spec.fullPipeline.parallelism.cfg",
            "at most 2 guidance branches",
        ),
    ],
    ids=["encoder-gpus", "prompt-encoder-cfg", "image-encoder-sp", "decoder-tp", "decoder-cfg", "cfg-4", "full-cfg-4"],
)
def test_layouts_every_worker_refuses_whatever_the_family_are_refused_naming_the_field(
    section: dict, field: str, message: str
) -> None:
    err = error_for(minimal_spec(**section))
    assert err.field == field
    assert message in str(err)


def test_the_layouts_workers_run_are_still_taken() -> None:
    p = pipeline(
        minimal_spec(
            encoder={"gpusPerReplica": 1},
            denoiser={"gpusPerReplica": 4, "parallelism": {"cfg": 2}},
            decoder={"gpusPerReplica": 2, "parallelism": {"sp": 2, "tp": 1}},
        )
    )
    assert p.roles[Role.DENOISER].parallelism.cfg == 2
    assert p.roles[Role.DECODER].parallelism.sp == 2


@pytest.mark.parametrize(
    ("size", "expected"),
    [("256Mi", 256 << 20), ("1Gi", 1 << 30), ("256MiB", 256 << 20), ("512M", 512 << 20), ("2097152", 2 << 20)],
)
def test_sizes_are_read_as_kubernetes_and_triptych_write_them(size: str, expected: int) -> None:
    assert pipeline(minimal_spec(transfer={"poolSize": size})).transfer.pool_size == expected
    assert pipeline(minimal_spec(head={"results": {"maxBytes": size}})).head.results.max_bytes == expected


@pytest.mark.parametrize("size", ["0", "0Mi", "000", 0, -5, "-5", "256 MiB", "256mib", "1.5Gi", True, 1.5])
def test_a_size_below_one_byte_or_of_another_shape_is_refused_as_the_crd_refuses_it(size: object) -> None:
    assert error_for(minimal_spec(head={"results": {"maxBytes": size}})).field == "spec.head.results.maxBytes"
    assert error_for(minimal_spec(transfer={"poolSize": size})).field == "spec.transfer.poolSize"


@pytest.mark.parametrize("section", [{"head": {"drainSeconds": 10**10}}, {"denoiser": {"drainSeconds": 10**10}}])
def test_drain_seconds_have_a_maximum(section: dict) -> None:
    err = error_for(minimal_spec(**section))
    assert err.field.endswith(".drainSeconds")
    assert "86400" in str(err)


@pytest.mark.parametrize(
    ("paths", "field", "says"),
    [
        ([{"path": "v1"}], "spec.head.ingress.paths[0].path", "is 'v1'; path must start with '/'"),
        ([{"path": "/v1"}, {"path": "//v1"}], "spec.head.ingress.paths[1].path", "is '//v1'"),
        ([{"path": "/v1/../metrics"}], "spec.head.ingress.paths[0].path", "is '/v1/../metrics'"),
        ([{"path": "/v1%2Fmetrics"}], "spec.head.ingress.paths[0].path", "'%2F'"),
        ([{"path": "/v1"}, {"path": "/v1", "pathType": "Exact"}], "spec.head.ingress.paths[1].path", "'/v1' twice"),
        ([], "spec.head.ingress.paths", "must list at least 1"),
        ([{"path": "/v1", "pathType": "ImplementationSpecific"}], "spec.head.ingress.paths[0].pathType", "Prefix"),
    ],
    ids=["relative", "double-slash", "dot-dot", "encoded-slash", "duplicate", "empty", "other-path-type"],
)
def test_an_ingress_path_the_ingress_would_not_take_is_refused_naming_it(paths: list, field: str, says: str) -> None:
    err = error_for(minimal_spec(head={"ingress": {"enabled": True, "host": "h.example.com", "paths": paths}}))
    assert err.field == field
    assert says in str(err)
