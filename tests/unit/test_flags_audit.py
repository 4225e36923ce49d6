"""Bad `triptych serve` and client flag values found by an audit: each is refused at start-up in one
line naming the flag and the value, where it used to pass and fail (or do something else) later."""

from __future__ import annotations

from pathlib import Path

import pytest

from triptych.cli import build_parser
from triptych.client import ClientError, TriptychClient
from triptych.config import MAX_SIZE, ConfigError, ServeArgs

WORKER = ["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1"]
HEAD = ["--disagg-role", "server", "--encoder-urls", "tcp://127.0.0.1:19001", "--denoiser-urls",
        "tcp://127.0.0.1:19002", "--decoder-urls", "tcp://127.0.0.1:19003"]  # fmt: skip


def parse(*argv: str) -> ServeArgs:
    return ServeArgs.from_namespace(build_parser().parse_args(["serve", "--model-path", "m", *argv]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # A whole number past 64 bits stopped the worker at its first heartbeat (msgpack cannot encode it).
        ([*WORKER, "--worker-capacity", "99999999999999999999999"],
         "--worker-capacity 99999999999999999999999 is out of range"),
        ([*WORKER, "--batching-max-size", "99999999999999999999999"], "--batching-max-size 99999999999999999999999"),
        (["--results-max-bytes", "2000TiB"], r"--results-max-bytes 2199023255552000 is out of range \(at most 1PiB\)"),
        # Port 0 passed (the worker reported to port 0 + its role's offset); a port out of range or a bad
        # IPv6 address gave urllib's words without the value; a path or user was dropped without a word.
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:0"],
         "--disagg-server-addr: 'tcp://h:0' is not a tcp://HOST:PORT endpoint"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:99999"], "'tcp://h:99999' is not a tcp://"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://[::1:5555"], r"'tcp://\[::1:5555' is not"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1/path"], "'tcp://h:1/path' is not"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://user@h:1"], "'tcp://user@h:1' is not"),
        ([*HEAD, "--decoder-urls", "dns://decoders:0"], "--decoder-urls: 'dns://decoders:0' is not a dns://NAME:PORT"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1;tcp://h:1"],
         "--disagg-server-addr: tcp://h:1 is listed twice"),
        ([*HEAD, "--encoder-urls", "tcp://127.0.0.1:1;tcp://127.0.0.1:1"],
         "--encoder-urls: tcp://127.0.0.1:1 is listed twice"),
        # Monolithic mode loaded its model, then uvicorn failed to bind ("Name or service not known"); an
        # empty --host bound every address.
        (["--host", "bad host"], "--host 'bad host' is not an IP address or a host name"),
        (["--host", "192.0.2.300"], "--host '192.0.2.300' is not"),
        (["--host", ""], "--host '' is not"),
        ([*WORKER, "--disagg-p2p-hostname", "tcp://127.0.0.1"], "--disagg-p2p-hostname 'tcp://127.0.0.1' is not"),
        # An empty path meant "no keys": the API (or the control plane) ran open though a file was asked for.
        (["--api-keys-file", ""], "--api-keys-file is empty"),
        ([*WORKER, "--disagg-keys-dir", " "], "--disagg-keys-dir is empty"),
        ([*HEAD, "--otlp-endpoint", "http://:4318"], "--otlp-endpoint 'http://:4318' is not"),
        ([*HEAD, "--batching-mode", "dynamic", "--batching-role-delay-ms", "denoiser=1e300"],
         r"denoiser='1e300' must be a number of milliseconds >= 0 \(at most 1e\+09\)"),
    ],
)  # fmt: skip
def test_a_bad_value_is_refused_naming_the_flag_and_the_value(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


@pytest.mark.parametrize(
    "argv",
    [
        [*WORKER, "--disagg-p2p-hostname", "$(POD_IP)", "--disagg-keys-dir", "/keys"],  # as the operator writes it
        [*WORKER, "--disagg-p2p-hostname", "worker-0.workers.ns.svc.cluster.local", "--disagg-insecure"],
        ["--host", "::1"],
        ["--host", "localhost"],
        [*HEAD, "--host", "0.0.0.0", "--disagg-keys-dir", "/keys"],
        ["--disagg-role", "denoiser", "--disagg-server-addr", "tcp://[2001:db8::1]:5555;dns://heads.ns.svc:5555"],
        ["--results-max-bytes", "1TiB"],
    ],
)
def test_addresses_names_and_sizes_that_work_still_pass(argv: list[str]) -> None:
    parse(*argv)


@pytest.mark.parametrize(
    ("given", "kept"),
    [("[::1]", "::1"), ("::1", "::1"), ("[2001:db8:0::1]", "2001:db8::1"), ("127.0.0.1", "127.0.0.1")],
)
def test_an_ipv6_address_in_brackets_is_kept_without_them(given: str, kept: str) -> None:
    """Brackets, as in a URL, were kept: the worker bound tcp://[[::1]]:PORT and failed, after its model loaded."""
    assert parse(*WORKER, "--disagg-p2p-hostname", given, "--disagg-insecure").disagg_p2p_hostname == kept
    assert parse("--host", given).host == kept


def test_a_name_in_brackets_is_refused_as_it_was() -> None:
    with pytest.raises(ConfigError, match=r"--host '\[worker-0\]' is not an IP address or a host name"):
        parse("--host", "[worker-0]")


HEAD_ON_V6 = ["--disagg-server-addr", "tcp://[::1]:19000", "--disagg-p2p-hostname", "[::1]"]
LOCAL_WORKER = ["--disagg-p2p-hostname", "localhost"]
HEADS_BY_NAME = ["--disagg-server-addr", "dns://heads:7;tcp://localhost:19000", "--disagg-p2p-hostname", "LOCALHOST"]


@pytest.mark.parametrize(
    ("argv", "port"),
    [
        (["--disagg-server-addr", "tcp://127.0.0.1:5555"], 5555),  # the worker's default work port: the head's
        (["--disagg-server-addr", "tcp://127.0.0.1:19000", "--scheduler-port", "19003"], 19003),  # a result port
        ([*HEAD_ON_V6, "--scheduler-port", "19000"], 19000),
        ([*HEADS_BY_NAME, "--scheduler-port", "19005"], 19005),
        # one address by its name and by its number (it was compared as text)
        (["--disagg-server-addr", "tcp://localhost:19000", "--scheduler-port", "19001"], 19001),
        (["--disagg-server-addr", "tcp://127.0.0.1:19000", "--scheduler-port", "19002", *LOCAL_WORKER], 19002),
        (["--disagg-server-addr", "tcp://app.localhost.:19000", "--scheduler-port", "19000"], 19000),
    ],
)
def test_a_worker_work_port_among_its_head_s_ports_on_its_address_is_refused(argv: list[str], port: int) -> None:
    """It bound only after its model loaded, and failed there (`Address already in use`)."""
    with pytest.raises(ConfigError, match=rf"--scheduler-port {port}: this worker's work port is one of its head's"):
        parse("--disagg-role", "denoiser", *argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["--disagg-server-addr", "tcp://127.0.0.1:5555", "--scheduler-port", "19000"],
        ["--disagg-server-addr", "tcp://127.0.0.1:19000", "--scheduler-port", "19006"],  # past the result ports
        ["--disagg-server-addr", "tcp://127.0.0.1:5555", "--disagg-p2p-hostname", "127.0.0.2"],  # another address
        ["--disagg-server-addr", "tcp://192.0.2.1:5555", "--disagg-p2p-hostname", "192.0.2.2", "--disagg-insecure"],
        ["--disagg-server-addr", "tcp://localhost:5555", "--disagg-p2p-hostname", "127.0.0.2"],
        # whether a socket takes ::1 for localhost depends on the host: left to the bind to find
        ["--disagg-server-addr", "tcp://localhost:19000", "--scheduler-port", "19000", *HEAD_ON_V6[2:]],
        ["--disagg-server-addr", "tcp://head:19000", "--scheduler-port", "19000", "--disagg-p2p-hostname", "127.0.0.1"],
    ],
)
def test_a_worker_work_port_apart_from_its_head_s_passes(argv: list[str]) -> None:
    parse("--disagg-role", "denoiser", *argv)


