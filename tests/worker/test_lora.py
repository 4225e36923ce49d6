"""The denoiser's LoRA adapters (worker/triptych_worker/lora.py), in-process on the tiny models: the
stock pipeline's pixels after the same load_lora_weights / set_adapters calls, each adapter loaded
once, the least recently used unloaded when the cache's bytes run out, and a bad adapter failing
only its own request while the base model stays as it was."""

from __future__ import annotations

import inspect
import io
from collections.abc import Mapping
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from tests.worker.test_role_pipelines import over_the_wire, reference_png
from triptych.lora import BadAdapter, LoraCatalog
from triptych.params import GenerationParams, LoraWeight
from triptych.roles import Role
from triptych_worker.pipeline import RolePipeline, load_role_pipeline
from triptych_worker.stages import PIXELS, StageBatch

IMAGE = GenerationParams("a lighthouse", width=32, height=32, num_inference_steps=3, seed=3)
VIDEO = GenerationParams("waves", width=32, height=32, num_frames=5, num_inference_steps=3, seed=5,
                         guidance_scale=5.0, negative_prompt="blurry")  # fmt: skip
EDIT = GenerationParams("make it a watercolor", width=32, height=32, num_inference_steps=2, seed=7,
                        guidance_scale=2.5, image=reference_png())  # fmt: skip
GIB = 1 << 30


def with_loras(params: GenerationParams, *loras: tuple[str, float]) -> GenerationParams:
    return msgspec.structs.replace(params, loras=tuple(LoraWeight(name, weight) for name, weight in loras))


def stock(model: Path, params: GenerationParams, sources: Mapping[str, Path]) -> np.ndarray:
    """The stock pipeline's pixels [n, frames, H, W, 3] after `pipe.load_lora_weights(source, adapter_name=name)`
    for each adapter the request names and `pipe.set_adapters(names, adapter_weights=weights)`."""
    from diffusers import DiffusionPipeline
    from PIL import Image

    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    for lora in params.loras:
        pipe.load_lora_weights(str(sources[lora.name]), adapter_name=lora.name)
    if params.loras:
        pipe.set_adapters([lora.name for lora in params.loras], adapter_weights=[lora.weight for lora in params.loras])
    p = params
    common = {"prompt": p.prompt, "width": p.width, "height": p.height, "num_inference_steps": p.num_inference_steps,
              "guidance_scale": p.guidance_scale, "generator": torch.Generator("cpu").manual_seed(p.seed)}  # fmt: skip
    if p.num_frames > 1:
        frames = pipe(**common, negative_prompt=p.negative_prompt, num_frames=p.num_frames, output_type="np").frames
        return (frames * 255).round().astype(np.uint8)
    if "max_area" in inspect.signature(pipe.__call__).parameters:  # Kontext: the size asked for is the size made
        common.update(max_area=p.width * p.height)
    if p.image is not None:
        common.update(image=Image.open(io.BytesIO(p.image)).convert("RGB"))
    images = pipe(**common, num_images_per_prompt=p.num_outputs, output_type="pil").images
    return np.stack([np.array(image) for image in images])[:, None]


def pixels(pipeline: RolePipeline, params: GenerationParams) -> np.ndarray:
    return pipeline.run(StageBatch(params)).tensors[PIXELS].numpy()


def catalog(tiny_loras: Mapping[str, Path]) -> LoraCatalog:
    missing = tiny_loras["flux-ink"].parent / "no-such-adapter"
    return LoraCatalog({**{name: str(path) for name, path in tiny_loras.items()}, "gone": str(missing)})


@pytest.fixture(scope="module")
def flux(tiny_models, tiny_loras) -> RolePipeline:  # type: ignore[no-untyped-def]
    return load_role_pipeline(str(tiny_models["tiny-flux"]), Role.MONOLITHIC, "cpu", 0, catalog(tiny_loras), GIB)


