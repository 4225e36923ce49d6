"""`triptych serve` flags: defaults as docs/design.md gives them, one-line errors naming the flag."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from triptych.cli import build_parser
from triptych.config import ConfigError, ServeArgs
from triptych.liveness import HEARTBEAT_INTERVAL_S
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
    a = parse("--model-path", "m", "--disagg-role", "server", "--encoder-urls", "tcp://127.0.0.1:1;tcp://127.0.0.2:1",
              "--denoiser-urls", "tcp://127.0.0.3:1", "--decoder-urls", "dns://dec.ns.svc:1")  # fmt: skip
    assert a.encoder_urls == ["tcp://127.0.0.1:1", "tcp://127.0.0.2:1"] and a.decoder_urls == ["dns://dec.ns.svc:1"]
    worker = ("--model-path", "m", "--disagg-role", "decoder", "--disagg-server-addr", "tcp://h:1")
    assert parse(*worker, "--disagg-transfer-pool-size", "1GiB").disagg_transfer_pool_size == 1 << 30


def test_a_head_with_only_denoiser_urls_is_a_full_pipeline_pool_and_its_workers_say_so():
    head = parse(
        "--model-path", "m", "--disagg-role", "server", "--denoiser-urls", "tcp://127.0.0.1:1;tcp://127.0.0.2:1"
    )
    assert (
        head.denoiser_urls == ["tcp://127.0.0.1:1", "tcp://127.0.0.2:1"]
        and not head.encoder_urls
        and not head.decoder_urls
    )
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
        (["--disagg-role", "server", "--encoder-urls", "tcp://127.0.0.1:1"], "--denoiser-urls"),
        (["--disagg-role", "encoder", "--disagg-server-addr", "http://x"], "--disagg-server-addr"),
        (["--disagg-role", "decoder", "--disagg-server-addr", "tcp://h:1", "--encoder-urls", "tcp://127.0.0.1:1"],
         "--encoder-urls"),
        (["--disagg-timeout", "0"], "--disagg-timeout"),
        (["--results-max-age", "0"], "--results-max-age"),
        # Accepted, and then the retention sweep deleted every result (images, videos, stored answers).
        (["--results-max-bytes", "0"], re.escape("--results-max-bytes 0 must be > 0 (the bytes of results")),
        (["--results-max-bytes", "0GiB"], r"--results-max-bytes 0 must be > 0 .*; use e\.g\. 5GiB"),
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
        # Accepted and ignored before: a full-pipeline worker moves no tensors.
        *(
            (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--disagg-full-pipeline", *given],
             f"{given[0]} does nothing with --disagg-full-pipeline")
            for given in (["--disagg-ib-device", "mlx5_0"], ["--disagg-transfer-pool-size", "4GiB"],
                          ["--disagg-transfer-listen-any"], ["--disagg-load-ahead", "0"])
        ),
        (["--disagg-role", "server", "--denoiser-urls", "tcp://127.0.0.1:1", "--encoder-urls", "tcp://127.0.0.2:1"],
         "or only --denoiser-urls for a full-pipeline pool"),
        # NaN passed every `<= 0` check (a request deadline that never came, results deleted at once, a
        # discovery loop resolving names 285,000 times a second); infinity overflowed the drain's wait.
        (["--disagg-timeout", "nan"], "--disagg-timeout nan must be a finite number"),
        (["--disagg-no-instance-wait", "nan"], "--disagg-no-instance-wait nan must be a finite number"),
        (["--results-max-age", "nan"], "--results-max-age nan must be a finite number"),
        (["--disagg-discovery-interval", "nan"], "--disagg-discovery-interval nan must be a finite number"),
        (["--disagg-drain-timeout", "inf"], "--disagg-drain-timeout inf must be a finite number"),
        (["--disagg-drain-timeout", "1e12"], "--disagg-drain-timeout 1000000000000.0 must be a finite number"),
        (["--batching-delay-ms=-inf"], "--batching-delay-ms -inf must be a finite number"),
        (["--disagg-discovery-interval", "1e-9"], "--disagg-discovery-interval 1e-09 must be at least 0.05"),
        # Two sockets of one process on one port: found only when the second bound, after the model loaded.
        (["--disagg-role", "server", "--scheduler-port", "19655", "--port", "19658", "--encoder-urls",
          "tcp://127.0.0.1:1", "--denoiser-urls", "tcp://127.0.0.1:2", "--decoder-urls", "tcp://127.0.0.1:3"],
         "--port 19658 is one of the head's control ports"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--scheduler-port", "19001",
          "--num-gpus", "2", "--master-port", "19001"], "--master-port 19001 is also --scheduler-port"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:65534"], "so it is at most 65530"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--scheduler-port", "65500",
          "--num-gpus", "2"], r"the ranks meet on it \+ 50 \(65550\), not a TCP port; give --master-port"),
        (["--results-store", "s3://bucket1/p", "--results-s3-endpoint", "http://s3:99999"],
         "--results-s3-endpoint 'http://s3:99999' is not"),
        (["--otlp-endpoint", "http://c:abc"], "--otlp-endpoint 'http://c:abc' is not"),
        # An unclosed [IPv6] host made urlsplit raise ValueError: a traceback, not a line naming the flag.
        (["--otlp-endpoint", "http://["], re.escape("--otlp-endpoint 'http://[' is not http(s)://HOST:PORT")),
        (["--results-store", "s3://bucket1/p", "--results-s3-endpoint", "http://[::1"],
         re.escape("--results-s3-endpoint 'http://[::1' is not http(s)://HOST[:PORT]")),
        (["--results-store", "s3://[x/p"], re.escape("--results-store 's3://[x/p' is not s3://BUCKET/PREFIX")),
        (["--output-path", " "], "--output-path is empty"),
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


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (["--otlp-endpoint", "http://["], {}, "--otlp-endpoint 'http://[' is not http(s)://HOST:PORT"),
        (["--results-store", "s3://[x/p"], {}, "--results-store 's3://[x/p' is not s3://BUCKET/PREFIX"),
        # The variable is read as the head starts (as 'ftp://x' is): a ValueError traceback before, rc 1.
        (["--disagg-role", "server", "--encoder-urls", "tcp://127.0.0.1:1", "--denoiser-urls", "tcp://127.0.0.1:2",
          "--decoder-urls", "tcp://127.0.0.1:3", "--port", "{port}", "--output-path", "{tmp}"],
         {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://["},
         "OTEL_EXPORTER_OTLP_ENDPOINT 'http://[' is not an http(s)://HOST:PORT URL"),
    ],
)  # fmt: skip
def test_a_bracketed_url_is_one_line_not_a_traceback(argv, env, line, tmp_path):
    import os
    import socket

    with socket.socket() as probe:  # the head binds --port before it reads the variable
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{port}", str(port)) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-m", "triptych", "serve", "--model-path", ".models/tiny-flux", *argv],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("triptych: error:")]
    assert errors and line in errors[0] and "Traceback" not in proc.stderr, proc.stderr


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


def test_dtype_auto_is_bfloat16_on_a_gpu_and_float32_on_the_cpu() -> None:
    args = parse("--model-path", "m")
    assert (args.compute_dtype("cuda:1"), args.compute_dtype("cpu")) == ("bfloat16", "float32")
    assert parse("--model-path", "m", "--dtype", "float16").compute_dtype("cpu") == "float16"
    with pytest.raises(ConfigError, match=r"^--dtype 'int8' is not one of auto, float32, bfloat16, float16"):
        ServeArgs.from_kwargs(model_path="m", dtype="int8").validate()
    worker = ("--model-path", "m", "--disagg-role", "decoder", "--disagg-server-addr", "tcp://h:1", "--simulate")
    with pytest.raises(ConfigError, match=r"^--dtype bfloat16 does nothing with --simulate"):
        parse(*worker, "--dtype", "bfloat16")


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


# --- a head whose workers could never reach it --------------------------------------------------------------

LOOPBACK_URLS = {  # one per worker-URL flag: a denoiser/decoder pair and the encoders
    "--encoder-urls": "tcp://127.0.0.1:19000",
    "--denoiser-urls": "tcp://127.0.0.1:19001",
    "--decoder-urls": "tcp://127.0.0.1:19002",
}
SPLIT_ENCODERS = {"--prompt-encoder-urls": "tcp://127.0.0.1:19003", "--image-encoder-urls": "tcp://127.0.0.1:19004"}


def head_argv(urls: dict[str, str], *flags: str) -> list[str]:
    return ["--model-path", "m", "--disagg-role", "server", *(a for kv in urls.items() for a in kv), *flags]


@pytest.mark.parametrize("flag", [*LOOPBACK_URLS, *SPLIT_ENCODERS])
def test_a_loopback_head_with_a_worker_on_another_host_is_refused_naming_the_flag_and_host(flag):
    """The result sockets bind --host: a worker on another host would never heartbeat to a loopback one."""
    split = flag in SPLIT_ENCODERS
    urls = {**LOOPBACK_URLS, **SPLIT_ENCODERS} if split else dict(LOOPBACK_URLS)
    if split:
        del urls["--encoder-urls"]
    remote = "tcp://192.0.2.7:35000"
    urls[flag] = f"{urls[flag]};{remote}"
    with pytest.raises(ConfigError) as refused:
        parse(*head_argv(urls))
    message = str(refused.value)
    assert message.startswith(f"{flag} {remote} is on another host, but --host 127.0.0.1 binds"), message
    assert "pass --host with an address the workers reach (or 0.0.0.0), with --disagg-keys-dir" in message
    # Given a --host its workers reach, the same lists are taken.
    parse(*head_argv(urls, "--host", "0.0.0.0", "--disagg-keys-dir", "keys"))
    parse(*head_argv(urls, "--host", "192.0.2.10", "--disagg-insecure"))


@pytest.mark.parametrize(
    "url", ["tcp://workers.example:35000", "tcp://[2001:db8::1]:35000", "tcp://192.0.2.1:35000"]
)  # fmt: skip
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.9"])
def test_every_loopback_host_is_refused_a_remote_name_or_address(host, url):
    with pytest.raises(ConfigError, match=re.escape(f"--encoder-urls {url} is on another host, but --host {host}")):
        parse(*head_argv({**LOOPBACK_URLS, "--encoder-urls": url}, "--host", host))


@pytest.mark.parametrize(
    "url",
    ["tcp://127.0.0.5:35000", "tcp://localhost:35000", "tcp://[::1]:35000", "dns://encoders.ns.svc:35000",
     "file:///etc/triptych/encoders"],
)  # fmt: skip
def test_loopback_workers_and_discovered_lists_keep_working_with_the_default_host(url):
    """Loopback workers reach a loopback head; dns:// and file:// lists are known only at run time."""
    assert parse(*head_argv({**LOOPBACK_URLS, "--encoder-urls": url})).encoder_urls == [url]


