"""The Mooncake wheels are pinned, and the bind shim's contract holds for the wheel it runs with.

The shim (bind_shim.c, scripts/build-bind-shim.sh) works only while Mooncake's libraries call
libc's bind() through the dynamic linker: each library that binds a listener imports `bind` as an
undefined dynamic symbol (so the preloaded shim's definition wins) and none defines a `bind` of its
own; and the transfer engine reads the variables triptych_worker.transfer.listeners sets for it
(MC_MIN_RPC_PORT/MC_MAX_RPC_PORT: the port range the shim rewrites; MC_USE_IPV6). This is checked
with `nm -D` on the installed non-CUDA wheel and, when TRIPTYCH_MOONCAKE_CUDA_WHEEL names a
downloaded CUDA wheel (`pip download --no-deps mooncake-transfer-engine==<its pin>`), on that
wheel's libraries extracted (never installed).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_DIST, CUDA_DIST = "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"
ENGINE_VARIABLES = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT", "MC_USE_IPV6")


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if m := re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip()):
            out[m[1].lower()] = m[2]
    return out


def nm(lib: Path, *flags: str) -> set[str]:
    tool = shutil.which("nm")
    assert tool, "nm (binutils) is missing: `make setup` installs gcc, which brings it"
    out = subprocess.run([tool, "-D", *flags, str(lib)], capture_output=True, text=True, timeout=60, check=True)
    return {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.split()}


def shim_contract_problems(libs: list[Path]) -> list[str]:
    """What in these Mooncake libraries would defeat the bind shim; empty when nothing does."""
    problems = []
    binders = []
    for lib in libs:
        if "bind" in nm(lib, "--defined-only"):
            problems.append(f"{lib.name} defines its own bind(): the preloaded shim would not see its binds")
        if "bind" in nm(lib, "--undefined-only"):
            binders.append(lib.name)
    engine = [lib for lib in libs if lib.name == "engine.so"]
    if not engine:
        problems.append("no mooncake/engine.so (the transfer engine) in the wheel")
    else:
        if "engine.so" not in binders:
            problems.append("engine.so imports no bind(): its listeners would bypass the shim")
        data = engine[0].read_bytes()
        problems += [f"engine.so does not read {v}" for v in ENGINE_VARIABLES if v.encode() + b"\0" not in data]
    return problems


def wheel_libraries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.so*") if p.is_file() and ".so" in p.name)


def test_both_mooncake_wheels_are_pinned_to_the_same_version():
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    named = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for e in ("cuda", "cpu") for r in extras[e]}
    assert named == {CPU_DIST, CUDA_DIST}
    pinned = pins()
    assert CPU_DIST in pinned and CUDA_DIST in pinned, "constraints.txt pins both Mooncake wheels"
    assert pinned[CUDA_DIST] == pinned[CPU_DIST]


def test_the_installed_non_cuda_wheel_is_the_pinned_one():
    assert importlib.metadata.version(CPU_DIST) == pins()[CPU_DIST]


def test_the_shim_contract_holds_for_the_installed_non_cuda_wheel():
    files = importlib.metadata.files(CPU_DIST) or []
    libs = [Path(str(f.locate())) for f in files if ".so" in f.name and f.name != "_fast_copy.c"]
    assert any(lib.name == "engine.so" for lib in libs)
    assert shim_contract_problems(libs) == []


def test_the_shim_contract_check_fails_on_a_library_that_defines_bind(tmp_path):
    """The check can fail: a library with its own bind() (the shim itself, as a stand-in) is named."""
    shim = tmp_path / "libbind.so"
    subprocess.run(["bash", str(ROOT / "scripts/build-bind-shim.sh"), str(shim)], check=True, timeout=120)
    assert "bind" in nm(shim, "--defined-only")
    problems = shim_contract_problems([shim])
    assert any("libbind.so defines its own bind()" in p for p in problems)
    assert any("no mooncake/engine.so" in p for p in problems)


def test_the_shim_contract_holds_for_the_pinned_cuda_wheel(tmp_path):
    wheel = os.environ.get("TRIPTYCH_MOONCAKE_CUDA_WHEEL")
    if not wheel:
        pytest.skip(
            "TRIPTYCH_MOONCAKE_CUDA_WHEEL unset: `pip download --no-deps "
            f"{CUDA_DIST}=={pins().get(CUDA_DIST)}` and name the .whl to check the CUDA wheel too"
        )
    name = Path(wheel).name
    assert name.startswith(f"{CUDA_DIST.replace('-', '_')}-{pins()[CUDA_DIST]}-"), f"{name} is not the pinned wheel"
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if ".so" in member.rsplit("/", 1)[-1]:
                z.extract(member, tmp_path)
    libs = wheel_libraries(tmp_path)
    assert any(lib.name == "engine.so" for lib in libs)
    assert shim_contract_problems(libs) == []
