"""--ssl-certfile / --ssl-keyfile: both or neither (checked with the other flags, also where the
operator writes them), readable and a certificate with its own key (checked as the process starts:
`triptych serve` refuses in one line naming the flag, triptych/config.py). Only the processes serving
HTTP take them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.certs import self_signed
from triptych.cli import build_parser
from triptych.config import ConfigError, ServeArgs


def parse(*argv: str) -> ServeArgs:
    """As `triptych serve` takes them: parsed, validated, then the files checked."""
    args = ServeArgs.from_namespace(build_parser().parse_args(["serve", "--model-path", "m", *argv]))
    args.check_files()
    return args


def test_a_certificate_and_its_key_are_taken(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    args = parse("--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    assert (args.ssl_certfile, args.ssl_keyfile) == (str(cert), str(key))
    assert "--ssl-certfile" in args.to_argv()


def test_one_without_the_other_is_refused(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    with pytest.raises(ConfigError, match="--ssl-certfile needs --ssl-keyfile too"):
        parse("--ssl-certfile", str(cert))
    with pytest.raises(ConfigError, match="--ssl-keyfile needs --ssl-certfile too"):
        parse("--ssl-keyfile", str(key))


def test_a_missing_file_a_key_of_another_certificate_and_not_pem_are_named(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path / "a")
    _, other_key = self_signed(tmp_path / "b")
    with pytest.raises(ConfigError, match=r"--ssl-keyfile .*/nope.key: No such file"):
        parse("--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "nope.key"))
    with pytest.raises(ConfigError, match="do not load as a PEM certificate and its private key"):
        parse("--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"--ssl-certfile .*junk.pem and --ssl-keyfile .* do not load"):
        parse("--ssl-certfile", str(junk), "--ssl-keyfile", str(key))


def test_a_worker_does_not_take_them(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    with pytest.raises(ConfigError, match="--ssl-certfile"):
        parse("--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--ssl-certfile", str(cert),
              "--ssl-keyfile", str(key))  # fmt: skip


def test_the_files_are_checked_as_the_process_starts_not_where_the_flags_are_written(tmp_path: Path) -> None:
    argv = ["serve", "--model-path", "m", "--ssl-certfile", "/etc/triptych/tls/tls.crt",
            "--ssl-keyfile", "/etc/triptych/tls/tls.key"]  # fmt: skip
    args = ServeArgs.from_namespace(build_parser().parse_args(argv))  # as the operator checks a head's args
    assert args.ssl_certfile == "/etc/triptych/tls/tls.crt"
    with pytest.raises(ConfigError, match=r"--ssl-certfile /etc/triptych/tls/tls.crt: No such file"):
        args.check_files()
    run = subprocess.run([sys.executable, "-m", "triptych", *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "triptych: error: --ssl-certfile /etc/triptych/tls/tls.crt: No such file or directory"
    ]
