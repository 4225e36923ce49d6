"""LoRA adapters at the head (triptych/lora.py): the catalogue and its hot-added lines, the `loras`
field checked at the door (a 400 naming it for each bad input), the dispatch that prefers a
denoiser holding a request's adapters, and the batch key that keeps adapter sets apart."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend
from tests.folders import head_folder
from triptych.batching import batch_key
from triptych.config import ConfigError, ServeArgs
from triptych.contract import EDITS, IMAGES
from triptych.families import ModelInfo
from triptych.lora import LoraCatalog
from triptych.params import GenerationParams, LoraWeight
from triptych.roles import Role
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext
from triptych_head.dispatch import RoundRobin, dispatch_lora_affinity
from triptych_head.instances import WorkerInstance

FLUX = ModelInfo("tiny-flux", "FluxKontextPipeline", "image", 4, 3.5, size_multiple=8, max_steps=50, edits=True)


@contextlib.contextmanager
def client(catalog: LoraCatalog, backend: ScriptedBackend) -> Iterator[TestClient]:
    with head_folder("triptych-lora-api-") as folder:
        ctx = HeadContext(
            backend=backend, model=FLUX, registry=CollectorRegistry(), lora_catalog=catalog, output_path=folder
        )
        with TestClient(create_app(ctx)) as c:
            yield c


def test_a_line_added_to_the_catalog_file_is_an_adapter_without_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "loras.txt"
    path.write_text("# adapters\nink = /models/ink\n")
    catalog = LoraCatalog.from_flags(["paper=/models/paper"], str(path))
    assert catalog.entries() == {"paper": "/models/paper", "ink": "/models/ink"}
    path.write_text("ink=/models/ink\nlate=org/late-lora\n")
    assert catalog.source("late") == "org/late-lora"
    path.write_text("ink=/models/ink\nnot a line\n")  # a bad edit keeps the last good entries
    assert catalog.source("late") == "org/late-lora"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["ink"], "--lora 'ink' is not NAME=SOURCE"),
        (["in.k=/x"], "--lora 'in.k=/x': the name must be"),
        (["ink=/x", "ink=/y"], "--lora: adapter 'ink' is declared twice"),
    ],
)
def test_bad_lora_flags_are_refused_at_start_up_naming_the_flag(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        ServeArgs(model_path="m", lora=flags).validate()


def test_a_catalog_file_missing_at_start_up_is_empty_until_it_appears(tmp_path: Path) -> None:
    path = tmp_path / "loras.txt"
    ServeArgs(model_path="m", lora_catalog=str(path)).validate()  # a mounted ConfigMap may come later
    catalog = LoraCatalog.from_flags([], str(path))
    assert catalog.entries() == {}
    path.write_text("ink=/models/ink\n")
    assert catalog.entries() == {"ink": "/models/ink"}


def test_lora_flags_on_a_role_that_applies_no_adapter_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^--lora is for .*encoder.*denoiser.*, not decoder$"):
        ServeArgs(
            model_path="m", lora=["ink=/x"], disagg_role=Role.DECODER, disagg_server_addr="tcp://127.0.0.1:1"
        ).validate()


@pytest.mark.parametrize("role", [Role.ENCODER, Role.PROMPT_ENCODER, Role.DENOISER])
def test_the_roles_that_apply_adapters_take_the_lora_flags(role: Role) -> None:
    # encoders apply an adapter's text-encoder part, denoisers its transformer part
    ServeArgs(
        model_path="m", lora=["ink=/x"], lora_catalog="/c", lora_cache_bytes=1, disagg_role=role,
        disagg_server_addr="tcp://127.0.0.1:1",
    ).validate()  # fmt: skip


def test_a_request_s_adapters_reach_the_stages_in_order_with_their_weights() -> None:
    backend = ScriptedBackend()
    catalog = LoraCatalog({"ink": "/models/ink", "paper": "/models/paper"})
    loras = [{"name": "paper", "weight": 0.5}, {"name": "ink"}]
    with client(catalog, backend) as c:
        assert c.post(IMAGES, json={"prompt": "x", "size": "32x32", "loras": loras}).status_code == 200
        assert c.post(IMAGES, json={"prompt": "x", "size": "32x32"}).status_code == 200
        form = {"prompt": "x", "size": "32x32", "loras": '[{"name": "ink", "weight": 2}]'}
        r = c.post(EDITS, data=form, files={"image": ("r.png", _png(), "image/png")})
        assert r.status_code == 200, r.text
    adapted, plain, edit = backend.calls
    assert adapted.loras == (LoraWeight("paper", 0.5), LoraWeight("ink", 1.0))
    assert plain.loras == () and edit.loras == (LoraWeight("ink", 2.0),)


BAD = [
    ([{"name": "nope"}], "loras[0].name 'nope' is not an adapter of this deployment; choose one of ink, paper"),
    ([{"name": "ink"}] * 2, "loras[1].name 'ink' is given twice"),
    ([{"name": "ink"}, {"name": "paper"}, {"name": "ink"}, {"name": "paper"}, {"name": "ink"}], "loras: List should"),
    ([{"name": "ink", "weight": 99}], "loras.0.weight: Input should be less than or equal to 8"),
    ([{"name": "ink", "scale": 1}], "loras.0.scale: Extra inputs are not permitted"),
    ("ink", "loras: must be a JSON array such as"),
]


@pytest.mark.parametrize(("loras", "message"), BAD, ids=["unknown", "twice", "too-many", "weight", "extra", "text"])
def test_bad_adapters_are_a_400_naming_the_field(loras: object, message: str) -> None:
    backend = ScriptedBackend()
    with client(LoraCatalog({"ink": "/models/ink", "paper": "/models/paper"}), backend) as c:
        r = c.post(IMAGES, json={"prompt": "x", "size": "32x32", "loras": loras})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("loras") and error["message"].startswith(message), error
    assert backend.calls == []


@pytest.mark.parametrize("weight", [False, True])
def test_a_json_boolean_weight_is_a_400_not_a_weight_of_0_or_1(weight: bool) -> None:
    """pydantic's lax mode read `"weight": false` as 0.0: a request the client never wrote ran (as `"n":
    true` is refused, RequestBody._booleans_and_numbers_apart). An edit form's `loras` text too."""
    backend = ScriptedBackend()
    said = f"loras.0.weight: must be a number, not {str(weight).lower()}"
    with client(LoraCatalog({"ink": "/models/ink"}), backend) as c:
        r = c.post(IMAGES, json={"prompt": "x", "size": "16x16", "loras": [{"name": "ink", "weight": weight}]})
        form = {"prompt": "x", "size": "32x32", "loras": json.dumps([{"name": "ink", "weight": weight}])}
        edit = c.post(EDITS, data=form, files={"image": ("r.png", _png(), "image/png")})
        good = c.post(IMAGES, json={"prompt": "x", "size": "16x16", "loras": [{"name": "ink", "weight": 0}]})
    for answer in (r, edit):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["message"]) == ("loras", said), error
    assert good.status_code == 200, good.text  # a number 0 is still a weight
    assert [call.loras for call in backend.calls] == [(LoraWeight("ink", 0.0),)]


def _png() -> bytes:
    from tests.worker.test_role_pipelines import reference_png

    return reference_png(32, 32)


def denoiser(url: str, loras: frozenset[str] = frozenset(), busy: int = 0) -> WorkerInstance:
    inst = WorkerInstance(url, Role.DENOISER, capacity=2, loras=loras)
    inst.inflight = {f"{url}-{i}" for i in range(busy)}
    return inst


def test_a_request_goes_to_a_denoiser_holding_its_adapters_while_it_has_room_else_the_least_loaded() -> None:
    holder, idle, other = denoiser("a", frozenset({"ink", "paper"}), busy=1), denoiser("b"), denoiser("c", busy=1)
    pool = [idle, other, holder]

    def can_take(inst: WorkerInstance) -> bool:
        return inst.can_take()

    assert dispatch_lora_affinity(RoundRobin(), pool, can_take, frozenset({"ink"})) is holder
    assert dispatch_lora_affinity(RoundRobin(), pool, can_take, frozenset({"ink", "wool"})) is idle
    holder.inflight.add("full")
    assert dispatch_lora_affinity(RoundRobin(), pool, can_take, frozenset({"ink"})) is idle
    assert dispatch_lora_affinity(RoundRobin(), pool, can_take, frozenset()) is idle  # the policy's turn


def test_requests_batch_only_with_the_same_adapters_and_weights() -> None:
    plain = GenerationParams("x", 32, 32)
    ink = msgspec.structs.replace(plain, loras=(LoraWeight("ink", 1.0),))
    assert batch_key(plain) != batch_key(ink)
    assert batch_key(ink) == batch_key(msgspec.structs.replace(ink, prompt="y", seed=9))
    assert batch_key(ink) != batch_key(msgspec.structs.replace(ink, loras=(LoraWeight("ink", 0.5),)))


def test_adapters_no_ready_denoiser_holds_add_their_loads_to_the_denoiser_s_estimate() -> None:
    from triptych_head.deadline import LoadFigures, RoleFigures, own_work
    from triptych_head.workload import LORA_LOAD_PRIOR_S, WorkEstimator

    plain = GenerationParams("x", 1000, 1000, num_inference_steps=10)
    two = msgspec.structs.replace(plain, loras=(LoraWeight("ink"), LoraWeight("paper")))
    roles = {role: RoleFigures(0.0, 1, 0.1, calibrated=True) for role in (Role.ENCODER, Role.DENOISER, Role.DECODER)}
    held_ink = LoadFigures(roles, frozenset(), held_loras=frozenset({"ink"}), lora_load_s=3.0)
    assert own_work(held_ink, two)[Role.DENOISER] == pytest.approx(own_work(held_ink, plain)[Role.DENOISER] + 3.0)
    assert own_work(held_ink, two)[Role.DECODER] == own_work(held_ink, plain)[Role.DECODER]
    estimator = WorkEstimator()
    base = estimator.estimate(Role.DENOISER, plain)
    assert estimator.estimate(Role.DENOISER, two, loads=2) == pytest.approx(base + 2 * LORA_LOAD_PRIOR_S)
    estimator.observe_lora_load(0.25)  # a denoiser's heartbeat: its loads took 0.25 s each
    assert estimator.estimate(Role.DENOISER, two, loads=2) == pytest.approx(base + 0.5)


def test_the_cli_takes_adapters_as_repeated_lora_options_and_an_edit_sends_them_as_a_json_field() -> None:
    import argparse

    from triptych.client import Reference
    from triptych.client_cli import add_client_commands, request_body

    parser = argparse.ArgumentParser()
    add_client_commands(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["generate", "waves", "-o", "out", "--lora", "ink=0.8", "--lora", "paper"])
    body = request_body(ns)
    assert body == {"prompt": "waves", "loras": [{"name": "ink", "weight": 0.8}, {"name": "paper"}]}
    form = Reference(data=b"png", name="ref.png").form(body)["data"]
    assert json.loads(form["loras"]) == body["loras"]
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "waves", "-o", "out", "--lora", "ink=heavy"])


def test_only_denoisers_heartbeats_set_the_adapter_load_estimate() -> None:
    from tests.unit.core_harness import Harness
    from triptych.protocol import encode

    harness = Harness({Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    harness.clock.advance(10)  # the workers were heard 10 s ago
    for w in harness.workers.values():  # an encoder loads text-encoder parts: not what a denoiser's load costs
        seconds = 0.25 if w.role is Role.DENOISER else 9.0
        harness.core.on_worker(w.role, encode(msgspec.structs.replace(w.heartbeat(), lora_load_s=seconds)))
    assert harness.core.workload.lora_load_s == 0.25


def test_an_adapter_load_longer_than_the_head_has_known_the_denoiser_counts_as_that_long() -> None:
    """One heartbeat saying a week (a bug, a forged message) used to refuse every request naming an
    adapter no denoiser held, for good: later heartbeats report the same mean or none."""
    from tests.unit.core_harness import Harness
    from triptych.protocol import encode

    harness = Harness({Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    denoiser = next(w for w in harness.workers.values() if w.role is Role.DENOISER)
    week = encode(msgspec.structs.replace(denoiser.heartbeat(), lora_load_s=7 * 24 * 3600.0))
    harness.core.on_worker(Role.DENOISER, week)
    assert harness.core.workload.lora_load_s == 2.0  # heard just now: no load of its can be counted yet
    harness.clock.advance(5)
    harness.core.on_worker(Role.DENOISER, week)
    assert harness.core.workload.lora_load_s == 5.0
