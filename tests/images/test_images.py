"""The built images: each starts its entrypoint as the non-root user and answers --help/--version.

A session fixture runs `scripts/images.sh operator head worker` (cached by content: seconds when nothing
changed; a code change rebuilds only the layer that installs the project; cold, README "What setup and
tests cost"). tests/cluster/test_real_node.py runs the same three images as pods.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.setup_check import missing
from triptych import __version__
from triptych.roles import Role
from triptych_dev.localdeploy import free_port_block, local_deployment, wait_until_ready
from triptych_operator.constants import RUN_AS_USER

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "images.sh"
ENV = {**os.environ, "CONTAINERS_CONF": str(REPO / "images" / "local" / "containers.conf")}
TAG = f"localhost/triptych-{{}}:{__version__}"
MAX_CPU_IMAGE_BYTES = 400 * 10**6
WORKER_ONLY = ("torch", "diffusers", "transformers", "mooncake")


def images_sh(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def run(image: str, *args: str, entrypoint: str | None = None, volumes: tuple[str, ...] = ()) -> str:
    """`podman run --rm` the image as its own USER (no --user override); stdout, or fail with stderr."""
    flags = [f"--entrypoint={entrypoint}"] if entrypoint else []
    for v in volumes:
        flags += ["--volume", v]
    out = podman("run", "--rm", "--network=none", *flags, image, *args)
    assert out.returncode == 0, f"{image} {args}: exit {out.returncode}\n{out.stderr}"
    return out.stdout


@pytest.fixture(scope="session")
def built() -> dict[str, str]:
    """name -> tag of the three images, built from the current sources."""
    if shutil.which("podman") is None:
        missing("podman", "`make setup` installs it: scripts/setup.sh")
    names = ("operator", "head", "worker")
    out = images_sh(*names, timeout=2400)
    assert out.returncode == 0, out.stdout + out.stderr
    return {name: TAG.format(name) for name in names}


def image(built: dict[str, str], name: str) -> str:
    return built[name]


@pytest.mark.parametrize("name", ["operator", "head", "worker"])
def test_the_image_runs_as_the_numeric_non_root_user(built: dict[str, str], name: str) -> None:
    tag = image(built, name)
    assert podman("image", "inspect", "--format", "{{.Config.User}}", tag).stdout.strip() == (
        f"{RUN_AS_USER}:{RUN_AS_USER}"
    )
    assert run(tag, "-u", entrypoint="id").strip() == str(RUN_AS_USER)
    assert run(tag, "-g", entrypoint="id").strip() == str(RUN_AS_USER)


@pytest.mark.parametrize("name", ["operator", "head", "worker"])
def test_the_image_keeps_no_package_index_in_its_environment(built: dict[str, str], name: str) -> None:
    """The build's index (scripts/images.sh passes this machine's) was a build argument only."""
    env = podman("image", "inspect", "--format", "{{json .Config.Env}}", image(built, name)).stdout
    assert "PIP_INDEX_URL" not in env, env


def test_the_operator_entrypoints_answer_version_and_help(built: dict[str, str]) -> None:
    tag = image(built, "operator")
    assert run(tag, "--version").strip() == f"triptych-operator {__version__}"
    assert "--namespace" in run(tag, "--help")
    assert "--tls-cert-file" in run(tag, "--help", entrypoint="triptych-metrics-api")


def test_the_operator_image_imports_everything_the_operator_runs(built: dict[str, str]) -> None:
    """--version answers before the handlers load: import them (and the key generation they use)."""
    code = "import triptych_operator.handlers, triptych_operator.metrics_api.main; print('imported')"
    assert run(image(built, "operator"), "-c", code, entrypoint="python").strip() == "imported"


@pytest.mark.parametrize("name", ["head", "worker"])
def test_the_triptych_entrypoint_answers_version_and_serve_help(built: dict[str, str], name: str) -> None:
    tag = image(built, name)
    assert run(tag, "--version").strip() == f"triptych {__version__}"
    assert "--disagg-role" in run(tag)  # the default command: serve --help
    assert "--disagg-role" in run(tag, "serve", "--disagg-role", "server", "--help")


@pytest.mark.parametrize("name", ["operator", "head", "worker"])
def test_no_image_carries_the_local_tooling(built: dict[str, str], name: str) -> None:
    """triptych_dev (devtools/) is for development only; the CLI leaves its subcommands out."""
    tag = image(built, name)
    probe = "import importlib.util as u; print(u.find_spec('triptych_dev'))"
    assert run(tag, "-c", probe, entrypoint="python").strip() == "None"
    if name != "operator":
        assert "models" not in run(tag, "--help")


@pytest.mark.parametrize("name", ["operator", "head"])
def test_the_cpu_images_carry_no_worker_package_and_stay_small(built: dict[str, str], name: str) -> None:
    tag = image(built, name)
    probe = f"import importlib.util as u; print([m for m in {WORKER_ONLY!r} if u.find_spec(m)])"
    assert run(tag, "-c", probe, entrypoint="python").strip() == "[]"
    size = int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout)
    assert size < MAX_CPU_IMAGE_BYTES, f"{tag} is {size / 1e6:.0f} MB"


def test_the_head_image_validates_requests_against_a_read_only_model_volume(
    built: dict[str, str], tiny_models: dict[str, Path]
) -> None:
    """The head's request validation in the image, as uid 10001, reading the model the way a pod mounts it."""
    tag = image(built, "head")
    probe = (
        "from triptych_head.main import model_validator; from triptych.params import GenerationParams\n"
        "check = model_validator('/models/tiny-flux'); check(GenerationParams(prompt='x', width=64, height=64))\n"
        "try:\n    check(GenerationParams(prompt='x', width=63, height=64))\n"
        "except ValueError as exc:\n    print('rejected:', exc)\n"
    )
    mount = f"{tiny_models['tiny-flux']}:/models/tiny-flux:ro"
    out = run(tag, "-c", probe, entrypoint="python", volumes=(mount,))
    assert out.startswith("rejected:") and "width" in out


