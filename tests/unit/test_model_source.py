"""--model-path resolution: local packages as they are; hub ids through the hub client; clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from triptych.model_source import ModelSourceError, model_names, resolve_model_path


def test_local_package_is_used_as_is(tmp_path):
    (tmp_path / "model_index.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_directory_without_model_index_is_rejected(tmp_path):
    with pytest.raises(ModelSourceError, match=r"no model_index\.json"):
        resolve_model_path(str(tmp_path))


def test_missing_path_that_is_not_a_hub_id_is_rejected(tmp_path):
    with pytest.raises(ModelSourceError, match="not a hub id"):
        resolve_model_path(str(tmp_path / "nope" / "deeper"))


def test_unreachable_hub_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelSourceError, match="mount the package") as refused:
        resolve_model_path("example-org/not-cached-model")
    assert "give a token in HF_TOKEN or in the file HF_TOKEN_PATH names" in str(refused.value)


def test_the_hub_client_sends_the_token_of_the_file_hf_token_path_names(tmp_path):
    """What the operator gives pods instead of an HF_TOKEN value: downloads (the model's, hub-id LoRA
    adapters' through diffusers) authenticate with the file's token (a fresh process: the hub client
    reads HF_TOKEN_PATH when it is imported)."""
    token = tmp_path / "token"
    token.write_text("hf_fromthefile\n")
    token.chmod(0o440)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_TOKEN_PATH=str(token), HF_HOME=str(tmp_path / "home"))
    code = "from huggingface_hub.utils import build_hf_headers; print(build_hf_headers()['authorization'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Bearer hf_fromthefile"


def test_serve_exits_with_one_line_for_a_bad_model_path(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "triptych", "serve", "--model-path", str(tmp_path / "missing"), "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("triptych: error: --model-path")


def hub_cache(tmp_path, package, repo_id: str):
    """`package` as the hub client's cache holds a downloaded snapshot of `repo_id` (HF_HOME layout)."""
    import shutil

    repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(package, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return tmp_path


def test_a_hub_id_resolves_to_its_cached_snapshot_and_is_a_name_of_the_model(tmp_path):
    """The reference design's requests name the model by its hub id: accepted although the package's
    folder is a snapshot hash (huggingface_hub's own offline lookup, no network; a fresh process,
    since the hub client reads HF_HOME when it is imported)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "model_index.json").write_text("{}")
    given = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    home = hub_cache(tmp_path / "home", package, given)
    code = (
        "import json, sys; from triptych.model_source import model_names, resolve_model_path; "
        "r = resolve_model_path(sys.argv[1]); print(json.dumps([r, model_names(sys.argv[1], r), "
        "model_names(sys.argv[1], r, 'wan')]))"
    )
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code, given], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    resolved, names, served = json.loads(out.stdout)
    assert resolved.endswith("snapshots/0123abcd")
    assert names == [given, "0123abcd"] and served == ["wan", given, "0123abcd"]


def test_a_local_path_is_named_by_its_folder_first_then_as_given(tmp_path):
    (tmp_path / "tiny-flux").mkdir()
    assert model_names(str(tmp_path / "tiny-flux"), str(tmp_path / "tiny-flux")) == [
        "tiny-flux", str(tmp_path / "tiny-flux"),
    ]  # fmt: skip
    assert model_names("tiny-flux", "tiny-flux", "flux") == ["flux", "tiny-flux"]


def test_served_model_name_is_for_the_head_only():
    from triptych.cli import build_parser
    from triptych.config import ConfigError, ServeArgs

    def args(*argv: str) -> ServeArgs:
        return ServeArgs.from_namespace(build_parser().parse_args(["serve", "--model-path", "m", *argv]))

    assert args("--served-model-name", "wan").served_model_name == "wan"
    with pytest.raises(ConfigError, match="--served-model-name is for the head"):
        args("--served-model-name", "wan", "--disagg-role", "encoder", "--disagg-server-addr", "tcp://h:1")
    with pytest.raises(ConfigError, match="--served-model-name is empty"):
        args("--served-model-name", " ")


def _broken_package(tmp_path, package, how: str):
    """A copy of a tiny package broken one way: its index, a component's config, or its weights."""
    import shutil

    copy = tmp_path / how
    shutil.copytree(package, copy)
    if how == "index":
        (copy / "model_index.json").write_text('{"_class_name": ')
    elif how == "class":
        (copy / "model_index.json").write_text(json.dumps({"_class_name": "NoSuchPipeline"}))
    elif how == "config":
        (copy / "transformer" / "config.json").write_text("{")
    else:  # weights: the transformer's safetensors cut short
        (weights,) = (copy / "transformer").glob("*.safetensors")
        weights.write_bytes(weights.read_bytes()[:100])
    return copy


@pytest.mark.parametrize(
    ("how", "role", "says"),
    [
        ("index", "monolithic", "model_index.json: not valid JSON"),
        ("class", "server", "pipeline 'NoSuchPipeline' is not supported"),
        ("config", "monolithic", "transformer/config.json: not valid JSON"),
        ("weights", "denoiser", "transformer/diffusion_pytorch_model.safetensors"),
    ],
)
def test_serve_exits_with_one_line_naming_the_file_for_a_broken_package(tiny_models, tmp_path, how, role, says):
    """A package that cannot be read or loaded ended in a traceback in every role, a bad config.json
    in one naming no file; now one line, the file and why, exit 2."""
    model = _broken_package(tmp_path, tiny_models["tiny-flux"], how)
    argv = ["--model-path", str(model), "--disagg-role", role]
    if role == "server":
        argv += [f"--{r}-urls=tcp://127.0.0.1:{p}" for r, p in (("encoder", 1), ("denoiser", 2), ("decoder", 3))]
    else:
        argv += ["--device", "cpu"]
    if role not in ("server", "monolithic"):
        argv += ["--disagg-server-addr", "tcp://127.0.0.1:1", "--disagg-transfer-listen-any"]
    proc = subprocess.run([sys.executable, "-m", "triptych", "serve", *argv], capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last.startswith(f"triptych: error: --model-path {model}: ") and says in last, last
    assert "Traceback" not in proc.stderr


HEAD_URLS = [f"--{r}-urls=tcp://127.0.0.1:{p}" for r, p in (("encoder", 1), ("denoiser", 2), ("decoder", 3))]


def serve_refused(argv: list[str], held_port: int | None = None) -> tuple[str, str]:
    """`triptych serve ARGV` (with `held_port` taken by another socket meanwhile), which must stop at
    start-up with exit code 2 and one error line, no traceback: (that line, its stderr)."""
    import socket

    holder = socket.socket()
    if held_port is not None:
        holder.bind(("127.0.0.1", held_port))
        holder.listen()
    try:
        proc = subprocess.run([sys.executable, "-m", "triptych", "serve", *argv], capture_output=True, text=True,
                              timeout=180)  # fmt: skip
    finally:
        holder.close()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("triptych: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0], proc.stderr


@pytest.mark.parametrize("role", ["server", "denoiser"])
def test_serve_exits_with_one_line_naming_the_flag_when_its_port_is_taken(tiny_models, role):
    """A head's or a worker's port held by another process ended in a ZMQ traceback."""
    from triptych_dev.localdeploy import free_port_block

    port = free_port_block(8)
    argv = ["--model-path", str(tiny_models["tiny-flux"]), "--disagg-role", role, "--scheduler-port", str(port)]
    if role == "server":
        argv += ["--port", str(port + 7), *HEAD_URLS]
    else:
        argv += ["--device", "cpu", "--simulate", "--disagg-server-addr", "tcp://127.0.0.1:1",
                 "--disagg-transfer-listen-any"]  # fmt: skip
    error, _ = serve_refused(argv, held_port=port)
    assert error.startswith(f"triptych: error: --scheduler-port {port}: cannot bind tcp://127.0.0.1:{port}"), error


@pytest.mark.parametrize(
    ("role", "address_flag", "says"),
    [("server", "--host", "cannot bind"), ("denoiser", "--disagg-p2p-hostname", "is not an address of this host")],
)
def test_serve_exits_in_one_line_naming_the_address_flag_for_another_host_s_address(
    tiny_models, role, address_flag, says
):
    """A head's --host or a worker's --disagg-p2p-hostname that names another host: the head's bind error
    blamed --scheduler-port, and the worker loaded its model and then died with Mooncake's traceback."""
    from triptych_dev.localdeploy import free_port_block

    port = free_port_block(8)
    argv = ["--model-path", str(tiny_models["tiny-flux"]), "--disagg-role", role, "--scheduler-port", str(port),
            address_flag, "192.0.2.77", "--disagg-insecure"]  # fmt: skip
    if role == "server":
        argv += ["--port", str(port + 7), *HEAD_URLS]
    else:
        argv += ["--device", "cpu", "--simulate", "--disagg-server-addr", "tcp://127.0.0.1:1"]
    error, _ = serve_refused(argv)
    assert error.startswith(f"triptych: error: {address_flag} 192.0.2.77") and says in error, error


@pytest.mark.parametrize("role", ["server", "monolithic"])
def test_a_taken_http_port_stops_the_head_in_one_line_before_a_model_loads(tiny_models, role):
    """uvicorn found it only as it began serving: after a monolithic process had loaded its model, in a
    log line of its own and exit code 3."""
    from triptych_dev.localdeploy import free_port_block

    port = free_port_block(8)
    argv = ["--model-path", str(tiny_models["tiny-flux"]), "--disagg-role", role, "--port", str(port)]
    argv += ["--scheduler-port", str(port + 1), *HEAD_URLS] if role == "server" else ["--device", "cpu"]
    error, stderr = serve_refused(argv, held_port=port)
    assert error.startswith(f"triptych: error: --port {port}: cannot bind 127.0.0.1:{port}: [Errno 98]"), error
    assert "stages " not in stderr  # no model was loaded