def test_a_transfer_pool_larger_than_the_host_is_refused_as_the_worker_starts() -> None:
    # numpy failed to allocate it with a traceback, after the model loaded.
    args = parse(*WORKER, "--disagg-transfer-pool-size", str(MAX_SIZE))
    with pytest.raises(ConfigError, match=f"--disagg-transfer-pool-size {MAX_SIZE} is more than this host's memory"):
        args.check_files()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--disagg-role", "server", "--encoder-urls", "file://DIR", "--denoiser-urls", "tcp://127.0.0.1:19002",
          "--decoder-urls", "tcp://127.0.0.1:19003"], "--encoder-urls"),
        (["--disagg-role", "denoiser", "--disagg-server-addr", "file://DIR"], "--disagg-server-addr"),
        ([*WORKER, "--lora-catalog", "DIR"], "--lora-catalog"),
    ],
)  # fmt: skip
def test_a_list_file_that_is_a_folder_is_refused_as_the_process_starts(
    argv: list[str], flag: str, tmp_path: Path
) -> None:
    """A missing list file may come later (a mounted ConfigMap); a folder never lists anything."""
    args = parse(*[a.replace("DIR", str(tmp_path)) for a in argv])
    with pytest.raises(ConfigError, match=rf"^{flag} {tmp_path} is a folder"):
        args.check_files()
    missing = parse(*[a.replace("DIR", str(tmp_path / "later.txt")) for a in argv])
    missing.check_files()  # not there yet: taken


def test_client_retries_are_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["status", "--retries", "99999999999999999999"])
    assert exited.value.code == 2
    assert "--retries: '99999999999999999999' is not a whole number from 0 to 100" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:0"])
def test_client_url_with_a_port_out_of_range_is_refused_before_any_connection(url: str) -> None:
    with pytest.raises(ClientError, match=f"url '{url}': give the head's http"):
        TriptychClient(url)


def test_client_url_that_does_not_parse_is_refused_with_the_form_to_give() -> None:
    # httpx's own words only ("Invalid port: ':1'", for a bracket left open)
    with pytest.raises(ClientError, match=r"url 'http://\[::1': Invalid port: ':1'; give the head's http"):
        TriptychClient("http://[::1")


def test_client_api_key_with_a_line_break_is_refused_not_sent() -> None:
    # httpx refused the header on sending, which read as "cannot reach" the head, retried.
    with pytest.raises(ClientError, match="api key: an API key is ASCII text without line breaks"):
        TriptychClient("http://127.0.0.1:1", api_key="key\n")
