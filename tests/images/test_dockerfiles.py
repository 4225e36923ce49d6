"""The Dockerfiles as users build them: what a build would trip on, read without building.

Every COPY source exists in the repository, every entrypoint is a console script the project
declares, the final stage runs as a numeric non-root user, the base is an upstream default that
only `--build-arg BASE_IMAGE=...` changes, and no package index is written into a Dockerfile.
tests/images/test_images.py builds and runs them.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from triptych_operator.serve_args import SERVE_COMMAND

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "images").glob("*.Dockerfile"))
SCRIPTS = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    return steps[last_from:]


def exec_form(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def test_there_are_the_three_images() -> None:
    assert [p.name for p in DOCKERFILES] == ["head.Dockerfile", "operator.Dockerfile", "worker.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_path_exists(dockerfile: Path) -> None:
    copies = [args for keyword, args in instructions(dockerfile) if keyword in ("COPY", "ADD")]
    assert copies
    for args in copies:
        words = exec_form(args)
        if any(w.startswith("--from=") for w in words):
            continue  # from another stage, not the build context
        sources = [w for w in words if not w.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source} does not exist in the repository"


SHIPPED_FOLDERS = {"triptych/", "head/", "worker/", "operator/"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_code_copied_is_the_shipped_packages_never_the_local_tooling(dockerfile: Path) -> None:
    """`pip install .` installs what the build context holds: devtools/ (triptych_dev) must not be there."""
    sources = []
    for args in [a for keyword, a in instructions(dockerfile) if keyword in ("COPY", "ADD")]:
        words = exec_form(args)
        if not any(w.startswith("--from=") for w in words):
            sources += [w for w in words if not w.startswith("--")][:-1]
    assert not [s for s in sources if s.rstrip("/") in (".", "devtools") or s.startswith("devtools/")], sources
    assert SHIPPED_FOLDERS <= set(sources), sources


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_is_a_declared_console_script(dockerfile: Path) -> None:
    stage = dict(final_stage(dockerfile))
    command = exec_form(stage.get("ENTRYPOINT") or stage["CMD"])
    assert command[0] in SCRIPTS, f"{dockerfile.name} runs {command[0]!r}; pyproject declares {sorted(SCRIPTS)}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_runs_as_a_numeric_non_root_user(dockerfile: Path) -> None:
    users = [args for keyword, args in final_stage(dockerfile) if keyword == "USER"]
    assert users, f"{dockerfile.name} sets no USER: it would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{dockerfile.name}: USER {users[-1]} is not a numeric non-root uid"


def test_commands_the_operator_and_chart_run_are_console_scripts() -> None:
    assert SERVE_COMMAND[0] in SCRIPTS
    chart_deployment = (REPO / "charts" / "triptych" / "templates" / "deployment.yaml").read_text()
    assert "command: [triptych-operator]" in chart_deployment
    assert "triptych-operator" in SCRIPTS


UPSTREAM_BASES = {
    "head.Dockerfile": "python:3.11-slim",
    "operator.Dockerfile": "python:3.11-slim",
    "worker.Dockerfile": "nvidia/cuda:",
}
EXTRAS = {"head.Dockerfile": ["head"], "operator.Dockerfile": ["operator"],
          "worker.Dockerfile": ["head", "worker", "${MOONCAKE_EXTRA}"]}  # fmt: skip


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_base_is_the_upstream_image_unless_a_build_arg_says_otherwise(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    assert steps[0][0] == "ARG" and steps[0][1].startswith(f"BASE_IMAGE={UPSTREAM_BASES[dockerfile.name]}")
    froms = [args.split()[0] for keyword, args in steps if keyword == "FROM"]
    assert froms[0] == "${BASE_IMAGE}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_no_package_index_host_is_written_into_a_dockerfile(dockerfile: Path) -> None:
    runs = " ".join(args for keyword, args in instructions(dockerfile) if keyword == "RUN")
    assert "--index-url" not in runs and "--extra-index-url" not in runs
    assert [args for keyword, args in instructions(dockerfile) if keyword == "ARG" and "PIP_INDEX_URL" in args] == [
        "PIP_INDEX_URL=https://pypi.org/simple"
    ]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_build_s_package_index_is_not_kept_in_the_image_s_environment(dockerfile: Path) -> None:
    """A mirror's URL (often with its credentials) is a build argument, which RUN sees as a variable;
    an ENV would keep it in the image's configuration, for every container and `inspect` to read."""
    envs = [args for keyword, args in instructions(dockerfile) if keyword == "ENV" and "PIP_INDEX_URL" in args]
    assert envs == [], f"{dockerfile.name}: ENV {envs[0]}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_each_image_installs_its_own_extras_then_the_project_without_dependencies(dockerfile: Path) -> None:
    runs = [args for keyword, args in instructions(dockerfile) if keyword == "RUN"]
    listed = [shlex.split(r.split(">")[0]) for r in runs if "requirements.py" in r]
    assert len(listed) == 1 and listed[0][1:3] == ["/src/requirements.py", "/src/pyproject.toml"]
    assert listed[0][3:] == EXTRAS[dockerfile.name]
    installs = [r for r in runs if "pip install" in r]
    assert len(installs) == 2
    assert installs[0].endswith("pip install -c constraints.txt -r requirements.txt")
    assert "pip install --no-deps ." in installs[1]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_dependencies_layer_comes_before_the_code_so_a_code_change_reuses_it(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    deps = next(i for i, (k, a) in enumerate(steps) if k == "RUN" and "-r requirements.txt" in a)
    code = [i for i, (k, a) in enumerate(steps) if k == "COPY" and a.split()[0] in ("triptych/", "head/", "worker/")]
    assert code and min(code) > deps
    # pip's cache never lands in a layer: every install mounts it as a build cache.
    assert all("--mount=type=cache,target=/root/.cache/pip" in a for k, a in steps if k == "RUN" and "pip install" in a)


def test_the_requirements_script_lists_exactly_the_extras_requirements() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out = subprocess.run([sys.executable, str(REPO / "images" / "requirements.py"), str(REPO / "pyproject.toml"),
                          "head", "cpu"], capture_output=True, text=True, check=True, timeout=30)  # fmt: skip
    assert out.stdout.split() == sorted(set(declared["head"]) | set(declared["cpu"]))
    bad = subprocess.run([sys.executable, str(REPO / "images" / "requirements.py"), str(REPO / "pyproject.toml"),
                          "gpu"], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert bad.returncode != 0 and "no extra ['gpu']" in bad.stderr
