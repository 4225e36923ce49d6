"""No `triptych serve` flag is silently ignored: every flag of `--help` is either refused by each role
that does not take it (triptych.flag_roles) or, for the roles that do, has a test of its effect named
here, or is listed UNTESTED with the reason. A flag added to add_serve_flags without an entry in
SAMPLE and in TESTED or UNTESTED fails this file."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from triptych.config import MIB, ConfigError, ServeArgs
from triptych.flag_roles import roles_taking
from triptych.roles import WORKER_ROLES, Role
from triptych.serve_flags import add_serve_flags

ROOT = Path(__file__).resolve().parents[2]


def serve_flags() -> list[str]:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]


def attr(name: str) -> str:
    return name[2:].replace("-", "_")


# A non-default value of each flag, valid on its own, to give a role that does not take it.
SAMPLE: dict[str, Any] = {
    "--model-path": "other",
    "--served-model-name": "x",
    "--disagg-role": None,  # the role itself: every process takes it
    "--disagg-server-addr": "tcp://127.0.0.1:9",
    "--scheduler-port": 6000,
    "--num-gpus": 2,
    "--base-gpu-id": 1,
    **{f"--{r.value.replace('_', '-')}-urls": ["tcp://127.0.0.1:9"] for r in WORKER_ROLES},
    "--host": "127.0.0.2",
    "--port": 31000,
    "--disagg-p2p-hostname": "127.0.0.2",
    "--disagg-ib-device": "mlx5_0",
    "--disagg-transfer-pool-size": 2 * MIB,
    "--disagg-transfer-listen-any": True,
    "--disagg-full-pipeline": True,
    "--disagg-load-ahead": 0,
    "--encoder-cache-bytes": 1,
    "--disagg-timeout": 5.0,
    "--disagg-dispatch-policy": "max_free_slots",
    "--disagg-heartbeat-timeout": 3.0,
    "--disagg-discovery-interval": 1.0,
    "--disagg-max-retries": 0,
    "--disagg-no-instance-wait": 1.0,
    "--disagg-migration": "off",
    "--disagg-preemption": "off",
    "--disagg-priority-aging": 5.0,
    "--master-port": 29600,
    "--output-path": "elsewhere",
    "--results-max-age": 1.0,
    "--results-max-bytes": 1,
    "--results-store": "s3://bucket/prefix",
    "--results-s3-endpoint": "http://s3:8333",
    "--results-presign": 60,
    "--device": "cpu",
    "--dtype": "bfloat16",
    "--tp-size": 2,
    "--sp-degree": 2,
    "--cfg-parallel-size": 2,
    "--encoder-tp": 2,
    "--denoiser-tp": 2,
    "--denoiser-sp": 2,
    "--denoiser-ulysses": 2,
    "--denoiser-ring": 2,
    "--decoder-sp": 2,
    "--worker-capacity": 3,
    "--log-level": "debug",
    "--log-format": "json",
    "--disagg-drain-timeout": 1.0,
    "--api-keys-file": "/keys",
    "--max-request-bytes": 2048,
    "--access-log": True,
    "--webhook-url": "https://hooks.example.com/triptych",
    "--webhook-secret-file": "/secrets/webhook",
    "--max-queued-requests": 3,
    "--ssl-certfile": "/tls/head.crt",
    "--ssl-keyfile": "/tls/head.key",
    "--reference-url-networks": "10.0.0.0/8",
    "--batching-mode": "dynamic",
    "--batching-max-size": 2,
    "--batching-delay-ms": 5.0,
    "--batching-role-delay-ms": "encoder=5,denoiser=50",
    "--enable-batching-metrics": True,
    "--simulate": True,
    "--simulate-seconds": 1.0,
    "--simulate-seconds-per-unit": 1.0,
    "--disagg-keys-dir": "/keys-dir",
    "--disagg-insecure": True,
    "--otlp-endpoint": "http://collector:4318",
    "--lora": ["ink=/adapters/ink"],
    "--lora-catalog": "/adapters/catalog.txt",
    "--lora-cache-bytes": 1,
}

# flag -> the test that exercises its effect in a role that takes it (not only its parsing).
TESTED: dict[str, str] = {
    "--lora": "tests/e2e/test_lora.py::test_adapters_equal_stock_disaggregated_and_monolithic",
    "--lora-catalog": "tests/e2e/test_lora.py::test_an_adapter_added_to_the_catalog_file_is_served_without_a_restart",
    "--lora-cache-bytes": "tests/worker/test_lora.py::"
    "test_the_cache_unloads_the_least_recently_used_adapter_when_its_bytes_run_out",
    "--model-path": "tests/unit/test_model_source.py::test_serve_exits_with_one_line_for_a_bad_model_path",
    "--served-model-name": "tests/unit/test_flags_honoured.py::test_served_model_name_is_a_name_requests_may_use",
    "--disagg-role": "tests/unit/test_simulated.py::test_a_simulated_worker_process_never_imports_torch",
    "--disagg-server-addr": "tests/unit/test_worker_runtime.py::"
    "test_a_computing_worker_keeps_answering_and_runs_queued_work_in_order_one_at_a_time",
    "--scheduler-port": "tests/unit/test_design_rules.py::test_the_master_port_defaults_to_the_work_port_plus_50",
    "--num-gpus": "tests/unit/test_parallel_degrees.py::test_the_wan_decoder_splits_over_sp_ranks",
    "--base-gpu-id": "tests/unit/test_config.py::test_base_gpu_id_picks_the_cuda_device",
    "--encoder-urls": "tests/unit/test_design_rules.py::test_encoder_urls_exclude_the_split_encoders",
    "--prompt-encoder-urls": "tests/unit/test_design_rules.py::test_encoder_urls_exclude_the_split_encoders",
    "--image-encoder-urls": "tests/e2e/test_split_encoders.py::"
    "test_split_encoder_workers_started_before_the_head_serve_several_instances",
    "--denoiser-urls": "tests/unit/test_design_rules.py::test_encoder_urls_exclude_the_split_encoders",
    "--decoder-urls": "tests/unit/test_design_rules.py::test_encoder_urls_exclude_the_split_encoders",
    "--disagg-p2p-hostname": "tests/e2e/test_prefork.py::"
    "test_a_forked_worker_runs_confined_to_loopback_and_dies_by_its_signal",
    "--disagg-transfer-pool-size": "tests/transfer/test_pool.py::"
    "test_payload_larger_than_pool_raises_with_the_flag_and_role",
    "--disagg-transfer-listen-any": "tests/transfer/test_bind_shim.py::"
    "test_a_worker_given_listen_any_leaves_mooncake_on_every_address",
    "--disagg-full-pipeline": "tests/e2e/test_full_pipeline.py::test_a_worker_of_the_other_topology_gets_no_work",
    "--disagg-load-ahead": "tests/unit/test_worker_runtime.py::"
    "test_the_next_requests_inputs_leave_their_slot_while_the_current_one_computes",
    "--encoder-cache-bytes": "tests/worker/test_encoder_cache.py::"
    "test_an_entry_larger_than_the_bound_or_a_zero_bound_keeps_nothing",
    "--disagg-timeout": "tests/e2e/test_null_pipeline.py::"
    "test_a_request_past_the_timeout_is_timed_out_and_its_capacity_released",
    "--disagg-dispatch-policy": "tests/unit/test_state_and_dispatch.py::test_max_free_slots_picks_the_emptiest",
    "--disagg-heartbeat-timeout": "tests/unit/test_head_core.py::"
    "test_a_dead_encoder_is_found_by_the_clock_and_its_request_goes_to_the_other_one",
    "--disagg-max-retries": "tests/unit/test_server_membership.py::"
    "test_a_request_out_of_retries_fails_naming_the_lost_worker",
    "--disagg-no-instance-wait": "tests/unit/test_server_membership.py::"
    "test_requests_fail_when_their_role_has_had_no_ready_instance_for_the_wait",
    "--disagg-migration": "tests/unit/test_head_core.py::"
    "test_with_migration_off_a_draining_denoiser_finishes_its_requests_in_place",
    "--disagg-preemption": "tests/unit/test_preemption.py::"
    "test_with_preemption_off_a_high_request_waits_for_the_low_one_to_finish",
    "--disagg-priority-aging": "tests/unit/test_preemption.py::"
    "test_aging_raises_a_waiting_request_one_level_per_aging_period_so_none_starves",
    "--master-port": "tests/unit/test_design_rules.py::test_the_master_port_defaults_to_the_work_port_plus_50",
    "--output-path": "tests/s3/test_shared_results.py::test_a_directory_the_head_cannot_write_stops_it_at_start_up",
    "--results-max-age": "tests/api/test_results.py::"
    "test_retention_removes_results_older_than_the_max_age_with_all_their_files",
    "--results-max-bytes": "tests/api/test_results.py::"
    "test_retention_removes_the_oldest_results_until_the_total_fits_and_keeps_running_jobs",
    "--results-store": "tests/s3/test_shared_results.py::test_two_head_processes_serve_each_others_video_jobs",
    "--results-s3-endpoint": "tests/s3/test_shared_results.py::test_two_head_processes_serve_each_others_video_jobs",
    "--results-presign": "tests/s3/test_shared_results.py::"
    "test_presigned_urls_let_clients_fetch_images_and_videos_from_the_bucket_itself",
    "--device": "tests/unit/test_config.py::test_base_gpu_id_picks_the_cuda_device",
    "--dtype": "tests/worker/test_dtypes.py::"
    "test_bfloat16_roles_over_the_wire_equal_monolithic_and_the_stock_bfloat16_pipeline",
    "--tp-size": "tests/unit/test_design_rules.py::test_role_flags_win_over_the_generic_tp_size_and_sp_degree",
    "--sp-degree": "tests/unit/test_design_rules.py::test_role_flags_win_over_the_generic_tp_size_and_sp_degree",
    "--cfg-parallel-size": "tests/unit/test_parallel_degrees.py::test_a_combination_the_family_runs_is_accepted",
    "--encoder-tp": "tests/unit/test_flags_honoured.py::test_a_roles_own_degree_reaches_its_parallelism",
    "--denoiser-tp": "tests/e2e/test_parallel_ranks.py::"
    "test_two_rank_tp_denoiser_holds_half_the_weights_and_is_within_the_tp_tolerance",
    "--denoiser-sp": "tests/e2e/test_parallel_roles.py::"
    "test_launch_pool_disagg_server_runs_the_specs_example_as_written",
    "--denoiser-ulysses": "tests/e2e/test_parallel_ranks.py::test_ulysses2_ring2_denoiser_is_within_the_ring_tolerance",
    "--denoiser-ring": "tests/e2e/test_parallel_ranks.py::test_ulysses2_ring2_denoiser_is_within_the_ring_tolerance",
    "--decoder-sp": "tests/unit/test_flags_honoured.py::test_a_roles_own_degree_reaches_its_parallelism",
    "--worker-capacity": "tests/e2e/test_replicated_heads.py::"
    "test_two_heads_share_the_workers_each_request_gets_stock_pixels_and_no_worker_exceeds_capacity",
    "--disagg-drain-timeout": "tests/unit/test_server_drain.py::"
    "test_a_drain_fails_what_is_left_at_the_deadline_releasing_its_slots_and_ends_the_loop",
    "--api-keys-file": "tests/api/test_guards.py::test_a_missing_or_keyless_file_stops_the_head_naming_the_flag",
    "--max-request-bytes": "tests/e2e/test_http_guards.py::test_a_declared_oversized_body_is_refused_before_it_is_sent",
    "--access-log": "tests/e2e/test_access_log.py::test_a_head_with_access_log_logs_each_request_with_its_id",
    "--webhook-url": "tests/e2e/test_webhooks.py::test_a_head_posts_a_finished_video_job_signed_to_its_webhook",
    "--webhook-secret-file": "tests/e2e/test_webhooks.py::test_a_head_posts_a_finished_video_job_signed_to_its_webhook",
    "--log-format": "tests/e2e/test_access_log.py::test_with_log_format_json_every_line_of_the_processes_is_an_object",
    "--max-queued-requests": "tests/e2e/test_http_guards.py::"
    "test_beyond_the_bound_requests_get_429_with_retry_after_from_observed_stage_times",
    "--ssl-certfile": "tests/e2e/test_https.py::test_the_api_is_served_over_https_and_plain_http_is_not_answered",
    "--ssl-keyfile": "tests/e2e/test_https.py::test_the_api_is_served_over_https_and_plain_http_is_not_answered",
    "--reference-url-networks": "tests/unit/test_reference.py::"
    "test_urls_reach_public_addresses_and_the_listed_networks_only",
    "--batching-mode": "tests/unit/test_head_core.py::test_random_schedules_with_batching_keep_the_same_invariants",
    "--batching-max-size": "tests/e2e/test_batching.py::test_a_full_pipeline_worker_batches_through_the_same_stages",
    "--batching-delay-ms": "tests/unit/test_head_core.py::test_random_schedules_with_batching_keep_the_same_invariants",
    "--batching-role-delay-ms": "tests/unit/test_head_core.py::test_a_role_s_own_batching_delay_holds_its_groups_only",
    "--simulate": "tests/unit/test_simulated.py::"
    "test_a_simulated_denoiser_takes_its_modelled_time_reports_every_step_and_emits_latents",
    "--simulate-seconds": "tests/unit/test_simulated.py::"
    "test_flags_override_the_role_defaults_and_anything_else_keeps_them",
    "--simulate-seconds-per-unit": "tests/unit/test_simulated.py::"
    "test_flags_override_the_role_defaults_and_anything_else_keeps_them",
    "--disagg-keys-dir": "tests/unit/test_security.py::test_serve_exits_with_one_line_when_the_keys_cannot_be_read",
    "--disagg-insecure": "tests/unit/test_security.py::"
    "test_a_non_loopback_control_plane_without_keys_is_refused_naming_both_flags",
    "--otlp-endpoint": "tests/e2e/test_tracing.py::"
    "test_a_request_s_trace_has_a_span_per_hop_from_the_head_and_every_worker",
    # --host 0.0.0.0: the head is reached on 127.0.0.4, which a head bound to 127.0.0.1 does not answer
    "--host": "tests/e2e/test_reference_commands.py::test_several_machines_on_loopback_with_a_four_rank_denoiser",
    "--port": "tests/e2e/test_reference_commands.py::test_one_machine_as_written",
    "--disagg-ib-device": "tests/e2e/test_reference_commands.py::"
    "test_an_rdma_device_this_host_lacks_is_refused_at_start_up_in_one_line",
}

# Flags taken by some role with no test of their effect yet. Each says why.
UNTESTED: dict[str, str] = {
    "--disagg-discovery-interval": "re-reading is tested (test_discovery) at a fixed interval, not at this flag's",
    "--log-level": "no test reads the log level a process runs at",
    "--enable-batching-metrics": "parsing and rendering are tested; no test reads the histograms on /metrics",
}


def base(role: Role) -> dict[str, Any]:
    """The least a process of `role` needs to validate."""
    if role is Role.SERVER:
        return {"encoder_urls": ["tcp://127.0.0.1:1"], "denoiser_urls": ["tcp://127.0.0.1:2"],
                "decoder_urls": ["tcp://127.0.0.1:3"]}  # fmt: skip
    return {"disagg_server_addr": "tcp://127.0.0.1:6555"} if role.is_worker else {}


def test_every_flag_has_a_sample_and_a_test_or_says_why_not() -> None:
    flags = serve_flags()
    assert set(flags) == set(SAMPLE), "give each new flag a SAMPLE value (and a TESTED or UNTESTED entry)"
    assert set(TESTED).isdisjoint(UNTESTED)
    assert set(flags) == set(TESTED) | set(UNTESTED), sorted(set(flags) ^ (set(TESTED) | set(UNTESTED)))
    print("flags whose effect no test exercises:", ", ".join(sorted(UNTESTED)))


@pytest.mark.parametrize("name", sorted(TESTED))
def test_each_named_test_exists(name: str) -> None:
    path, _, function = TESTED[name].partition("::")
    text = (ROOT / path).read_text()
    assert re.search(rf"^(async )?def {function}\(", text, re.MULTILINE), f"{name}: no {TESTED[name]}"


@pytest.mark.parametrize("name", [n for n in sorted(SAMPLE) if SAMPLE[n] is not None])
def test_each_role_that_does_not_take_a_flag_refuses_it_naming_it(name: str) -> None:
    for role in set(Role) - roles_taking(name):
        args = ServeArgs(model_path="m", disagg_role=role, **{**base(role), attr(name): SAMPLE[name]})
        with pytest.raises(ConfigError) as refused:
            args.validate()
        assert name in str(refused.value), f"{role}: {refused.value}"


def test_every_role_takes_its_base_flags() -> None:
    for role in Role:
        ServeArgs(model_path="m", disagg_role=role, **base(role)).validate()


@pytest.mark.parametrize(
    ("role", "given", "says"),
    [
        (Role.MONOLITHIC, {"num_gpus": 2}, "--num-gpus is for worker roles"),
        (Role.MONOLITHIC, {"tp_size": 2}, "run the roles disaggregated (--disagg-role denoiser ...) for multi-device"),
        (Role.MONOLITHIC, {"denoiser_sp": 2}, "--denoiser-sp is for denoiser, not monolithic: monolithic mode runs"),
        (Role.ENCODER, {"port": 31000}, "--port is for the head (server or monolithic), not encoder"),
        (Role.DECODER, {"results_max_age": 1.0}, "--results-max-age is for the head (server or monolithic), not"),
        (Role.SERVER, {"worker_capacity": 3}, "--worker-capacity is for worker roles"),
        (Role.SERVER, {"disagg_transfer_pool_size": 2 * MIB}, "--disagg-transfer-pool-size is for worker roles"),
        (Role.ENCODER, {"decoder_sp": 2}, "--decoder-sp is for decoder, not encoder"),
        (Role.MONOLITHIC, {"disagg_dispatch_policy": "max_free_slots"}, "is for the head (--disagg-role server)"),
        (
            Role.SERVER,
            {"device": "cpu"},
            "--device is for monolithic, encoder, prompt_encoder, image_encoder, "
            "denoiser, decoder, not server: the head runs no model and uses no device; give --device to its workers",
        ),
        (Role.SERVER, {"device": "cuda"}, "--device is for monolithic,"),
    ],
)
def test_the_refusal_is_one_line_naming_flag_role_and_what_to_use(role: Role, given: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        ServeArgs(model_path="m", disagg_role=role, **{**base(role), **given}).validate()


def test_one_device_and_degrees_of_one_are_not_multi_device_and_pass_monolithic() -> None:
    ServeArgs(model_path="m", num_gpus=1, tp_size=1, sp_degree=1, cfg_parallel_size=1, denoiser_sp=1).validate()


def test_a_roles_own_degree_reaches_its_parallelism() -> None:
    """--encoder-tp and --decoder-sp set their role's degree (families may still refuse the layout at
    start-up: test_parallel_degrees)."""
    encoder = ServeArgs(model_path="m", disagg_role=Role.ENCODER, num_gpus=2, encoder_tp=2, **base(Role.ENCODER))
    assert encoder.parallelism().tp == 2
    decoder = ServeArgs(model_path="m", disagg_role=Role.DECODER, num_gpus=2, decoder_sp=2, **base(Role.DECODER))
    assert decoder.parallelism().sp == 2


def test_served_model_name_is_a_name_requests_may_use() -> None:
    from triptych.model_source import model_names

    assert model_names("/models/flux", "/models/flux", "my-flux")[0] == "my-flux"


def test_no_role_is_refused_a_flag_its_own_code_reads() -> None:
    # The table must not refuse a flag the worker or head code reads (a worker's heartbeat timeout on
    # its heads, its discovery interval): scan `args.<flag>` in each side's sources.
    import re
    from pathlib import Path

    from triptych.config import ServeArgs
    from triptych.flag_roles import roles_taking
    from triptych.roles import WORKER_ROLES, Role
    from triptych.serve_help import flag

    repo = Path(__file__).resolve().parents[2]
    fields = set(ServeArgs.__dataclass_fields__)

    def read_by(*folders: str) -> set[str]:
        found: set[str] = set()
        for folder in folders:
            for path in (repo / folder).rglob("*.py"):
                found |= set(re.findall(r"\bargs\.([a-z_]+)", path.read_text()))
        return found & fields

    worker = read_by("worker/triptych_worker")
    refused = [a for a in worker if not any(r in roles_taking(flag(a)) for r in WORKER_ROLES)]
    assert not refused, f"workers read {refused} but the table gives them to no worker role"
    head = read_by("head/triptych_head")
    refused = [
        a for a in head if Role.SERVER not in roles_taking(flag(a)) and Role.MONOLITHIC not in roles_taking(flag(a))
    ]
    assert not refused, f"the head reads {refused} but the table gives them to no head"
