"""Each process imports only what its image installs: the head and the operator never need torch.

The head image installs the `head` extra, the operator image the `operator` extra (pyproject.toml).
Here each process runs with the other images' packages hidden from its import system, as if they
were not installed, so any import of them fails the test.
tests/images/test_images.py checks the same on the built images.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.images.test_dockerfiles import DOCKERFILES, exec_form, instructions
from triptych.roles import Role
from triptych_dev.localdeploy import local_deployment, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]

WORKER_ONLY = ("torch", "diffusers", "transformers", "accelerate", "safetensors", "peft", "mooncake", "triton")
OPERATOR_ONLY = ("kopf", "kubernetes", "aiohttp")
HEAD_ONLY = ("fastapi", "uvicorn", "numpy", "PIL", "av", "prometheus_client", "msgspec")
# In both the head and the operator image: the operator generates each pipeline's CURVE keys.
ZMQ = ("zmq",)
LOCAL_TOOLING = "triptych_dev"  # in no image


def without(*packages: str) -> str:
    """Python source that hides `packages` from the process that runs it, as if they were not installed:
    every import finder answers "not found" for them (`import torch` raises ModuleNotFoundError and
    `importlib.util.find_spec("torch")` is None, so optional imports take their fallback)."""
    return textwrap.dedent(f"""
        import sys

        class NotInThisImage:
            def __init__(self, finder):
                self.finder = finder

            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in {packages!r}:
                    return None
                return self.finder.find_spec(name, path, target)

            def __getattr__(self, attribute):
                return getattr(self.finder, attribute)

        sys.meta_path[:] = [NotInThisImage(finder) for finder in sys.meta_path]
    """)


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=os.environ.copy()
    )


def test_the_head_and_operator_extras_name_no_worker_package() -> None:
    for extra in ("head", "operator"):
        names = " ".join(EXTRAS[extra]).lower()
        assert not [p for p in ("torch", "diffusers", "transformers", "mooncake") if p in names], extra
    assert "torch>=2.4" in EXTRAS["worker"]


def build_context(dockerfile: Path) -> list[str]:
    """What a Dockerfile copies from the build context (not from another stage)."""
    sources = []
    for args in [a for keyword, a in instructions(dockerfile) if keyword == "COPY"]:
        words = exec_form(args)
        if not any(w.startswith("--from=") for w in words):
            sources += [w.rstrip("/") for w in words if not w.startswith("--")][:-1]
    return sources


def wheel_of(paths: list[str], tmp_path: Path) -> zipfile.ZipFile:
    """The wheel `pip install .` would install from a context holding only `paths` of the repository."""
    context = tmp_path / "context"
    for path in paths:
        source = REPO / path
        if source.is_dir():
            shutil.copytree(
                source, context / path, ignore=shutil.ignore_patterns("__pycache__", "*.so"), dirs_exist_ok=True
            )
        else:
            (context / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, context / path)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "w"),
         str(context)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "w").glob("*.whl")
    return zipfile.ZipFile(wheel)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_images_install_has_no_local_tooling(dockerfile: Path, tmp_path: Path) -> None:
    names = wheel_of(build_context(dockerfile), tmp_path).namelist()
    assert "triptych/cli.py" in names and "triptych_worker/runtime.py" in names
    assert not [n for n in names if n.startswith(f"{LOCAL_TOOLING}/")]


def test_a_dev_install_has_the_local_tooling_and_its_cli_entry_point(tmp_path: Path) -> None:
    wheel = wheel_of(["pyproject.toml", "triptych", "head", "worker", "operator", "devtools"], tmp_path)
    assert "triptych_dev/pool.py" in wheel.namelist()
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "[triptych.commands]\nlocal = triptych_dev.cli:add_commands" in wheel.read(entry_points).decode()


def test_the_cli_help_and_version_need_nothing_but_python() -> None:
    """Nor the local tooling: no image has it, while its entry point is in every image's metadata."""
    main = "from triptych.cli import main; sys.exit(main(sys.argv[1:]))"
    blocked = without(*WORKER_ONLY, *OPERATOR_ONLY, *HEAD_ONLY, *ZMQ, LOCAL_TOOLING) + main
    helped = run_python(blocked, "serve", "--disagg-role", "server", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--disagg-role" in helped.stdout
    version = run_python(blocked, "--version")
    assert (version.returncode, version.stdout.strip()) == (0, "triptych 0.1.0")


def test_the_heads_modules_and_request_validation_import_no_worker_package(tiny_models: dict[str, Path]) -> None:
    flux = tiny_models["tiny-flux"]
    code = without(*WORKER_ONLY, *OPERATOR_ONLY, LOCAL_TOOLING) + textwrap.dedent(f"""
        import triptych_head.api.app, triptych_head.main, triptych_head.server
        from triptych.params import GenerationParams
        validate = triptych_head.main.model_validator({str(flux)!r})
        validate(GenerationParams(prompt="x", width=64, height=64))
        try:
            validate(GenerationParams(prompt="x", width=63, height=64))
        except ValueError as exc:
            print("rejected:", exc)
    """)
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert "rejected:" in out.stdout and "width" in out.stdout


def test_the_operator_and_metrics_api_import_no_head_or_worker_package() -> None:
    code = without(*WORKER_ONLY, *HEAD_ONLY, LOCAL_TOOLING) + textwrap.dedent("""
        import triptych_operator.handlers, triptych_operator.main, triptych_operator.metrics_api.main
        from triptych_operator.main import main
        sys.exit(main(["--version"]))
    """)
    out = run_python(code)
    assert (out.returncode, out.stdout.strip()) == (0, "triptych-operator 0.1.0"), out.stderr


@pytest.mark.slow
def test_a_running_head_serves_requests_without_any_worker_package(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """The head restarted (as a pod would be) under the blocker, behind real null-pipeline workers."""
    with local_deployment(tiny_models["tiny-flux"], tmp_path, null_payload_bytes=4096) as dep:
        dep.head.kill()
        main = "from triptych.cli import main; sys.exit(main(sys.argv[1:]))"
        python, dash_m, module, *args = dep.head_argv
        assert (dash_m, module) == ("-m", "triptych")
        dep.head_argv = [python, "-c", without(*WORKER_ONLY, *OPERATOR_ONLY, LOCAL_TOOLING) + main, *args]
        dep.start_head()
        wait_until_ready(dep, 3, timeout=60)
        body = {"prompt": "a red square", "size": "32x32", "seed": 1, "num_inference_steps": 2}
        r = httpx.post(f"{dep.http}/v1/images/generations", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert base64.b64decode(r.json()["data"][0]["b64_json"]).startswith(b"\x89PNG")
        bad = httpx.post(f"{dep.http}/v1/images/generations", json={**body, "size": "33x32"}, timeout=60)
        assert bad.status_code == 400, bad.text
        assert dep.head.popen.poll() is None
        assert "No module named" not in dep.head.log.read_text()
    assert {p.role for p in dep.procs} == {Role.SERVER, Role.ENCODER, Role.DENOISER, Role.DECODER}


def test_tiny_model_packages_are_readable_by_the_images_non_root_user(tiny_models: dict[str, Path]) -> None:
    for package in tiny_models.values():
        for folder in [package, *(p for p in package.rglob("*") if p.is_dir())]:
            assert folder.stat().st_mode & 0o005 == 0o005, (
                f"{folder} is not readable by others (mode {folder.stat().st_mode:o})"
            )
        assert all(f.stat().st_mode & 0o004 for f in package.rglob("*") if f.is_file())


def test_monolithic_mode_without_the_worker_extra_says_which_extra_it_needs(tiny_models: dict[str, Path]) -> None:
    main = "from triptych.cli import main; sys.exit(main(sys.argv[1:]))"
    flags = ["--model-path", str(tiny_models["tiny-flux"]), "--disagg-role", "monolithic", "--port", "1"]
    out = run_python(without(*WORKER_ONLY, *OPERATOR_ONLY, LOCAL_TOOLING) + main, "serve", *flags)
    assert out.returncode == 2, out.stderr
    assert "--disagg-role monolithic needs torch" in out.stderr
    assert "pip install 'triptych[worker]'" in out.stderr
