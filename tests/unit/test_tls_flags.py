"""--ssl-certfile / --ssl-keyfile: both or neither, readable, and a certificate with its own key;
each refusal one line naming the flag (triptych/config.py). Only the processes serving HTTP take them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.certs import self_signed
from triptych.cli import build_parser
from triptych.config import ConfigError, ServeArgs


def parse(*argv: str) -> ServeArgs:
    return ServeArgs.from_namespace(build_parser().parse_args(["serve", "--model-path", "m", *argv]))


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