REFERENCE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference-commands.md"


def reference_block(name: str) -> str:
    match = re.search(
        rf"<!-- reference-block: {re.escape(name)} -->\n```bash\n(.*?)```", REFERENCE_PAGE.read_text(), re.S
    )
    assert match, f"no block {name!r} in {REFERENCE_PAGE}"
    return match[1]


def serve_argv(command: str) -> list[str]:
    """The arguments after `triptych serve` of one shell command (continuations joined, `&` dropped)."""
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    assert words[:2] == ["triptych", "serve"] and words[-1] == "&", words
    return words[2:-1]


def test_the_reference_pages_several_instances_head_validates_and_as_the_reference_types_it_is_refused():
    """docs/reference-commands.md gives the reference's head with --host 0.0.0.0 and keys added, and
    says the reference's own command (no --host) is refused with one line naming --host
    (tests/e2e/test_reference_commands.py runs both)."""
    block = reference_block("instances serve")
    head = next(chunk for chunk in block.split("\n\n") if "triptych serve" in chunk)
    argv = serve_argv(head[head.index("triptych serve") :])
    assert parse(*argv).host == "0.0.0.0"
    as_typed = serve_argv(
        head[head.index("triptych serve") :].replace("    --host 0.0.0.0 --disagg-keys-dir keys \\\n", "")
    )
    assert "--host" not in as_typed and "--disagg-keys-dir" not in as_typed
    with pytest.raises(ConfigError, match=re.escape("--encoder-urls tcp://192.0.2.1:35000 is on another host")):
        parse(*as_typed)


