"""The wire protocol: typed msgpack headers (msgspec), raw tensor frames, strict decoding, no pickle."""

from __future__ import annotations

import pickle

import msgspec
import pytest
import torch

from triptych.params import GenerationParams
from triptych.protocol import (
    Heartbeat,
    ProtocolError,
    RequestEvent,
    Submit,
    TransferStaged,
    decode,
    encode,
    frames_to_tensors,
    tensors_to_frames,
)
from triptych.protocol.codec import PROTOCOL_VERSION, message_types

_pack, _unpack = msgspec.msgpack.encode, msgspec.msgpack.decode  # plain maps, as any msgpack peer sends them


def test_message_round_trips_with_version_and_type():
    msg = TransferStaged(
        "r1", "tcp://127.0.0.1:1", 42, [{"name": "x", "dtype": "uint8", "shape": [42]}], {"mu": 0.5}, 0.1
    )
    parts = encode(msg)
    header = _unpack(parts[0])
    assert header["v"] == PROTOCOL_VERSION and header["type"] == "transfer_staged"
    decoded, frames = decode(parts)
    assert decoded == msg and frames == []


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\xff\xfe\x00garbage", _pack([1, 2, 3]), _pack({"v": 1, "type": "no_such"})],
)
def test_garbage_headers_raise_protocol_error(garbage):
    with pytest.raises(ProtocolError):
        decode([garbage])


@pytest.mark.parametrize("field", ["meta", "unknown_field"])
def test_deeply_nested_header_is_a_protocol_error_not_a_crash(field):
    head = _pack({"v": PROTOCOL_VERSION, "type": "transfer_staged", "request_id": "r", "instance": "i",
                  "nbytes": 1, "manifest": [], "seconds": 0.0})  # fmt: skip
    nested = b"\x91" * 200_000 + b"\xc0"  # [[[...[nil]...]]], 200k deep
    header = bytes([head[0] + 1]) + head[1:] + _pack(field) + nested  # one more key in the map
    with pytest.raises(ProtocolError, match="too deeply"):
        decode([header])


def test_pickle_payload_is_rejected_not_executed():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('pickle executed')",))

    with pytest.raises(ProtocolError, match=r"not msgpack|must be a map"):
        decode([pickle.dumps(Boom())])


def test_wrong_field_type_names_the_field_and_keeps_request_id():
    header = _pack({"v": PROTOCOL_VERSION, "type": "submit", "request_id": "abc", "params": "not-a-map"})
    with pytest.raises(ProtocolError, match="'params'") as info:
        decode([header])
    assert info.value.request_id == "abc"


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"prompt": "x", "width": "64", "height": 64}, "field 'params.width': expected int, got str"),
        ({"prompt": "x", "width": True, "height": 64}, "field 'params.width': expected int, got bool"),
        ({"prompt": "x", "width": 64, "height": 64, "widht": 3}, "unknown field 'params.widht'"),
        ({"prompt": "x", "width": 64}, "missing field 'params.height'"),
    ],
)
def test_generation_parameters_are_checked_by_the_decoder(params, problem):
    header = _pack({"v": PROTOCOL_VERSION, "type": "submit", "request_id": "abc", "params": params})
    with pytest.raises(ProtocolError) as info:
        decode([header])
    assert str(info.value) == f"submit: {problem}" and info.value.request_id == "abc"


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"type": "transfer_alloc", "nbytes": -1}, "field 'nbytes': expected int >= 0"),
        ({"type": "transfer_push", "dest_session": "s", "dest_addr": -8}, "field 'dest_addr': expected int >= 0"),
        ({"type": "failed", "error": "e", "status_code": 200}, "field 'status_code': expected int >= 400"),
        ({"type": "transfer_pushed", "nbytes": 1, "seconds": -0.5}, "field 'seconds': expected float >= 0.0"),
        ({"type": "batch_resized", "batch_id": "g", "batch_size": -1}, "field 'batch_size': expected int >= 0"),
    ],
)
def test_sizes_addresses_and_status_codes_are_range_checked(fields, problem):
    header = _pack({"v": PROTOCOL_VERSION, "request_id": "r", "instance": "i", **fields})
    with pytest.raises(ProtocolError) as info:
        decode([header])
    assert str(info.value) == f"{fields['type']}: {problem}" and info.value.request_id == "r"


def test_missing_field_and_wrong_version_are_errors():
    with pytest.raises(ProtocolError, match="missing field 'params'"):
        decode([_pack({"v": PROTOCOL_VERSION, "type": "submit", "request_id": "a"})])
    with pytest.raises(ProtocolError, match="version"):
        decode([_pack({"v": 99, "type": "submit", "request_id": "a", "params": {}})])


def test_bool_is_not_an_int():
    hb = encode(Heartbeat("i", "encoder", "s", 1, 1, 2, "m"))
    raw = _unpack(hb[0])
    raw["capacity"] = True
    with pytest.raises(ProtocolError, match="capacity"):
        decode([_pack(raw)])