@pytest.mark.parametrize(
    "loras", [(("flux-ink", 0.8),), (("flux-ink", 0.8), ("flux-paper", 1.3))], ids=["one", "two-with-weights"]
)
def test_adapters_with_weights_equal_stock_and_a_request_without_them_the_base_model(
    flux, tiny_models, tiny_loras, loras
) -> None:  # type: ignore[no-untyped-def]
    base = pixels(flux, IMAGE)
    adapted = pixels(flux, with_loras(IMAGE, *loras))
    assert np.array_equal(adapted, stock(tiny_models["tiny-flux"], with_loras(IMAGE, *loras), tiny_loras))
    assert not np.array_equal(adapted, base), "the adapters changed nothing: the test proves nothing"
    assert np.array_equal(pixels(flux, IMAGE), stock(tiny_models["tiny-flux"], IMAGE, tiny_loras))


def test_a_wan_video_and_a_kontext_edit_with_an_adapter_equal_stock(tiny_models, tiny_loras) -> None:
    cases = (("tiny-wan", VIDEO, "wan-ink"), ("tiny-flux-kontext", EDIT, "flux-ink"))
    for package, params, adapter in cases:
        model = tiny_models[package]
        pipeline = load_role_pipeline(str(model), Role.MONOLITHIC, "cpu", 0, catalog(tiny_loras), GIB)
        request = with_loras(params, (adapter, 0.7))
        adapted = pixels(pipeline, request)
        assert np.array_equal(adapted.reshape(-1), stock(model, request, tiny_loras).reshape(-1)), package
        assert not np.array_equal(adapted, pixels(pipeline, params)), package


def test_an_adapter_is_loaded_once_and_held_while_it_fits(flux) -> None:  # type: ignore[no-untyped-def]
    loads = flux.loras.loads
    pixels(flux, with_loras(IMAGE, ("flux-ink", 1.0)))
    pixels(flux, with_loras(IMAGE, ("flux-ink", 0.5)))
    assert "flux-ink" in flux.loras.held()
    assert flux.loras.loads - loads <= 1


def test_the_cache_unloads_the_least_recently_used_adapter_when_its_bytes_run_out(tiny_models, tiny_loras) -> None:
    roomy = load_role_pipeline(str(tiny_models["tiny-flux"]), Role.DENOISER, "cpu", 0, catalog(tiny_loras), GIB)
    for name in ("flux-ink", "flux-paper"):  # loaded and activated: nothing needs to run
        with roomy.loras.applied(with_loras(IMAGE, (name, 1.0))):
            pass
    sizes = roomy.loras.sizes()
    assert set(sizes) == {"flux-ink", "flux-paper"} and all(sizes.values())

    # Room for the larger of the two, not for both.
    tight = load_role_pipeline(
        str(tiny_models["tiny-flux"]), Role.DENOISER, "cpu", 0, catalog(tiny_loras), max(sizes.values())
    )
    for name in ("flux-ink", "flux-paper", "flux-ink"):
        with tight.loras.applied(with_loras(IMAGE, (name, 1.0))):
            pass
        assert tight.loras.held() == (name,)
    assert (tight.loras.loads, tight.loras.evictions) == (3, 2)
    with pytest.raises(BadAdapter, match=r"^loras: adapters flux-ink, flux-paper need \d+ bytes together"):
        with tight.loras.applied(with_loras(IMAGE, ("flux-ink", 1.0), ("flux-paper", 1.0))):
            pass
    assert tight.loras.held() == ()


def test_an_adapter_whose_catalogue_entry_names_another_file_is_loaded_again_from_it(tiny_models, tiny_loras) -> None:
    pipeline = load_role_pipeline(str(tiny_models["tiny-flux"]), Role.MONOLITHIC, "cpu", 0, catalog(tiny_loras), GIB)
    request = with_loras(IMAGE, ("flux-ink", 0.8))
    before = pixels(pipeline, request)
    moved = {**tiny_loras, "flux-ink": tiny_loras["flux-paper"]}  # the operator pointed `ink` at a new file
    pipeline.loras.catalog = LoraCatalog({name: str(path) for name, path in moved.items()})
    after = pixels(pipeline, request)
    assert np.array_equal(after, stock(tiny_models["tiny-flux"], request, moved))
    assert not np.array_equal(after, before), "the two files make the same pixels: the test proves nothing"