# --- heartbeats ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["server", "denoiser"])
@pytest.mark.parametrize("timeout", ["0.5", "1", "1.99", "nan"])
def test_a_heartbeat_timeout_under_two_heartbeat_intervals_is_refused(role, timeout):
    """Workers heartbeat every HEARTBEAT_INTERVAL_S; a shorter timeout would lose healthy ones."""
    argv = ["--model-path", "m", "--disagg-role", role, "--disagg-heartbeat-timeout", timeout]
    argv += (
        ["--disagg-server-addr", "tcp://h:1"] if role != "server" else [a for kv in LOOPBACK_URLS.items() for a in kv]
    )
    with pytest.raises(ConfigError) as refused:
        parse(*argv)
    below = (
        f"--disagg-heartbeat-timeout {float(timeout):g} is below twice the workers' {HEARTBEAT_INTERVAL_S:g} s "
        f"heartbeat interval, so a worker whose heartbeat is a little late would count as lost: use at least "
        f"{2 * HEARTBEAT_INTERVAL_S:g}"
    )
    not_a_number = "--disagg-heartbeat-timeout nan must be a finite number (at most 1e+09)"
    assert str(refused.value) == (not_a_number if timeout == "nan" else below)
    argv[argv.index(timeout)] = str(2 * HEARTBEAT_INTERVAL_S)
    assert parse(*argv).disagg_heartbeat_timeout == 2 * HEARTBEAT_INTERVAL_S


def test_the_heartbeat_interval_is_the_one_workers_use():
    from triptych_worker import runtime

    assert runtime.HEARTBEAT_INTERVAL_S is HEARTBEAT_INTERVAL_S
