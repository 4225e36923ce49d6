"""The control and transfer planes with zero-compute stages: real processes, ZMQ and Mooncake."""

from __future__ import annotations

import base64
import concurrent.futures

import pytest

from tests.e2e.harness import deployment


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.models.fixtures import tiny_model_path

    return tiny_model_path("tiny-flux")


def test_image_request_flows_through_all_roles(model_dir, tmp_path):
    with deployment(model_dir, tmp_path, null_payload=4096) as dep, dep.client() as c:
        r = c.post("/v1/images/generations", json={"prompt": "x", "size": "32x32", "seed": 1})
        assert r.status_code == 200, r.text
        png = base64.b64decode(r.json()["data"][0]["b64_json"])
        assert png.startswith(b"\x89PNG")
