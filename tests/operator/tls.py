"""Throwaway certificates for tests (openssl CLI, as tests/cluster/up.sh makes the cluster's)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _run(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (cert, key)."""
    crt, key = directory / f"{name}.crt", directory / f"{name}.key"
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt), "-days", "2",
         "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature")  # fmt: skip
    return crt, key


def make_cert(
    directory: Path, name: str, ca: tuple[Path, Path], *, cn: str, san: str | None, usage: str
) -> tuple[Path, Path]:
    """A leaf certificate signed by `ca`: (cert, key). `usage` is serverAuth or clientAuth."""
    crt, key, csr, ext = (directory / f"{name}.{x}" for x in ("crt", "key", "csr", "ext"))
    _run("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}")
    lines = [
        "basicConstraints=CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if san:
        lines.append(f"subjectAltName={san}")
    ext.write_text("\n".join(lines) + "\n")
    _run("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
         "-out", str(crt), "-days", "2", "-extfile", str(ext))  # fmt: skip
    return crt, key
