"""What a client reads when monolithic mode's run fails (LocalBackend, every stage in the head's process).

The stages are the ones a worker runs: their failure (the model's own, CUDA out of memory) is a 500
saying it, type and text, as a worker's error is in disaggregated mode (docs/security.md: a worker's
error, 500). A failure of the head's own code around them is `internal error (request <id>)`, the
cause in the head's log only (docs/results.md), as the disaggregated path's unexpected failures are.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from tests.api.test_http_api import make_client, wait_for
from triptych.params import GenerationParams
from triptych_head.backend import LocalBackend

VIDEO = {"prompt": "waves", "size": "32x16", "num_frames": 5, "num_inference_steps": 2, "seed": 7}
IMAGE = {"prompt": "cat", "size": "32x32", "response_format": "b64_json"}
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)"
PRIVATE = "relay to /var/lib/triptych/step-cache failed on 10.0.3.7"


class FailingPipeline:
    """Monolithic mode's pipeline, stood in for: its stages raise `fail` (None: they succeed)."""

    step_cache = None

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail

    def validate(self, params: GenerationParams) -> None:
        pass

    def generate(self, params: GenerationParams, on_progress: Any, preview_every: int = 0) -> np.ndarray:
        if self.fail is not None:
            raise self.fail
        return np.zeros((params.num_outputs, params.num_frames, params.height, params.width, 3), dtype=np.uint8)


def _broken_relay() -> None:
    raise RuntimeError(PRIVATE)


@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_stage_s_own_failure_is_a_500_saying_it_as_a_worker_s_error_does(kind: str, tmp_path, caplog) -> None:
    backend = LocalBackend(FailingPipeline(RuntimeError(OOM)))  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR), make_client(backend, tmp_path, kind=kind) as c:
        if kind == "image":
            r = c.post("/v1/images/generations", json=IMAGE)
            assert r.status_code == 500, r.text
            error = r.json()["error"]
        else:
            job = wait_for(c, c.post("/v1/videos", json=VIDEO).json()["id"], "failed")
            error = job["error"]
    assert error["message"] == f"RuntimeError: {OOM}" and error["code"] == "failed", error
    assert OOM in caplog.text and "Traceback" in caplog.text


@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_failure_of_the_head_s_own_code_is_an_internal_error_naming_only_the_request(
    kind: str, tmp_path, caplog
) -> None:
    """The pipeline ran; the head's code after it (here the step-cache relay monolithic mode runs after
    each request) raised: its words (a path, an address) were the client's error, `RuntimeError: ...`."""
    backend = LocalBackend(FailingPipeline(), after_request=_broken_relay)  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR), make_client(backend, tmp_path, kind=kind) as c:
        if kind == "image":
            r = c.post("/v1/images/generations", json=IMAGE)
            assert r.status_code == 500, r.text
            error, shown = r.json()["error"], r.text
            request_id = r.headers["x-request-id"]
        else:
            job_id = c.post("/v1/videos", json=VIDEO).json()["id"]
            job = wait_for(c, job_id, "failed")
            error, shown = job["error"], str(job) + c.get(f"/v1/videos/{job_id}/events").text
            request_id = job_id
    assert error["code"] == "internal_error", error
    assert error["message"] == f"internal error (request {request_id}); the head's log names its cause", error
    assert PRIVATE not in shown and "RuntimeError" not in shown, shown
    assert PRIVATE in caplog.text and request_id in caplog.text