def test_the_head_image_refuses_monolithic_mode_naming_the_worker_extra(
    built: dict[str, str], tiny_models: dict[str, Path]
) -> None:
    tag = image(built, "head")
    mount = f"{tiny_models['tiny-flux']}:/models/tiny-flux:ro"
    args = ["serve", "--model-path", "/models/tiny-flux", "--disagg-role", "monolithic"]
    out = podman("run", "--rm", "--network=none", "--volume", mount, tag, *args)
    assert out.returncode == 2, out.stderr
    assert "needs torch" in out.stderr and "triptych[worker]" in out.stderr


def test_the_head_image_serves_requests_from_real_workers(
    built: dict[str, str], tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """The head restarted (as a pod would be) from its image, as uid 10001, behind null-pipeline workers
    on this host: the model mounted read-only, the results volume writable, loopback only."""
    tag = image(built, "head")
    model = tiny_models["tiny-flux"]
    name = f"triptych-head-test-{uuid.uuid4().hex[:8]}"
    with local_deployment(model, tmp_path, null_payload_bytes=4096) as dep:
        dep.head.kill()
        _python, dash_m, module, serve, *args = dep.head_argv
        assert (dash_m, module, serve) == ("-m", "triptych", "serve")
        outputs = tmp_path / "outputs"
        shutil.rmtree(outputs, ignore_errors=True)  # the local head (root) made its staging dir there
        outputs.mkdir()
        outputs.chmod(0o777)  # a results volume the pod's user can write
        volumes = [f"--volume={model}:{model}:ro", f"--volume={outputs}:{outputs}"]
        if dep.keys_dir is not None:  # the key set, readable by the pod's user as the operator's mount is
            keys = tmp_path / "head-keys"
            shutil.copytree(dep.keys_dir, keys)
            for path in (keys, *keys.iterdir()):
                os.chown(path, RUN_AS_USER, RUN_AS_USER)
            volumes.append(f"--volume={keys}:{dep.keys_dir}:ro")
        dep.head_argv = ["podman", "run", "--rm", f"--name={name}", "--network=host", *volumes, tag, "serve", *args]
        dep.env = {**dep.env, **ENV}
        try:
            dep.start_head()
            wait_until_ready(dep, 3, timeout=120)
            body = {"prompt": "a red square", "size": "32x32", "seed": 1, "num_inference_steps": 2}
            r = httpx.post(f"{dep.http}/v1/images/generations", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert base64.b64decode(r.json()["data"][0]["b64_json"]).startswith(b"\x89PNG")
            inside = podman("exec", name, "id", "-u")
            assert inside.stdout.strip() == str(RUN_AS_USER), inside.stderr
        finally:
            podman("rm", "--force", "--time=0", name)


def test_the_worker_image_imports_torch_diffusers_and_mooncake(built: dict[str, str]) -> None:
    tag = image(built, "worker")
    probe = "import torch, diffusers, mooncake.engine, triptych_worker.runtime; print(torch.__version__)"
    assert run(tag, "-c", probe, entrypoint="python").strip().startswith("2.")


def test_the_worker_image_serves_the_whole_pipeline_on_cpu(
    built: dict[str, str], tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Monolithic mode from the worker image: torch, diffusers and the head in one process, as uid
    10001, reading the model read-only; loopback only."""
    tag = image(built, "worker")
    model, port = tiny_models["tiny-flux"], free_port_block(1)
    name = f"triptych-worker-test-{uuid.uuid4().hex[:8]}"
    argv = ["podman", "run", "--rm", f"--name={name}", "--network=host", f"--volume={model}:/models/tiny-flux:ro",
            tag, "serve", "--model-path", "/models/tiny-flux", "--disagg-role", "monolithic", "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--output-path", "/tmp/outputs"]  # fmt: skip
    with (tmp_path / "worker.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
            time.sleep(0.5)
        body = {"prompt": "a red square", "size": "32x32", "seed": 1, "num_inference_steps": 2}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/images/generations", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert base64.b64decode(r.json()["data"][0]["b64_json"]).startswith(b"\x89PNG")
    finally:
        podman("rm", "--force", "--time=0", name)
        proc.wait(30)


def test_a_worker_from_the_image_joins_a_running_deployment_and_moves_tensors_through_mooncake(
    built: dict[str, str], tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """A simulated decoder (real sockets, pool and Mooncake TCP writes, no weights) from the worker
    image, as uid 10001, takes a spare port of a deployment whose head and other roles run here."""
    tag = image(built, "worker")
    model = tiny_models["tiny-flux"]
    name = f"triptych-decoder-test-{uuid.uuid4().hex[:8]}"
    counts = {Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 0}
    flags = ("--device", "cpu", "--simulate")
    with local_deployment(model, tmp_path, counts, worker_flags=flags, spare={Role.DECODER: 1}) as dep:
        port = int(dep.spare[Role.DECODER][0])
        volumes, key_args = [f"--volume={model}:{model}:ro"], []
        if dep.keys_dir is not None:  # the deployment's key set, readable by the pod's user as the operator's mount is
            keys = tmp_path / "decoder-keys"
            shutil.copytree(dep.keys_dir, keys)
            for path in (keys, *keys.iterdir()):
                os.chown(path, RUN_AS_USER, RUN_AS_USER)
            volumes.append(f"--volume={keys}:{dep.keys_dir}:ro")
            key_args = ["--disagg-keys-dir", str(dep.keys_dir)]
        argv = ["podman", "run", "--rm", f"--name={name}", "--network=host", *volumes, tag,
                "serve", "--model-path", str(model), "--disagg-role", "decoder", "--scheduler-port", str(port),
                "--disagg-server-addr", f"tcp://127.0.0.1:{dep.scheduler_port}", "--disagg-p2p-hostname", "127.0.0.1",
                *key_args, *flags]  # fmt: skip
        with (tmp_path / "decoder-image.log").open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=ENV)
        try:
            wait_until_ready(dep, 3, timeout=120)
            body = {"prompt": "a red square", "size": "32x32", "seed": 1, "num_inference_steps": 2}
            r = httpx.post(f"{dep.http}/v1/images/generations", json=body, timeout=60)
            assert r.status_code == 200, r.text + (tmp_path / "decoder-image.log").read_text()
            assert base64.b64decode(r.json()["data"][0]["b64_json"]).startswith(b"\x89PNG")
        finally:
            podman("rm", "--force", "--time=0", name)
            proc.wait(30)


def test_a_rebuild_with_nothing_changed_takes_seconds(built: dict[str, str]) -> None:
    start = time.monotonic()
    out = images_sh(*built)
    assert out.returncode == 0, out.stderr
    took = time.monotonic() - start
    # Hashing the sources and a few `podman image inspect`s take seconds; rebuilding any image, minutes.
    assert took < 30, f"images.sh took {took:.0f}s with nothing to rebuild"
    assert all(f"{tag} is up to date" in out.stdout for tag in built.values()), out.stdout