def test_every_message_type_round_trips_and_checks_nested_fields():
    assert len(message_types()) == 22  # every message class registered, each under its own type name
    bad_manifest = {"v": PROTOCOL_VERSION, "type": "transfer_staged", "request_id": "r", "instance": "i",
                    "nbytes": 1, "manifest": [{"name": "x"}, "not-a-map"], "meta": {}, "seconds": 0.0}  # fmt: skip
    with pytest.raises(ProtocolError, match=r"'manifest\[1\]'"):  # the field and the item in it
        decode([_pack(bad_manifest)])
    optional = encode(RequestEvent("r", "FAILED", error=None))
    assert decode(optional)[0].error is None
    with pytest.raises(ProtocolError, match="'error'"):
        decode([_pack({**_unpack(optional[0]), "error": 5})])
    params = {"prompt": "p", "width": 8, "height": 8}
    defaults = decode([_pack({"v": PROTOCOL_VERSION, "type": "submit", "request_id": "a", "params": params})])[0]
    assert defaults.watch is False  # an absent optional field takes its default
    assert defaults.params == GenerationParams("p", 8, 8) and defaults.params.num_inference_steps == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_tensor_frames_are_bit_exact(dtype):
    t = (torch.randn(3, 5, 7) * 100).to(dtype)
    specs, frames = tensors_to_frames({"t": t, "empty": torch.empty(0, 4, dtype=dtype)})
    back = frames_to_tensors(specs, [bytes(f) for f in frames])
    assert back["t"].dtype == dtype and torch.equal(back["t"].view(torch.uint8), t.view(torch.uint8))
    assert back["empty"].shape == (0, 4)


def test_tensor_frame_size_mismatch_names_the_tensor():
    specs, frames = tensors_to_frames({"latents": torch.zeros(4)})
    with pytest.raises(ValueError, match="'latents'"):
        frames_to_tensors(specs, [bytes(frames[0])[:-1]])


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "x", "dtype": "object", "shape": [1]},
        {"name": "x", "dtype": "uint8", "shape": [-1]},
        {"name": "x", "dtype": "uint8", "shape": [1] * 9},
        {"name": "", "dtype": "uint8", "shape": [1]},
    ],
)
def test_bad_tensor_specs_are_rejected(spec):
    with pytest.raises(ValueError):
        frames_to_tensors([spec], [b"\x00"])


def test_submit_encodes_params_as_plain_map():
    parts = encode(Submit("r", GenerationParams("a cat", 64, 32)))
    assert _unpack(parts[0])["params"] == {**_unpack(_pack(GenerationParams("", 0, 0))), "prompt": "a cat", "width": 64,
                                           "height": 32}  # fmt: skip


def test_a_heartbeat_carries_the_topology_and_the_encoder_cache_counts_range_checked():
    from triptych.protocol import EncoderCacheStats

    stats = EncoderCacheStats(hits=3, misses=2, evictions=1, bytes=100, capacity_bytes=1000)
    hb = Heartbeat("i", "denoiser", "", 0, 0, 2, "m", full_pipeline=True, encoder_cache=stats)
    decoded, _ = decode(encode(hb))
    assert decoded == hb and decoded.encoder_cache.hits == 3 and decoded.full_pipeline
    header = _unpack(encode(hb)[0])
    header["encoder_cache"]["hits"] = -1
    with pytest.raises(ProtocolError, match="hits"):
        decode([_pack(header)])


# GenerationParams as the release before LoRA adapters decoded it (a worker not rolled yet).
_ParamsBeforeLoras = msgspec.defstruct(
    "ParamsBeforeLoras",
    [(f.name, f.type, f.default) if f.required is False else (f.name, f.type)
     for f in msgspec.structs.fields(GenerationParams) if f.name != "loras"],
    frozen=True,
    forbid_unknown_fields=True,
)  # fmt: skip


def test_a_process_of_the_release_before_a_new_parameter_takes_requests_that_leave_it_at_its_default():
    """A new head sent `"loras": []` in every request: the workers not rolled yet refused them all
    (an unknown field) until the last one had rolled."""
    from triptych.params import LoraWeight

    plain = GenerationParams("a fox", 64, 48, seed=3, num_inference_steps=2)
    header = _unpack(encode(Submit("r1", plain))[0])
    assert header["params"] == {"prompt": "a fox", "width": 64, "height": 48, "num_inference_steps": 2, "seed": 3}
    old = msgspec.msgpack.decode(_pack(header["params"]), type=_ParamsBeforeLoras)
    assert (old.prompt, old.seed, old.num_inference_steps, old.max_sequence_length) == ("a fox", 3, 2, 512)
    with_lora = msgspec.structs.replace(plain, loras=(LoraWeight("ink", 0.8),))
    header = _unpack(encode(Submit("r2", with_lora))[0])
    with pytest.raises(msgspec.ValidationError, match="loras"):  # refused, not served without its adapter
        msgspec.msgpack.decode(_pack(header["params"]), type=_ParamsBeforeLoras)
    assert decode(encode(Submit("r2", with_lora)))[0].params == with_lora


def test_parameters_given_at_their_default_are_not_sent_either():
    """omit_defaults leaves out only the default object itself: a client's "guidance_scale": 3.5, a
    512 or "none" parsed from JSON went on the wire, and a process of the release before such a field
    would refuse the request."""
    import json

    from triptych.params import params_from

    given = '"guidance_scale": 3.5, "max_sequence_length": 512, "step_cache": "none", "loras": []'
    body = json.loads('{"prompt": "a fox", "width": 64, "height": 48, "num_inference_steps": 2, ' + given + "}")
    params = params_from(body)
    assert _unpack(encode(Submit("r1", params))[0])["params"] == {"prompt": "a fox", "width": 64, "height": 48,
                                                                   "num_inference_steps": 2}  # fmt: skip
    assert params == GenerationParams("a fox", 64, 48, num_inference_steps=2)
    assert params_from({**body, "guidance_scale": 3.0}).guidance_scale == 3.0
