"""Control-plane keys and CURVE sockets: `triptych keys generate`, loading, refusing to run unprotected."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from triptych.cli import build_parser, main
from triptych.config import ConfigError, ServeArgs
from triptych.security import ControlPlane, load_keys

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> ServeArgs:
    return ServeArgs.from_namespace(build_parser().parse_args(["serve", "--model-path", "m", *argv]))


def worker(*argv: str) -> ServeArgs:
    return parse("--disagg-role", "encoder", "--disagg-server-addr", "tcp://127.0.0.1:6555", *argv)


def head(*argv: str) -> ServeArgs:
    urls = ["--encoder-urls", "tcp://127.0.0.1:1", "--denoiser-urls", "tcp://127.0.0.1:2"]
    return parse("--disagg-role", "server", *urls, "--decoder-urls", "tcp://127.0.0.1:3", *argv)


def test_keys_generate_writes_a_head_and_a_worker_pair_with_private_secret_files(tmp_path, capsys):
    keys = tmp_path / "keys"
    assert main(["keys", "generate", str(keys)]) == 0
    names = sorted(p.name for p in keys.iterdir())
    assert names == ["head.key", "head.key_secret", "worker.key", "worker.key_secret"]
    assert capsys.readouterr().out.split() == [
        str(keys / n) for n in ("head.key", "head.key_secret", "worker.key", "worker.key_secret")
    ]
    for secret in ("head.key_secret", "worker.key_secret"):
        assert stat.S_IMODE((keys / secret).stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    head_keys, worker_keys = load_keys(keys, "head"), load_keys(keys, "worker")
    assert head_keys.peer_public == worker_keys.public and worker_keys.peer_public == head_keys.public
    assert head_keys.public != worker_keys.public


def test_keys_generate_never_overwrites_a_key_set(tmp_path, capsys):
    assert main(["keys", "generate", str(tmp_path)]) == 0
    before = (tmp_path / "head.key_secret").read_text()
    assert main(["keys", "generate", str(tmp_path)]) == 2
    assert "already holds head.key" in capsys.readouterr().err
    assert (tmp_path / "head.key_secret").read_text() == before


@pytest.mark.parametrize(("target", "says"), [("", "DIR is empty"), ("{file}", "{file}: not a folder the keys")])
def test_keys_generate_refuses_an_empty_or_file_target_in_one_line(tmp_path, capsys, target, says):
    """An empty DIR wrote the keys into the current folder; a file ended in "[Errno 17] File exists"."""
    file = tmp_path / "a-file"
    file.write_text("x")
    assert main(["keys", "generate", target.format(file=file)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"triptych: error: {says.format(file=file)}"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_missing_key_files_are_named(tmp_path):
    main(["keys", "generate", str(tmp_path)])
    (tmp_path / "head.key").unlink()  # the worker needs the head's public key
    with pytest.raises(ConfigError, match=r"head\.key"):
        load_keys(tmp_path, "worker")
    load_keys(tmp_path, "head")  # the head does not need its own public file


@pytest.mark.parametrize("mode", [0o644, 0o606, 0o604])
def test_a_secret_key_open_to_every_user_is_refused_naming_the_file_and_the_chmod(tmp_path, mode):
    main(["keys", "generate", str(tmp_path)])
    (tmp_path / "worker.key_secret").chmod(mode)
    with pytest.raises(ConfigError) as refused:
        load_keys(tmp_path, "worker")
    assert f"worker.key_secret is open to every user of this host (mode {mode:04o})" in str(refused.value)
    assert f"chmod 600 {tmp_path / 'worker.key_secret'}" in str(refused.value)
    load_keys(tmp_path, "head")  # its own secret is still closed
    (tmp_path / "worker.key_secret").chmod(0o440)  # as the operator's Secret volume mounts it
    load_keys(tmp_path, "worker")


def test_the_http_side_s_secret_files_open_to_every_user_are_named_in_a_warning(tmp_path):
    """--api-keys-file, --webhook-secret-file and --ssl-keyfile are the operator's own: a warning names
    each one every user may read, and the process goes on."""
    keys = tmp_path / "api-keys"
    keys.write_text("sk-one\n")
    keys.chmod(0o644)
    webhook = tmp_path / "whsec"
    webhook.write_text("whsec_" + "a" * 32 + "\n")
    webhook.chmod(0o600)
    from triptych.config_checks import secret_file_warnings

    args = head("--api-keys-file", str(keys), "--webhook-url", "http://192.0.2.9/hook", "--webhook-secret-file",
                str(webhook))  # fmt: skip
    (warning,) = secret_file_warnings(args)
    assert warning.startswith(f"--api-keys-file {keys} is open to every user of this host (mode 0644)"), warning
    keys.chmod(0o640)
    assert secret_file_warnings(args) == []


def test_the_secret_files_the_environment_names_open_to_every_user_are_named_in_a_warning(tmp_path):
    """HF_TOKEN_PATH (the hub token) and the S3 credentials' AWS_*_FILE, as the operator mounts them."""
    from triptych.config_checks import secret_file_warnings

    token, secret = tmp_path / "token", tmp_path / "secret-access-key"
    for path in (token, secret):
        path.write_text("value\n")
    token.chmod(0o444)
    secret.chmod(0o440)  # as the operator's Secret volume mounts it
    env = {"HF_TOKEN_PATH": str(token), "AWS_SECRET_ACCESS_KEY_FILE": str(secret)}
    (warning,) = secret_file_warnings(head(), env)
    assert warning.startswith(f"HF_TOKEN_PATH {token} is open to every user of this host (mode 0444)"), warning
    secret.chmod(0o604)
    assert [w.split(" is open")[0] for w in secret_file_warnings(head(), env)] == [
        f"HF_TOKEN_PATH {token}",
        f"AWS_SECRET_ACCESS_KEY_FILE {secret}",
    ]