def test_a_request_whose_adapter_fails_to_load_leaves_the_cache_within_its_bytes(tiny_models, tiny_loras) -> None:
    roomy = load_role_pipeline(str(tiny_models["tiny-flux"]), Role.DENOISER, "cpu", 0, catalog(tiny_loras), GIB)
    for name in ("flux-ink", "flux-paper"):
        with roomy.loras.applied(with_loras(IMAGE, (name, 1.0))):
            pass
    room = max(roomy.loras.sizes().values())
    tight = load_role_pipeline(str(tiny_models["tiny-flux"]), Role.DENOISER, "cpu", 0, catalog(tiny_loras), room)
    for name in ("flux-ink", "flux-paper", "flux-ink"):  # a fresh adapter paired with one that cannot load
        with pytest.raises(BadAdapter, match="gone"):
            with tight.loras.applied(with_loras(IMAGE, (name, 1.0), ("gone", 1.0))):
                pass
        assert tight.loras.held_bytes() <= room, tight.loras.sizes()


BAD = {
    "unknown": r"^loras: adapter 'unknown' is not in this denoiser's catalogue",
    "gone": r"^loras: adapter 'gone': .*no-such-adapter does not exist on this denoiser",
    "wan-ink": r"^loras: adapter 'wan-ink' .* cannot be loaded into this model's transformer: NoMatchingPeft",
    "flux-misfit": r"^loras: adapter 'flux-misfit' .* would change the base model's own layers",
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_adapter_fails_only_its_request_and_leaves_the_model_as_it_was(
    flux, tiny_models, tiny_loras, name
) -> None:  # type: ignore[no-untyped-def]
    held = pixels(flux, with_loras(IMAGE, ("flux-ink", 0.8)))
    with pytest.raises(BadAdapter, match=BAD[name]):
        pixels(flux, with_loras(IMAGE, (name, 1.0)))
    assert np.array_equal(pixels(flux, IMAGE), stock(tiny_models["tiny-flux"], IMAGE, tiny_loras))
    assert np.array_equal(pixels(flux, with_loras(IMAGE, ("flux-ink", 0.8))), held)


def split_roles(tiny_models, tiny_loras, cache_bytes: int = 0) -> dict[Role, RolePipeline]:  # type: ignore[no-untyped-def]
    """A disaggregated tiny FLUX.1 in-process: encoder, denoiser and decoder, each with the catalogue."""
    model = str(tiny_models["tiny-flux"])
    return {
        role: load_role_pipeline(model, role, "cpu", cache_bytes, catalog(tiny_loras), GIB)
        for role in (Role.ENCODER, Role.DENOISER, Role.DECODER)
    }


def run_roles(roles: Mapping[Role, RolePipeline], params: GenerationParams) -> np.ndarray:
    batch = StageBatch(params)
    for i, pipeline in enumerate(roles.values()):
        batch = pipeline.run(over_the_wire(batch) if i else batch)
    return batch.tensors[PIXELS].numpy()


def test_an_adapter_s_text_encoder_part_is_applied_monolithic_and_disaggregated(flux, tiny_models, tiny_loras) -> None:  # type: ignore[no-untyped-def]
    # flux-ink-te is flux-ink plus factors for the CLIP text encoder: stock applies both parts.
    request = with_loras(IMAGE, ("flux-ink-te", 0.8))
    expected = stock(tiny_models["tiny-flux"], request, tiny_loras)
    transformer_only = stock(tiny_models["tiny-flux"], with_loras(IMAGE, ("flux-ink", 0.8)), tiny_loras)
    assert not np.array_equal(expected, transformer_only), "the text-encoder part changed nothing: proves nothing"
    assert np.array_equal(pixels(flux, request), expected), "monolithic"
    roles = split_roles(tiny_models, tiny_loras)
    assert np.array_equal(run_roles(roles, request), expected), "encoder, denoiser, decoder"
    mixed = with_loras(IMAGE, ("flux-ink-te", 0.8), ("flux-paper", 1.3))
    assert np.array_equal(run_roles(roles, mixed), stock(tiny_models["tiny-flux"], mixed, tiny_loras))
    assert np.array_equal(run_roles(roles, IMAGE), stock(tiny_models["tiny-flux"], IMAGE, tiny_loras))


def test_the_encoder_loads_text_encoder_parts_only_and_adapters_without_one_cost_it_nothing(  # type: ignore[no-untyped-def]
    tiny_models, tiny_loras
) -> None:
    encoder = load_role_pipeline(str(tiny_models["tiny-flux"]), Role.ENCODER, "cpu", 0, catalog(tiny_loras), GIB)
    for name in ("flux-ink", "flux-ink-te", "flux-ink"):
        with encoder.loras.applied(with_loras(IMAGE, (name, 1.0))):
            pass
    assert encoder.loras.held() == ("flux-ink-te",) and encoder.loras.loads == 1
    text_encoder = encoder.adapter.pipe.text_encoder
    assert any(".flux-ink-te." in n for n, _ in text_encoder.named_parameters())
    assert not any(".flux-ink." in n for n, _ in text_encoder.named_parameters())
    # The denoiser loads the transformer part only: flux-ink-te's transformer factors are flux-ink's.
    denoiser = load_role_pipeline(str(tiny_models["tiny-flux"]), Role.DENOISER, "cpu", 0, catalog(tiny_loras), GIB)
    for name in ("flux-ink", "flux-ink-te"):
        with denoiser.loras.applied(with_loras(IMAGE, (name, 1.0))):
            pass
    weights = dict(denoiser.adapter.pipe.transformer.named_parameters())
    ink = {n: p for n, p in weights.items() if ".flux-ink." in n}
    assert ink and all(torch.equal(p, weights[n.replace(".flux-ink.", ".flux-ink-te.")]) for n, p in ink.items())


def test_the_encoder_s_cache_unloads_the_least_recently_used_text_encoder_part(tiny_models, tiny_loras) -> None:  # type: ignore[no-untyped-def]
    entries = {"te-a": str(tiny_loras["flux-ink-te"]), "te-b": str(tiny_loras["flux-ink-te"])}
    model = str(tiny_models["tiny-flux"])
    roomy = load_role_pipeline(model, Role.PROMPT_ENCODER, "cpu", 0, LoraCatalog(entries), GIB)
    with roomy.loras.applied(with_loras(IMAGE, ("te-a", 1.0))):
        pass
    one = roomy.loras.sizes()["te-a"]
    tight = load_role_pipeline(model, Role.PROMPT_ENCODER, "cpu", 0, LoraCatalog(entries), one)
    for name in ("te-a", "te-b", "te-a"):
        with tight.loras.applied(with_loras(IMAGE, (name, 1.0))):
            pass
        assert tight.loras.held() == (name,)
    assert (tight.loras.loads, tight.loras.evictions) == (3, 2)
    assert not any(".te-b." in n for n, _ in tight.adapter.pipe.text_encoder.named_parameters())


def test_the_prompt_cache_never_serves_an_adapter_s_embedding_to_another_adapter_set(tiny_models, tiny_loras) -> None:  # type: ignore[no-untyped-def]
    roles = split_roles(tiny_models, tiny_loras, cache_bytes=GIB)
    requests = {"te": with_loras(IMAGE, ("flux-ink-te", 0.8)), "plain": IMAGE,
                "te-weaker": with_loras(IMAGE, ("flux-ink-te", 0.4))}  # fmt: skip
    expected = {case: stock(tiny_models["tiny-flux"], request, tiny_loras) for case, request in requests.items()}
    for _ in range(2):  # the second round from the cache
        for case, request in requests.items():
            assert np.array_equal(run_roles(roles, request), expected[case]), case
    assert roles[Role.ENCODER].encoder_cache is not None and len(roles[Role.ENCODER].encoder_cache) == 3


def test_a_bad_adapter_on_the_encoder_is_a_bad_adapter_naming_the_field(tiny_models, tiny_loras) -> None:  # type: ignore[no-untyped-def]
    encoder = load_role_pipeline(str(tiny_models["tiny-flux"]), Role.ENCODER, "cpu", 0, catalog(tiny_loras), GIB)
    for name, message in (("unknown", "not in this encoder's catalogue"), ("gone", "does not exist on this encoder")):
        with pytest.raises(BadAdapter, match=rf"^loras: adapter '{name}'.*{message}"):
            encoder.run(StageBatch(with_loras(IMAGE, (name, 1.0))))
    for name in ("wan-ink", "flux-misfit"):  # nothing for a text encoder: the denoiser judges them
        encoder.run(StageBatch(with_loras(IMAGE, (name, 1.0))))
    assert encoder.loras.held() == ()


def test_the_prompt_cache_keys_an_embedding_on_the_file_it_was_made_with_when_the_catalogue_changes_meanwhile(
    tiny_models, tiny_loras, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """The operator points `style` at a retrained file while a prompt is being encoded with the old one:
    that embedding is kept under the old file's key, and the next request, with the new file, is encoded
    anew (it used to be served the old file's embedding, for as long as the cache held it)."""
    from safetensors.torch import load_file, save_file

    source = tiny_loras["flux-ink-te"]
    retrained = tmp_path / "retrained"
    retrained.mkdir()
    weights = load_file(str(source / "pytorch_lora_weights.safetensors"))
    weights = {k: -v if k.startswith("text_encoder") and "lora_B" in k else v for k, v in weights.items()}
    save_file(weights, str(retrained / "pytorch_lora_weights.safetensors"), metadata={"format": "pt"})
    listing = tmp_path / "catalog.txt"
    listing.write_text(f"style={source}\n")
    model = str(tiny_models["tiny-flux"])
    encoder = load_role_pipeline(model, Role.ENCODER, "cpu", GIB, LoraCatalog(path=str(listing)), GIB)
    request = with_loras(IMAGE, ("style", 1.0))
    encode = encoder.adapter.encode_texts

    def encode_while_the_catalogue_changes(params):  # type: ignore[no-untyped-def]
        encoded = encode(params)
        listing.write_text(f"style={retrained}\n")
        return encoded

    encoder.adapter.encode_texts = encode_while_the_catalogue_changes  # type: ignore[method-assign]
    encoder.run(StageBatch(request))
    encoder.adapter.encode_texts = encode  # type: ignore[method-assign]
    second = encoder.run(StageBatch(request)).tensors
    fresh = load_role_pipeline(model, Role.ENCODER, "cpu", 0, LoraCatalog({"style": str(retrained)}), GIB)
    expected = fresh.run(StageBatch(request)).tensors
    assert torch.equal(second["pooled_prompt_embeds"], expected["pooled_prompt_embeds"])
    old = load_role_pipeline(model, Role.ENCODER, "cpu", 0, LoraCatalog({"style": str(source)}), GIB)
    assert not torch.equal(
        expected["pooled_prompt_embeds"], old.run(StageBatch(request)).tensors["pooled_prompt_embeds"]
    )


def test_an_adapter_counts_its_own_tensors_whatever_its_name(tiny_models, tiny_loras) -> None:  # type: ignore[no-untyped-def]
    """Names that are also parts of the model's own parameter names (`0`, `attn`) count the adapter's
    bytes, not the blocks': counted as the model's size, such an adapter was refused after every
    other one had been unloaded to make room for it."""
    same = {name: str(tiny_loras["flux-ink"]) for name in ("ink", "0", "attn")}
    denoiser = load_role_pipeline(str(tiny_models["tiny-flux"]), Role.DENOISER, "cpu", 0, LoraCatalog(same), GIB)
    for name in same:
        with denoiser.loras.applied(with_loras(IMAGE, (name, 1.0))):
            pass
    sizes = denoiser.loras.sizes()
    assert sizes["0"] == sizes["attn"] == sizes["ink"] > 0, sizes
