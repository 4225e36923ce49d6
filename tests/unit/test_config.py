"""`triptych serve` flags: defaults as docs/design.md gives them, one-line errors naming the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from triptych.cli import build_parser
from triptych.config import ConfigError, ServeArgs
from triptych.parallelism import ParallelismError, resolve_parallelism
from triptych.ports import result_endpoint, result_port
from triptych.roles import Role


def parse(*argv: str) -> ServeArgs:
    return ServeArgs.from_namespace(build_parser().parse_args(["serve", *argv]))


def test_spec_defaults():
    a = parse("--model-path", "m")
    assert a.disagg_role is Role.MONOLITHIC
    assert a.scheduler_port == 5555
    assert a.disagg_transfer_pool_size == 256 * 1024 * 1024
    assert a.disagg_timeout == 600
    assert a.disagg_dispatch_policy == "round_robin"
    assert a.disagg_p2p_hostname == "127.0.0.1" and a.disagg_ib_device is None


def test_port_convention():
    assert [result_port(19655, r) for r in (Role.ENCODER, Role.DENOISER, Role.DECODER)] == [19656, 19657, 19658]
    assert [result_port(19655, r) for r in (Role.PROMPT_ENCODER, Role.IMAGE_ENCODER)] == [19659, 19660]
    assert result_endpoint("tcp://192.0.2.4:19655", Role.DENOISER) == "tcp://192.0.2.4:19657"


def test_urls_are_semicolon_separated_and_pool_size_takes_units():
    a = parse("--model-path", "m", "--disagg-role", "server", "--encoder-urls", "tcp://a:1;tcp://b:1",
              "--denoiser-urls", "tcp://c:1", "--decoder-urls", "dns://dec.ns.svc:1")  # fmt: skip
    assert a.encoder_urls == ["tcp://a:1", "tcp://b:1"] and a.decoder_urls == ["dns://dec.ns.svc:1"]
    worker = ("--model-path", "m", "--disagg-role", "decoder", "--disagg-server-addr", "tcp://h:1")
    assert parse(*worker, "--disagg-transfer-pool-size", "1GiB").disagg_transfer_pool_size == 1 << 30


def test_a_head_with_only_denoiser_urls_is_a_full_pipeline_pool_and_its_workers_say_so():
    head = parse("--model-path", "m", "--disagg-role", "server", "--denoiser-urls", "tcp://a:1;tcp://b:1")
    assert head.denoiser_urls == ["tcp://a:1", "tcp://b:1"] and not head.encoder_urls and not head.decoder_urls
    worker = parse("--model-path", "m", "--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1",
                   "--disagg-full-pipeline", "--encoder-cache-bytes", "64MiB")  # fmt: skip
    assert worker.stage_role is Role.MONOLITHIC and worker.encoder_cache_bytes == 64 << 20
    assert "--disagg-full-pipeline" in worker.to_argv()
    assert parse("--model-path", "m", "--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1"
                 ).stage_role is Role.DENOISER  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--disagg-role", "encoder"], "--disagg-server-addr"),
        (["--disagg-role", "server", "--encoder-urls", "tcp://a:1"], "--denoiser-urls"),
        (["--disagg-role", "encoder", "--disagg-server-addr", "http://x"], "--disagg-server-addr"),
        (["--disagg-role", "decoder", "--disagg-server-addr", "tcp://h:1", "--encoder-urls", "tcp://a:1"],
         "--encoder-urls"),
        (["--disagg-timeout", "0"], "--disagg-timeout"),
        (["--results-max-age", "0"], "--results-max-age"),
        (["--results-store", "/mnt/results"], "--results-store '/mnt/results' is not s3://BUCKET/PREFIX"),
        (["--results-store", "s3://B/p"], "not an S3 bucket name"),
        (["--results-s3-endpoint", "http://s3:8333"], "--results-s3-endpoint only applies with --results-store"),
        (["--results-presign", "60"], "--results-presign only applies with --results-store"),
        (["--results-store", "s3://bucket1/p", "--results-s3-endpoint", "s3:8333"], "--results-s3-endpoint 's3:8333'"),
        (["--results-store", "s3://bucket1/p", "--results-s3-endpoint", "http://s3:8333/bucket1"],
         "the bucket goes in"),
        (["--results-store", "s3://bucket1/p", "--results-presign", "-1"], "--results-presign -1 must be between"),
        (["--results-store", "s3://bucket1/p", "--results-presign", "700000"], "--results-presign 700000"),
        (["--disagg-role", "encoder", "--disagg-server-addr", "tcp://h:1", "--results-store", "s3://bucket1/p"],
         "--results-store is for the head"),
        (["--disagg-transfer-pool-size", "1000"], "--disagg-transfer-pool-size"),
        (["--scheduler-port", "70000"], "--scheduler-port"),
        (["--num-gpus", "4", "--tp-size", "3"], "--"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--num-gpus", "4", "--denoiser-sp", "2"],
         "--denoiser-"),
        (["--disagg-role", "decoder", "--disagg-server-addr", "tcp://h:1", "--disagg-full-pipeline"],
         "--disagg-full-pipeline is for --disagg-role denoiser"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--disagg-full-pipeline", "--simulate"],
         "--disagg-full-pipeline does not support --simulate"),
        (["--disagg-role", "server", "--denoiser-urls", "tcp://a:1", "--encoder-urls", "tcp://b:1"],
         "or only --denoiser-urls for a full-pipeline pool"),
    ],
)  # fmt: skip
def test_contradictory_flags_name_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        parse("--model-path", "m", *argv)


def test_cli_exits_nonzero_with_one_line():
    cases = [
        ["serve", "--model-path", "m", "--no-such-flag"],
        ["serve", "--model-path", "m", "--disagg-role", "encoder"],
    ]
    for argv in [*cases, ["serve"]]:
        proc = subprocess.run([sys.executable, "-m", "triptych", *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("triptych: error:"), proc.stderr


def test_to_argv_round_trips():
    a = parse("--model-path", "/m", "--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:5555",
              "--num-gpus", "4", "--denoiser-ulysses", "2", "--disagg-ib-device", "mlx5_0")  # fmt: skip
    assert parse(*a.to_argv()) == a
    head = parse("--model-path", "/m", "--results-store", "s3://results/pipeline-a", "--results-s3-endpoint",
                 "http://seaweedfs:8333", "--results-presign", "600")  # fmt: skip
    assert parse(*head.to_argv()) == head


def test_parallelism_is_derived_from_gpus():
    p = resolve_parallelism(8, tp=2)
    assert (p.tp, p.sp, p.ulysses, p.ring, p.cfg) == (2, 4, 4, 1, 1)
    p = resolve_parallelism(4, ulysses=2, ring=2)
    assert (p.sp, p.tp) == (4, 1)


@pytest.mark.parametrize(
    "kwargs", [{"tp": 3}, {"sp": 2, "tp": 1}, {"sp": 4, "ulysses": 3}, {"ulysses": 2, "ring": 3}, {"cfg": 0}]
)
def test_incompatible_parallelism_is_an_error_not_silently_fixed(kwargs):
    with pytest.raises(ParallelismError):
        resolve_parallelism(4, **kwargs)


def test_base_gpu_id_picks_the_cuda_device():
    assert parse("--model-path", "m", "--device", "cuda", "--base-gpu-id", "3").resolved_device == "cuda:3"
    assert parse("--model-path", "m", "--device", "cpu", "--base-gpu-id", "3").resolved_device == "cpu"


def test_http_guard_flags_take_sizes_and_belong_to_the_head() -> None:
    a = parse("--model-path", "m", "--max-request-bytes", "4MiB", "--max-queued-requests", "0")
    assert (a.max_request_bytes, a.max_queued_requests, a.api_keys_file) == (4 << 20, 0, None)
    assert parse("--model-path", "m").max_request_bytes == 16 << 20
    worker = ("--model-path", "m", "--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1")
    with pytest.raises(ConfigError, match="--api-keys-file is for the head"):
        parse(*worker, "--api-keys-file", "/keys")
    with pytest.raises(ConfigError, match="--max-request-bytes 10 is below 1KiB"):
        parse("--model-path", "m", "--max-request-bytes", "10")
    with pytest.raises(ConfigError, match="--max-queued-requests -1 must be >= 0"):
        parse("--model-path", "m", "--max-queued-requests", "-1")