@pytest.mark.parametrize(
    ("build", "flag", "address"),
    [
        (worker, "--disagg-p2p-hostname", "192.0.2.7"),
        (head, "--host", "0.0.0.0"),
        (worker, "--disagg-p2p-hostname", "$(POD_IP)"),
    ],
)
def test_a_non_loopback_control_plane_without_keys_is_refused_naming_both_flags(build, flag, address):
    with pytest.raises(ConfigError) as err:
        build(flag, address)
    message = str(err.value)
    assert flag in message and "--disagg-keys-dir" in message and "--disagg-insecure" in message
    assert "\n" not in message
    build(flag, address, "--disagg-insecure")  # explicitly unauthenticated: allowed
    build(flag, address, "--disagg-keys-dir", "/keys")


def test_loopback_runs_without_keys_and_both_flags_at_once_are_refused():
    worker()
    head("--host", "::1")
    with pytest.raises(ConfigError, match="not both"):
        worker("--disagg-keys-dir", "/keys", "--disagg-insecure")


def test_serve_exits_with_one_line_when_the_keys_cannot_be_read(tmp_path, tiny_models):
    cmd = [sys.executable, "-m", "triptych", "serve", "--model-path", str(tiny_models["tiny-flux"]),
           "--disagg-role", "encoder", "--simulate", "--disagg-server-addr", "tcp://127.0.0.1:6555",
           "--disagg-keys-dir", str(tmp_path / "nowhere")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("triptych: error:")]
    assert len(errors) == 1 and "worker.key_secret" in errors[0] and "triptych keys generate" in errors[0], proc.stderr


def received(pull: zmq.Socket, timeout_ms: int = 1500) -> list[bytes]:
    out = []
    while pull.poll(timeout_ms):
        out.append(pull.recv())
        timeout_ms = 100
    return out


def test_a_curve_server_takes_messages_only_from_the_peer_key(tmp_path, caplog):
    main(["keys", "generate", str(tmp_path / "ours")])
    main(["keys", "generate", str(tmp_path / "theirs")])
    server_ctx, client_ctx, stranger_ctx, plain_ctx = (zmq.Context() for _ in range(4))
    server = ControlPlane(server_ctx, load_keys(tmp_path / "ours", "worker"))  # lets in the head key only
    client = ControlPlane(client_ctx, load_keys(tmp_path / "ours", "head"))
    # Another pipeline's head, which knows this worker's public key but holds another head key.
    ours_worker_public = load_keys(tmp_path / "ours", "head").peer_public
    stranger_keys = load_keys(tmp_path / "theirs", "head")
    stranger = ControlPlane(
        stranger_ctx, type(stranger_keys)(stranger_keys.public, stranger_keys.secret, ours_worker_public)
    )
    pull = server_ctx.socket(zmq.PULL)
    server.server(pull)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    sockets = []
    try:
        for plane, ctx, payload in [
            (stranger, stranger_ctx, b"stranger"),
            (None, plain_ctx, b"plain"),
            (client, client_ctx, b"head"),
        ]:
            push = ctx.socket(zmq.PUSH)
            push.linger = 0
            if plane is not None:
                plane.client(push)
            push.connect(f"tcp://127.0.0.1:{port}")
            push.send(payload, zmq.NOBLOCK) if plane is client else _try_send(push, payload)
            sockets.append(push)
        assert received(pull) == [b"head"]
        assert "refused 1 control-plane connection(s) from a key that is not this pipeline's" in caplog.text
    finally:
        for sock in [*sockets, pull]:
            sock.close(linger=0)
        for plane in (server, client, stranger):
            plane.close()
        for ctx in (server_ctx, client_ctx, stranger_ctx, plain_ctx):
            ctx.term()


def _try_send(sock: zmq.Socket, payload: bytes) -> None:
    """Queue a message the way an attacker would (ZMQ queues it until a handshake that never succeeds)."""
    try:
        sock.send(payload, zmq.NOBLOCK)
    except zmq.Again:
        pass
