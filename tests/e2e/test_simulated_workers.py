"""Simulated workers in a real deployment: requests complete through the real transfer path, and a
worker started or drained while the head runs joins or leaves (tests/e2e/harness.py helpers)."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
from PIL import Image

from tests.e2e.harness import deployment
from triptych.roles import Role

pytestmark = pytest.mark.slow

INSTANT = ("--simulate-seconds", "0", "--simulate-seconds-per-unit", "0")
# A drain lasts until the head acknowledges it, or --disagg-drain-timeout.
FAST = {Role.ENCODER: INSTANT, Role.DENOISER: (*INSTANT, "--disagg-drain-timeout", "3"), Role.DECODER: INSTANT}


def alive(c, role: Role) -> int:
    return sum(w["alive"] for w in c.get("/health").json()["workers"][role.value])


def test_a_simulated_deployment_serves_images_and_takes_a_worker_added_and_one_drained(tiny_models, tmp_path):
    flux, spare = tiny_models["tiny-flux"], {Role.DENOISER: 1}
    with deployment(flux, tmp_path, simulate=True, role_flags=FAST, spare=spare) as dep:
        with dep.client(timeout=30) as c:
            body = {"prompt": "x", "size": "64x32", "num_inference_steps": 2, "seed": 1}
            r = c.post("/v1/images/generations", json=body)
            assert r.status_code == 200, r.text
            image = np.array(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
            assert image.shape == (32, 64, 3) and not image.any()  # the simulated decoder's black pixels

            added = dep.start_worker(Role.DENOISER)
            deadline = time.monotonic() + 20
            while alive(c, Role.DENOISER) < 2:
                assert time.monotonic() < deadline, f"the added denoiser never joined:\n{added.tail()}"
                time.sleep(0.2)
            assert c.post("/v1/images/generations", json=body).status_code == 200

            started = time.monotonic()
            assert dep.stop_worker(added, drain=True, timeout=20) == 0  # SIGTERM: drained, exit 0
            assert time.monotonic() - started < 10
            assert dep.spare[Role.DENOISER] == [int(added.url.rsplit(":", 1)[1])]  # free for start_worker again
            deadline = time.monotonic() + 20
            while alive(c, Role.DENOISER) > 1:  # the head lets it go (at the latest when its heartbeats stop)
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert c.post("/v1/images/generations", json=body).status_code == 200
