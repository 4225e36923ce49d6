"""The handler's check of a spec (handlers._validate): whatever the check raises, the pipeline ends
up with a status that says why nothing was applied, on the first try and on every retry."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.operator.helpers import NAMESPACE, minimal_spec
from triptych_operator import handlers
from triptych_operator.pipeline_state import PipelineState
from triptych_operator.status import compute_status

LOG = logging.getLogger("test-validate")


def body(spec: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    meta = {"name": "p", "namespace": NAMESPACE, "uid": "u1", "generation": generation}
    return {"apiVersion": "triptych.ai/v1alpha1", "kind": "DiffusionPipeline", "metadata": meta, "spec": spec}


def test_a_check_that_fails_unexpectedly_makes_the_pipeline_invalid_on_every_try(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_render(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("cannot convert float NaN to integer")

    monkeypatch.setattr(handlers, "render", broken_render)
    state = PipelineState()
    for _ in range(2):  # kopf's retry, or the next event, of the same generation
        handlers._validate(body(minimal_spec()), state, logger=LOG)
        assert state.spec is None
        assert state.spec_error is not None
        assert state.spec_error.startswith(
            "spec: the operator failed to check this spec (ValueError: cannot convert float NaN to integer)"
        )
    assert compute_status(1, {}, spec_error=state.spec_error, now="2026-01-01T00:00:00Z")["phase"] == "Invalid"
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) == 1 and logged[0].exc_info is not None  # the traceback, once per generation


def test_a_spec_error_is_recorded_with_its_field_and_a_fixed_spec_clears_it() -> None:
    state = PipelineState()
    handlers._validate(body(minimal_spec(transfer={"mode": "rdma", "ibDevice": ""})), state, logger=LOG)
    assert state.spec is None
    assert state.spec_error is not None and state.spec_error.startswith("spec.transfer.ibDevice: ")
    handlers._validate(body(minimal_spec(), generation=2), state, logger=LOG)
    assert state.spec is not None and state.spec_error is None


def test_a_host_path_outside_the_operators_allow_list_makes_the_pipeline_invalid_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chart's allowedHostPaths (main.py sets them): the status says which field, which value, what to do."""
    monkeypatch.setattr(handlers, "ALLOWED_HOST_PATHS", ("/srv/models",))
    state = PipelineState()
    host = {"model": {"path": "tiny", "volume": {"hostPath": {"path": "/etc"}}}}
    handlers._validate(body(host), state, logger=LOG)
    assert state.spec is None and state.spec_error is not None
    assert state.spec_error.startswith(
        "spec.model.volume.hostPath.path: '/etc' is not under a folder this cluster allows for hostPath volumes "
        "(/srv/models"
    )
    status = compute_status(1, {}, spec_error=state.spec_error, now="2026-01-01T00:00:00Z")
    assert status["phase"] == "Invalid"
    host["model"]["volume"]["hostPath"]["path"] = "/srv/models/tiny"
    handlers._validate(body(host, generation=2), state, logger=LOG)
    assert state.spec is not None and state.spec_error is None
