"""Write a one-layer OCI image archive holding one static binary, for `ctr images import`.

    python3 oci_archive.py NAME:TAG OUT.tar BINARY PATH_IN_IMAGE

The real node's pod sandbox image (the pause binary) is made this way: no registry, no container engine.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path


def _blob(tar: tarfile.TarFile, data: bytes, media_type: str) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def write_archive(name: str, out: Path, binary: Path, path_in_image: str) -> None:
    layer_tar = io.BytesIO()
    with tarfile.open(fileobj=layer_tar, mode="w", format=tarfile.PAX_FORMAT) as layer:
        info = layer.gettarinfo(str(binary), arcname=path_in_image.lstrip("/"))
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        with binary.open("rb") as f:
            layer.addfile(info, f)
    diff = layer_tar.getvalue()
    compressed = gzip.compress(diff, mtime=0)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": [path_in_image]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(diff).hexdigest()}"]},
    }
    with tarfile.open(out, "w") as tar:
        layer_desc = _blob(tar, compressed, "application/vnd.oci.image.layer.v1.tar+gzip")
        config_desc = _blob(tar, json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config_desc,
            "layers": [layer_desc],
        }
        manifest_desc = _blob(tar, json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
        manifest_desc["annotations"] = {
            "io.containerd.image.name": name,
            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
        }
        manifest_desc["platform"] = {"architecture": "amd64", "os": "linux"}
        for fname, content in (
            ("oci-layout", {"imageLayoutVersion": "1.0.0"}),
            ("index.json", {"schemaVersion": 2, "manifests": [manifest_desc]}),
        ):
            data = json.dumps(content).encode()
            info = tarfile.TarInfo(fname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    write_archive(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
