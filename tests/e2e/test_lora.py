"""LoRA adapters per request, real processes on CPU: the stock pipeline's pixels after the same
`load_lora_weights` / `set_adapters` calls, byte for byte, disaggregated and monolithic, an adapter's
text-encoder part included (the encoder applies it; its prompt cache keeps adapter sets apart); bad adapters
a 400 naming `loras` with every process still serving; an adapter added to the catalogue file served
without a restart; and two denoisers: a request goes to the one holding its adapters while it has room.

The disaggregated head, encoder and denoiser read their adapters from a --lora-catalog file, monolithic mode
from --lora flags. Tiny FLUX.1 Kontext serves text-to-image and edits alike.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from PIL import Image

from tests.e2e.harness import deployment
from tests.worker.test_lora import stock
from tests.worker.test_role_pipelines import reference_png
from triptych.params import GenerationParams, LoraWeight
from triptych.roles import Role
from triptych_dev.localdeploy import LocalDeployment, local_monolithic

pytestmark = pytest.mark.slow

IMAGE = {"prompt": "a lighthouse at dusk", "size": "32x32", "seed": 1234, "num_inference_steps": 3,
         "guidance_scale": 3.5, "n": 1}  # fmt: skip
REFERENCE = reference_png(40, 56)
EDIT = {"prompt": "make it a watercolor", "size": "32x32", "seed": "7", "num_inference_steps": "2",
        "guidance_scale": "2.5"}  # fmt: skip
CASES: dict[str, list[dict[str, Any]]] = {
    "none": [],
    "one": [{"name": "flux-ink", "weight": 0.8}],
    "two": [{"name": "flux-ink", "weight": 0.8}, {"name": "flux-paper", "weight": 1.3}],
    # transformer and CLIP text-encoder factors; the prompt of "none" before it: the cache must not serve it
    "text encoder": [{"name": "flux-ink-te", "weight": 0.8}],
}
SERVED = ("flux-ink", "flux-paper", "flux-ink-te", "wan-ink", "flux-misfit", "flux-out")


def params_of(request: dict[str, Any], loras: list[dict[str, Any]], image: bytes | None = None) -> GenerationParams:
    w, h = map(int, str(request["size"]).split("x"))
    return GenerationParams(
        str(request["prompt"]), w, h, num_inference_steps=int(request["num_inference_steps"]),
        guidance_scale=float(request["guidance_scale"]), seed=int(request["seed"]), image=image,
        loras=tuple(msgspec.convert(lora, LoraWeight) for lora in loras),
    )  # fmt: skip


def pixels_of(response: Any) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    return np.stack([np.array(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in data])[:, None]


def generate(client: Any, loras: list[dict[str, Any]], **more: Any) -> Any:
    return client.post("/v1/images/generations", json={**IMAGE, **more, "loras": loras})


def edit(client: Any, loras: list[dict[str, Any]]) -> Any:
    files = {"image": ("ref.png", REFERENCE, "image/png")}
    return client.post("/v1/images/edits", data={**EDIT, "loras": json.dumps(loras)}, files=files)


def run_cases(client: Any) -> dict[str, np.ndarray]:
    out = {case: pixels_of(generate(client, loras)) for case, loras in CASES.items()}
    out["edit"] = pixels_of(edit(client, CASES["one"]))
    return out


def write_catalog(path: Path, tiny_loras: Mapping[str, Path]) -> Path:
    lines = [f"{name}={tiny_loras[name]}" for name in SERVED]
    path.write_text("\n".join(["# the adapters of this deployment", *lines, ""]))
    return path


def add_a_missing_adapter(catalog: Path) -> None:
    """`gone`, whose path does not exist: in the catalogue at start-up it would refuse the encoders' and
    denoisers' start (tests/unit/test_lora_sources.py); added to the catalogue they re-read, it is kept
    (and logged), and fails only the requests naming it."""
    catalog.write_text(catalog.read_text() + "gone=/nonexistent/adapter\n")


@pytest.fixture(scope="module")
def catalog_file(tiny_loras, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return write_catalog(tmp_path_factory.mktemp("catalog") / "loras.txt", tiny_loras)


@pytest.fixture(scope="module")
def disaggregated(tiny_models, catalog_file, tmp_path_factory) -> Iterator[LocalDeployment]:  # type: ignore[no-untyped-def]
    flags = ("--lora-catalog", str(catalog_file))
    model, tmp = tiny_models["tiny-flux-kontext"], tmp_path_factory.mktemp("disagg")
    with deployment(model, tmp, head_flags=flags, role_flags={Role.ENCODER: flags, Role.DENOISER: flags}) as dep:
        add_a_missing_adapter(catalog_file)
        yield dep


@pytest.fixture(scope="module")
def expected(tiny_models, tiny_loras) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    model = tiny_models["tiny-flux-kontext"]
    out = {case: stock(model, params_of(IMAGE, loras), tiny_loras) for case, loras in CASES.items()}
    out["edit"] = stock(model, params_of(EDIT, CASES["one"], REFERENCE), tiny_loras)
    return out


def test_adapters_equal_stock_disaggregated_and_monolithic(disaggregated, tiny_models, tiny_loras, expected, tmp_path):  # type: ignore[no-untyped-def]
    with disaggregated.client(300) as c:
        disagg = run_cases(c)
    flags = ("--device", "cpu", *(f for name in SERVED for f in ("--lora", f"{name}={tiny_loras[name]}")))
    with (
        local_monolithic(tiny_models["tiny-flux-kontext"], tmp_path / "mono", flags=flags) as dep,
        dep.client(300) as c,
    ):
        mono = run_cases(c)
    for case, reference in expected.items():
        assert np.array_equal(disagg[case], reference), f"{case}: disaggregated pixels differ from stock"
        assert np.array_equal(mono[case], reference), f"{case}: monolithic pixels differ from stock"
    assert not np.array_equal(disagg["one"], disagg["none"]) and not np.array_equal(disagg["two"], disagg["one"])
    assert not np.array_equal(disagg["text encoder"], disagg["one"]), "the text-encoder part changed nothing"


BAD = {
    "unknown": ([{"name": "nope"}], "loras[0].name 'nope' is not an adapter of this deployment"),
    "too many": ([{"name": n} for n in (*SERVED, "gone")], "loras: List should have at most 4 items"),
    "weight": ([{"name": "flux-ink", "weight": "heavy"}], "loras.0.weight: Input should be a valid number"),
    "missing file": ([{"name": "gone"}], "loras: adapter 'gone': /nonexistent/adapter does not exist"),
    "another family's": ([{"name": "wan-ink"}], "loras: adapter 'wan-ink' "),
    "incompatible shapes": ([{"name": "flux-misfit"}], "loras: adapter 'flux-misfit' "),
}


def test_bad_adapters_are_a_400_naming_the_field_and_every_process_keeps_serving(disaggregated, expected) -> None:  # type: ignore[no-untyped-def]
    with disaggregated.client(300) as c:
        for case, (loras, message) in BAD.items():
            r = generate(c, loras)
            assert r.status_code == 400, (case, r.text)
            assert message in r.json()["error"]["message"], (case, r.json())
            assert r.json()["error"]["param"] == "loras", (case, r.json())
        assert np.array_equal(pixels_of(generate(c, CASES["one"])), expected["one"])
        assert np.array_equal(pixels_of(generate(c, [])), expected["none"])
    assert all(proc.popen.poll() is None for proc in disaggregated.procs), "a process died"
    (denoiser,) = disaggregated.workers(Role.DENOISER)  # the re-read catalogue's bad entry, said in its log
    assert "gone=/nonexistent/adapter: /nonexistent/adapter does not exist on this denoiser" in denoiser.log.read_text()


def test_an_adapter_added_to_the_catalog_file_is_served_without_a_restart(  # type: ignore[no-untyped-def]
    disaggregated, catalog_file, tiny_loras, expected
) -> None:
    late = [{"name": "late-ink", "weight": 0.8}]
    with disaggregated.client(300) as c:
        assert generate(c, late).status_code == 400
        text = catalog_file.read_text()
        catalog_file.write_text(text + f"late-ink={tiny_loras['flux-ink']}\n")
        try:
            r = generate(c, late)
        finally:
            catalog_file.write_text(text)
    assert np.array_equal(pixels_of(r), expected["one"])  # the same adapter, under its new name


def held_by(client: Any) -> dict[str, list[str]]:
    return {w["url"]: w["loras"] for w in client.get("/health").json()["workers"]["denoiser"]}


def dispatched(client: Any) -> dict[str, int]:
    return {w["url"]: w["dispatched"] for w in client.get("/health").json()["workers"]["denoiser"]}


def wait_until_held(client: Any, count: int, timeout: float = 15) -> dict[str, list[str]]:
    """The denoisers' adapters once `count` of them hold flux-ink (their heartbeats say so)."""
    deadline = time.monotonic() + timeout
    while True:
        held = held_by(client)
        if sum("flux-ink" in names for names in held.values()) >= count or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def test_requests_go_to_the_denoiser_holding_their_adapters_and_the_other_loads_them_only_when_it_is_full(
    tiny_models, tiny_loras, tmp_path
) -> None:
    flags = ("--lora", f"flux-ink={tiny_loras['flux-ink']}")
    one_at_a_time = (*flags, "--worker-capacity", "1")
    with deployment(
        tiny_models["tiny-flux"], tmp_path, denoisers=2, head_flags=flags,
        role_flags={Role.ENCODER: flags, Role.DENOISER: one_at_a_time},
    ) as dep, dep.client(300) as c:  # fmt: skip
        ink = CASES["one"][:1]
        pixels_of(generate(c, ink))
        held = wait_until_held(c, 1)
        (holder,) = [url for url, names in held.items() if names == ["flux-ink"]]
        (other,) = [url for url in held if url != holder]
        before = dispatched(c)
        for seed in range(4):  # one after the other: the holder always has room
            pixels_of(generate(c, ink, seed=seed))
        after = dispatched(c)
        assert (after[holder] - before[holder], after[other] - before[other]) == (4, 0)
        assert held_by(c)[other] == [], "the other denoiser loaded the adapter while the holder had room"

        # Many at once, each denoising long enough to keep the holder busy: the other takes some and loads it.
        slow = {"size": "128x128", "num_inference_steps": 12}
        with ThreadPoolExecutor(6) as pool:
            for r in list(pool.map(lambda seed: generate(c, ink, seed=seed, **slow), range(6))):
                pixels_of(r)
        final = dispatched(c)
        assert final[other] > after[other], f"the holder took every request: {final}"
        assert wait_until_held(c, 2)[other] == ["flux-ink"]


