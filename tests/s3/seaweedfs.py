"""Pytest plugin: a real S3-compatible server (SeaweedFS, built from the Go module proxy by
tests/s3/build.sh) on loopback ports, for the result store's tests. Not a mock: the head's S3
client talks to it over HTTP as it would to AWS S3, MinIO or Ceph.

Registered from tests/conftest.py. Fixtures
  ``s3_server`` (session): a `weed server -s3` (master, volume, filer and S3 gateway in one process)
                           with one identity from an s3 config file this fixture writes; built first
                           when make setup has not (cached, ~5 min once). Stopped at the end.
  ``s3_bucket`` (function): the server's bucket (one for the session: each bucket takes volumes of its
                            own), with its credentials set in the environment (AWS_ACCESS_KEY_ID,
                            AWS_SECRET_ACCESS_KEY) for this test; tests give their heads a prefix of their own.
"""

from __future__ import annotations

import io
import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from triptych_dev.localdeploy import free_port_block

S3_SRC = Path(__file__).resolve().parent
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    access_key: str
    secret_key: str
    log: Path
    bucket: str = "results"

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def client(self):  # type: ignore[no-untyped-def]
        from urllib.parse import urlsplit

        from minio import Minio

        return Minio(urlsplit(self.endpoint).netloc, self.access_key, self.secret_key, secure=False)


def weed_binary() -> Path:
    """The built `weed`, building it when it is missing (idempotent and cached: tests/s3/build.sh)."""
    path = Path(subprocess.run(["bash", str(S3_SRC / "build.sh"), "--print-bin"], capture_output=True, text=True,
                               check=True).stdout.strip())  # fmt: skip
    if not path.is_file():
        subprocess.run(["bash", str(S3_SRC / "build.sh")], check=True, timeout=1800)
    return path


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    weed = weed_binary()
    workdir = tmp_path_factory.mktemp("seaweedfs")
    access, secret = f"triptych{secrets.token_hex(4)}", secrets.token_hex(16)
    config = workdir / "s3.json"
    config.write_text(json.dumps({"identities": [
        {"name": "triptych", "credentials": [{"accessKey": access, "secretKey": secret}],
         "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
    ]}))  # fmt: skip
    base = free_port_block(8)  # master, volume, filer, S3: an HTTP and a gRPC port each
    (workdir / "data").mkdir()
    argv = [
        str(weed), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={workdir / 'data'}",
        f"-master.port={base}", f"-master.port.grpc={base + 1}", "-master.volumeSizeLimitMB=64",
        f"-volume.port={base + 2}", f"-volume.port.grpc={base + 3}", "-volume.max=100",
        "-filer", f"-filer.port={base + 4}", f"-filer.port.grpc={base + 5}",
        "-s3", f"-s3.port={base + 6}", f"-s3.port.grpc={base + 7}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.config={config}",
    ]  # fmt: skip
    log = workdir / "weed.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    server = S3Server(f"http://127.0.0.1:{base + 6}", access, secret, log)
    try:
        _wait_until_serving(server, proc)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_until_serving(server: S3Server, proc: subprocess.Popen[bytes]) -> None:
    """Until a bucket can be made and written (the S3 gateway answers before its filer and volume do)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weed server exited with {proc.returncode}; see {server.log}")
        try:
            client = server.client()
            if not client.bucket_exists(server.bucket):
                client.make_bucket(server.bucket)
            client.put_object(server.bucket, "probe", io.BytesIO(b"x"), 1)
            client.remove_object(server.bucket, "probe")
            return
        except Exception as exc:  # refused, or not ready behind the gateway yet
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weed server did not serve S3 within {START_TIMEOUT_S:g}s ({exc}); see {server.log}"
                ) from exc
            time.sleep(0.3)


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server.bucket
