"""The HTTP API over TLS (--ssl-certfile / --ssl-keyfile): a real monolithic tiny-FLUX head serving
HTTPS with a self-signed certificate. A client trusting that certificate gets the same PNG over
HTTPS as the CLI does (`triptych generate`, trusting it through SSL_CERT_FILE); plain HTTP on the
port gets no answer, and a client that does not trust the certificate is refused. A renewed pair
swapped into the files is served to new connections without a restart."""

from __future__ import annotations

import base64
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.certs import der, self_signed
from triptych_dev.localdeploy import free_port_block

pytestmark = pytest.mark.slow

IMAGE = {"prompt": "a lighthouse", "size": "32x32", "seed": 4, "num_inference_steps": 2}


def test_the_api_is_served_over_https_and_plain_http_is_not_answered(tiny_models, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path / "tls")
    port = free_port_block(1)
    log = (tmp_path / "head.log").open("wb")
    head = subprocess.Popen(
        [sys.executable, "-m", "triptych", "serve", "--model-path", str(tiny_models["tiny-flux"]), "--port", str(port),
         "--output-path", str(tmp_path / "out"), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    trusted = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 180
        while True:
            assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", verify=trusted, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(0.3)
        answer = httpx.post(f"{url}/v1/images/generations", json=IMAGE, verify=trusted, timeout=120)
        assert answer.status_code == 200, answer.text
        png = base64.b64decode(answer.json()["data"][0]["b64_json"])
        out = tmp_path / "cli.png"
        cli = subprocess.run(
            [sys.executable, "-m", "triptych", "generate", IMAGE["prompt"], "-o", str(out), "--url", url,
             "--size", "32x32", "--seed", "4", "--steps", "2"],
            env={**os.environ, "SSL_CERT_FILE": str(cert)}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert out.read_bytes() == png
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # no plain-HTTP answer on a TLS port
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/health", timeout=5)  # the system's CAs do not vouch for it

        renewed, renewed_key = self_signed(tmp_path / "renewed")
        os.replace(renewed_key, key)  # as a renewal would: the files swapped under the running head
        os.replace(renewed, cert)
        deadline = time.monotonic() + 60
        while ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate(("127.0.0.1", port), timeout=5)) != der(cert):
            assert time.monotonic() < deadline, "the head never served the renewed certificate"
            time.sleep(0.5)
        again = httpx.get(f"{url}/health", verify=ssl.create_default_context(cafile=str(cert)), timeout=5)
        assert again.status_code == 200, "a client trusting the renewed certificate is served"
    finally:
        head.terminate()
        head.wait(timeout=60)
        log.close()