def test_batching_groups_only_requests_with_the_same_adapters(tiny_models, tiny_loras, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.e2e.test_batching import HEAD_FLAGS, assert_close, batched_concurrently

    flags = ("--lora", f"flux-ink={tiny_loras['flux-ink']}")
    base = {**IMAGE, "size": "64x48", "n": 1}
    requests = [
        {**base, "prompt": f"a lighthouse number {i}", "seed": 10 + i, **({"loras": CASES["one"]} if i % 2 else {})}
        for i in range(4)
    ]  # fmt: skip
    with deployment(
        tiny_models["tiny-flux"], tmp_path, head_flags=(*HEAD_FLAGS, *flags), worker_flags=("--batching-max-size", "4"),
        role_flags={Role.ENCODER: flags, Role.DENOISER: flags},
    ) as dep, dep.client(300) as c:  # fmt: skip
        batched, deltas = batched_concurrently(dep, c, requests)
        sent, ran = deltas("denoiser", "count")
        assert sent >= 2 and ran >= 2, "requests with and without the adapter left or ran as one batch"
        for request, image in zip(requests, batched, strict=True):  # mixed, half would carry the other's adapter
            assert_close(image, pixels_of(c.post("/v1/images/generations", json=request))[0, 0])


def test_a_two_rank_full_pipeline_worker_applies_adapters_as_stock_and_a_bad_one_leaves_it_serving(  # type: ignore[no-untyped-def]
    tiny_models, tiny_loras, expected, tmp_path
) -> None:
    """`--num-gpus 2 --disagg-full-pipeline` (Ulysses 2): an adapter's transformer part loads on both
    ranks (flux-out's on the transformer's own proj_out, where the sequence shards are joined), its
    text-encoder part on rank 0's encoder; the pixels are stock diffusers'. An adapter that does not
    load is a 400 naming `loras`, and the ranks go on in step."""
    catalog = write_catalog(tmp_path / "loras.txt", tiny_loras)
    model, flags = tiny_models["tiny-flux-kontext"], ("--lora-catalog", str(catalog))
    mixed = [{"name": "flux-ink-te", "weight": 0.8}, {"name": "flux-out", "weight": 1.3}]
    with deployment(
        model, tmp_path, denoisers=1, full_pipeline=True, head_flags=flags,
        role_flags={Role.DENOISER: flags}, devices={Role.DENOISER: [["cpu", "cpu"]]},
    ) as dep, dep.client(timeout=300) as c:  # fmt: skip
        add_a_missing_adapter(catalog)
        got = pixels_of(generate(c, mixed))
        for case in ("two", "none"):
            assert np.array_equal(pixels_of(generate(c, CASES[case])), expected[case]), case
        for name in ("flux-misfit", "gone"):  # fails on both ranks; at rank 0's encoder, before them
            bad = generate(c, [{"name": name, "weight": 1.0}])
            assert bad.status_code == 400, bad.text
            assert f"loras: adapter '{name}'" in bad.json()["error"]["message"], bad.text
            assert bad.json()["error"]["param"] == "loras", bad.text
        assert np.array_equal(pixels_of(generate(c, CASES["one"])), expected["one"])
        log = (dep.workdir / "denoiser-0.log").read_text(errors="replace")
    assert "full pipeline on 2 ranks" in log
    assert np.array_equal(got, stock(model, params_of(IMAGE, mixed), tiny_loras)), "pixels differ from stock"


TP_PIXEL_TOLERANCE = 1  # uint8 levels, as without adapters (tests/e2e/test_parallel_ranks.py)


def test_a_tensor_parallel_denoiser_applies_its_shards_of_the_adapters_as_stock(  # type: ignore[no-untyped-def]
    tiny_models, tiny_loras, expected, tmp_path
) -> None:
    """`--num-gpus 2 --denoiser-tp 2`: each rank loads its cut of every adapter's factors (column- and
    row-parallel layers, FLUX's packed single-block proj_out, the unsharded top-level proj_out); the pixels
    are stock diffusers' within the TP tolerance, and an adapter that does not load is a 400 naming `loras`."""
    catalog = write_catalog(tmp_path / "loras.txt", tiny_loras)
    model, flags = tiny_models["tiny-flux-kontext"], ("--lora-catalog", str(catalog))
    tp = (*flags, "--denoiser-tp", "2")
    with deployment(
        model, tmp_path, head_flags=flags, role_flags={Role.ENCODER: flags, Role.DENOISER: tp},
        devices={Role.DENOISER: [["cpu", "cpu"]]},
    ) as dep, dep.client(timeout=300) as c:  # fmt: skip
        for case in ("two", "text encoder", "none"):
            diff = np.abs(pixels_of(generate(c, CASES[case])).astype(np.int16) - expected[case].astype(np.int16))
            assert diff.max() <= TP_PIXEL_TOLERANCE, (case, diff.max())
        bad = generate(c, [{"name": "flux-misfit", "weight": 1.0}])
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "loras", bad.text
        out = pixels_of(generate(c, [{"name": "flux-out", "weight": 1.3}, *CASES["one"]]))
        assert not np.array_equal(out, expected["one"])  # flux-out changed them: it was applied
        (denoiser,) = c.get("/health").json()["workers"]["denoiser"]
        assert denoiser["devices"] == 2  # a second of its stages is two devices' (device-second quotas)
        log = (dep.workdir / "denoiser-0.log").read_text(errors="replace")
    assert "parameter bytes per rank" in log
