"""The request contract (triptych/contract.py): one declaration per parameter, and everything built
from it. Exposing a parameter the stages already use (max_sequence_length, a GenerationParams field
no endpoint takes yet) is one declaration: it reaches each endpoint's model and OpenAPI schema, the
door's validation with the family's limits, the CLI and the playground's form contract."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend
from tests.folders import head_folder
from triptych.client_cli import add_client_commands, request_body
from triptych.contract import ALL, CONTRACT, EDITS, IMAGES, VIDEOS, Contract, Limits, ParamError, RequestParam
from triptych.families import ModelInfo, read_model_info
from triptych.families.wan import WanRules
from triptych_head.api.app import create_app
from triptych_head.api.context import HeadContext
from triptych_head.api.playground import STATIC

FLUX = ModelInfo("tiny-flux", "FluxPipeline", "image", 4, 3.5, size_multiple=8, max_steps=50, negative_prompt=False)
KONTEXT = dataclasses.replace(FLUX, id="tiny-kontext", pipeline_class="FluxKontextPipeline", edits=True)
WAN = ModelInfo("tiny-wan", "WanPipeline", "video", 4, 5.0, size_multiple=16, max_steps=1000, frame_step=4,
                step_cache_modes=WanRules.step_cache_modes)  # fmt: skip

# The new parameter: clients may now ask for fewer prompt tokens, at most 256 on image models.
EXPOSED = dataclasses.replace(
    CONTRACT["max_sequence_length"],
    endpoints=ALL,
    family=lambda t: Limits(maximum=256 if t.kind == "image" else 512),
    cli="--max-sequence-length",
    form=True,
)
WITH_PARAM = CONTRACT.with_param(EXPOSED)


@contextlib.contextmanager
def client(
    model: ModelInfo, contract: Contract = CONTRACT, backend: ScriptedBackend | None = None
) -> Iterator[TestClient]:
    with head_folder("triptych-contract-") as folder:  # one test's video is 750 MB of frames
        ctx = HeadContext(
            backend=backend or ScriptedBackend(),
            model=model,
            output_path=folder,
            registry=CollectorRegistry(),
            contract=contract,
        )
        with TestClient(create_app(ctx)) as c:
            yield c


def body_schema(schema: dict, path: str) -> dict:
    content = schema["paths"][path]["post"]["requestBody"]["content"]
    if "application/json" not in content:  # an edit: a form only
        return content["multipart/form-data"]["schema"]
    ref = content["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    return schema["components"]["schemas"][ref]


def test_a_new_parameter_reaches_every_endpoint_s_model_and_openapi_schema() -> None:
    with client(FLUX) as c:
        before = c.get("/openapi.json").json()
    with client(FLUX, WITH_PARAM) as c:
        after = c.get("/openapi.json").json()
    for path in (IMAGES, EDITS, VIDEOS):
        assert "max_sequence_length" not in body_schema(before, path)["properties"]
        field = body_schema(after, path)["properties"]["max_sequence_length"]
        assert field["default"] == 512 and field["minimum"] == 1 and field["maximum"] == 512
        assert field["description"] == EXPOSED.doc


def test_a_new_parameter_reaches_the_stages_and_is_checked_at_the_door_with_the_family_s_limits() -> None:
    backend = ScriptedBackend()
    with client(FLUX, WITH_PARAM, backend) as c:
        ok = c.post(IMAGES, json={"prompt": "x", "size": "32x32", "max_sequence_length": 128})
        too_many_for_flux = c.post(IMAGES, json={"prompt": "x", "size": "32x32", "max_sequence_length": 300})
        too_many = c.post(IMAGES, json={"prompt": "x", "size": "32x32", "max_sequence_length": 513})
    assert ok.status_code == 200, ok.text
    assert [p.max_sequence_length for p in backend.calls] == [128]
    for refused in (too_many_for_flux, too_many):
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "max_sequence_length", refused.text
    assert "max_sequence_length 300 must be between 1 and 256" in too_many_for_flux.json()["error"]["message"]
    with client(WAN, WITH_PARAM, backend) as c:  # a video model's limit is the contract's own
        job = c.post(VIDEOS, json={"prompt": "x", "size": "32x32", "num_frames": 5, "max_sequence_length": 300})
    assert job.status_code == 200, job.text


def test_a_new_parameter_reaches_the_cli_of_every_command_that_posts_to_its_endpoints() -> None:
    parser = argparse.ArgumentParser()
    add_client_commands(parser.add_subparsers(dest="command"), WITH_PARAM)
    for command in ("generate", "video"):
        ns = parser.parse_args([command, "waves", "-o", "out", "--max-sequence-length", "64", "--steps", "3"])
        assert request_body(ns) == {"prompt": "waves", "max_sequence_length": 64, "num_inference_steps": 3}
    ns = parser.parse_args(["edit", "ref.png", "waves", "-o", "out", "--max-sequence-length", "64"])
    assert request_body(ns) == {"prompt": "waves", "max_sequence_length": 64}
    plain = argparse.ArgumentParser()
    add_client_commands(plain.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        plain.parse_args(["generate", "waves", "-o", "out", "--max-sequence-length", "64"])


def test_a_new_parameter_reaches_the_playground_s_form_contract_with_the_model_s_limits() -> None:
    with client(FLUX, WITH_PARAM) as c:
        form = c.get("/v1/contract").json()
    assert form["model"] == "tiny-flux"
    spec = form["endpoints"][IMAGES]["max_sequence_length"]
    assert spec == {
        "type": "int", "default": 512, "required": False, "doc": EXPOSED.doc, "form": True,
        "minimum": 1, "maximum": 256, "supported": True,
    }  # fmt: skip


def test_the_playground_s_form_contract_carries_the_family_s_limits() -> None:
    with client(FLUX) as c:
        flux = c.get("/v1/contract").json()["endpoints"]
    with client(WAN) as c:
        wan = c.get("/v1/contract").json()["endpoints"]
    assert flux[IMAGES]["size"]["minimum"] == 16 and flux[IMAGES]["size"]["step"] == 8
    assert flux[IMAGES]["num_inference_steps"]["maximum"] == 50
    assert flux[IMAGES]["negative_prompt"]["supported"] is False  # FLUX.1: embedded guidance
    assert wan[VIDEOS]["num_frames"] == {**wan[VIDEOS]["num_frames"], "minimum": 1, "maximum": 1025, "step": 4}
    assert "num_frames" not in wan[IMAGES] and "n" not in wan[VIDEOS]


def test_a_step_cache_request_reaches_the_stages_and_the_form_offers_the_family_s_modes(tiny_models) -> None:
    backend = ScriptedBackend()
    with client(FLUX, backend=backend) as c:
        cache = {"step_cache": "first_block", "step_cache_threshold": 0.2}
        r = c.post(IMAGES, json={"prompt": "x", "size": "32x32", **cache})
        assert r.status_code == 200, r.text
        r = c.post(IMAGES, json={"prompt": "x", "size": "32x32"})
        assert r.status_code == 200, r.text
        assert c.get("/v1/contract").json()["endpoints"][IMAGES]["step_cache"]["choices"] == [
            "none", "first_block", "pyramid_attention_broadcast", "taylorseer"
        ]  # fmt: skip
    cached, plain = backend.calls
    assert (cached.step_cache, cached.step_cache_threshold, plain.step_cache) == ("first_block", 0.2, "none")
    assert read_model_info(tiny_models["tiny-wan"]).step_cache_modes == ("first_block", "pyramid_attention_broadcast")
    with client(WAN) as c:
        wan = c.get("/v1/contract").json()["endpoints"][VIDEOS]["step_cache"]
    assert wan["choices"] == ["none", "first_block", "pyramid_attention_broadcast"] and wan["default"] == "none"


def test_the_playground_s_fields_are_parameters_the_contract_shows_in_forms() -> None:
    html = (STATIC / "index.html").read_text()
    fields = set(re.findall(r'data-param="([a-z_]+)"', html))
    form = {p.name for p in CONTRACT if p.form}
    assert fields <= form  # every field names a parameter the contract shows in forms
    assert {"prompt", "size", "num_inference_steps", "num_frames"} <= fields  # app.js adds fields for the rest


@pytest.mark.parametrize(
    ("model", "path", "body", "param", "message"),
    [
        (FLUX, IMAGES, {"size": "60x64"}, "size", "width 60 is not a multiple of 8"),
        (FLUX, IMAGES, {"num_inference_steps": 51}, "num_inference_steps", "num_inference_steps 51 must be between"),
        (FLUX, IMAGES, {"negative_prompt": "blurry"}, "negative_prompt", "negative_prompt is not supported"),
        (WAN, VIDEOS, {"num_frames": 6}, "num_frames", "num_frames 6 is invalid: WanPipeline needs 1 + a multiple"),
        (WAN, VIDEOS, {"negative_prompt": "blurry", "guidance_scale": 1.0}, "negative_prompt",
         "negative_prompt is used only with classifier-free guidance, which runs at guidance_scale above 1 "
         "(got guidance_scale 1): raise guidance_scale, or leave negative_prompt out"),
        (FLUX, IMAGES, {"step_cache": "teacache"}, "step_cache", "step_cache: Input should be 'none', 'first_block'"),
        (WAN, VIDEOS, {"step_cache": "taylorseer"}, "step_cache",
         "step_cache 'taylorseer' is not available for WanPipeline: choose one of none, first_block, pyramid"),
        (FLUX, IMAGES, {"step_cache": "first_block", "step_cache_threshold": 1.5}, "step_cache_threshold",
         "less than or equal to 1"),
        (FLUX, IMAGES, {"step_cache": "taylorseer", "step_cache_interval": 1}, "step_cache_interval",
         "greater than or equal to 2"),
        (FLUX, IMAGES, {"step_cache": "taylorseer", "step_cache_threshold": 0.1}, "step_cache_threshold",
         "step_cache_threshold applies to step_cache first_block only, not taylorseer"),
        (FLUX, IMAGES, {"step_cache_interval": 3}, "step_cache_interval",
         "step_cache_interval applies to step_cache pyramid_attention_broadcast, taylorseer only, not none"),
    ],
)  # fmt: skip
def test_a_value_the_family_refuses_is_a_400_naming_the_parameter(model, path, body, param, message) -> None:
    backend = ScriptedBackend()
    with client(model, backend=backend) as c:
        r = c.post(path, json={"prompt": "x", "size": "32x32", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]
    assert backend.calls == []


def test_an_edit_form_field_is_checked_against_the_family_too() -> None:
    with client(KONTEXT, backend=ScriptedBackend()) as c:
        r = c.post(EDITS, data={"prompt": "x", "image": "https://example.com/r.png", "size": "64x60"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text


def test_errors_carry_the_parameter_not_a_guess_from_their_text() -> None:
    toy = RequestParam("toy", int, "A toy", frozenset({VIDEOS}), limits=Limits(minimum=0), fields=())
    with pytest.raises(ParamError) as refused:
        CONTRACT.with_param(toy).check({"toy": -1, "width": 32}, WAN)
    assert refused.value.param == "toy" and str(refused.value) == "toy -1 must be at least 0"


@pytest.mark.parametrize("model", [FLUX, KONTEXT, WAN], ids=lambda m: m.id)
def test_the_check_skips_only_limits_that_refuse_nothing(model: ModelInfo) -> None:
    """Contract.check looks only at limits that can refuse (worked out once per model): every limits
    it skips takes any value, and every one it keeps refuses one."""
    probes = [-1e9, -1, 0, 1, 3.5, 7, 1e9, math.nan, "", "x", "zz-not-a-choice", True]
    for param in CONTRACT:
        limits = param.limits_for(model)
        refused = [v for v in probes if limits.check(param.name, v, model) is not None]
        assert bool(refused) == limits.refuses, (param.name, limits, refused)


def test_limits_narrowed_by_a_step_start_and_end_on_whole_steps() -> None:
    narrowed = Limits(minimum=16, maximum=4096).narrowed(Limits(minimum=12, step=12))
    assert (narrowed.minimum, narrowed.maximum, narrowed.step) == (24, 4092, 12)
    frames = Limits(minimum=1, maximum=1025).narrowed(Limits(step=4, offset=1))
    assert (frames.minimum, frames.maximum) == (1, 1025)
    assert frames.check("num_frames", 9) is None and frames.check("num_frames", 8) is not None


@pytest.mark.parametrize(("frames", "nearest"), [(6, "5 or 9"), (0, "1"), (510, "509"), (513, "509"), (1025, "509")])
def test_a_refused_frame_count_suggests_only_counts_the_model_takes(frames: int, nearest: str) -> None:
    wan = dataclasses.replace(WAN, max_frames=509)
    why = CONTRACT["num_frames"].limits_for(wan).check("num_frames", frames, wan)
    assert why is not None and why.endswith(f"at most 509 (e.g. {nearest})"), why


def test_a_size_past_the_transformer_s_positional_table_is_a_400_at_the_door(tiny_models) -> None:
    """Wan's rotary table has rope_max_seq_len positions per axis: a larger latent would fail in the
    denoiser's first step (a shape error), so the head refuses it naming the field and the bound."""
    info = read_model_info(tiny_models["tiny-wan"])
    assert (info.max_side, info.max_frames) == (128 * 2 * 4, (128 - 1) * 4 + 1)  # positions x patch x VAE
    with client(info) as c:
        r = c.post(VIDEOS, json={"prompt": "x", "size": "1040x480", "num_frames": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
        assert "1040" in r.json()["error"]["message"] and "1024" in r.json()["error"]["message"], r.text
        r = c.post(VIDEOS, json={"prompt": "x", "size": "32x32", "num_frames": 513})
        assert r.status_code == 400 and r.json()["error"]["param"] == "num_frames", r.text
        assert c.post(VIDEOS, json={"prompt": "x", "size": "1024x480", "num_frames": 509}).status_code == 200


def test_a_video_model_makes_images_as_one_frame_videos_and_an_image_model_refuses_videos() -> None:
    backend = ScriptedBackend()
    with client(WAN, backend=backend) as c:
        r = c.post(IMAGES, json={"prompt": "x", "size": "32x32", "n": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 2 and [(p.num_frames, p.num_outputs) for p in backend.calls] == [(1, 2)]
    with client(FLUX, backend=ScriptedBackend()) as c:
        r = c.post(VIDEOS, json={"prompt": "x", "size": "32x32"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "generates images; use POST /v1/images/generations" in r.json()["error"]["message"]
