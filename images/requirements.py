"""Print the requirements of some of the project's extras, one a line, read from pyproject.toml.

    python images/requirements.py pyproject.toml head worker cpu >requirements.txt

The Dockerfiles install these in a layer of their own before they copy the code, so a change to the
code (or to another setting of pyproject.toml) rebuilds only the small layer that installs the project.
Standard library only: it runs on the bare base image.
"""

import sys
import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        declared = tomllib.load(f)["project"]["optional-dependencies"]
    unknown = [e for e in extras if e not in declared]
    if unknown:
        raise SystemExit(f"requirements.py: no extra {unknown} in {pyproject} (declared: {sorted(declared)})")
    return sorted({r for e in extras for r in declared[e]})


if __name__ == "__main__":
    print(*requirements(sys.argv[1], sys.argv[2:]), sep="\n")
