"""A request stopped at a step boundary and continued by another denoiser gives the same pixels,
byte for byte, as one that never stopped (worker/triptych_worker/resume.py; docs/design.md "Migration").

Every denoiser here is its own loaded pipeline (as a separate process would be), and every hand-off
goes over the wire (tensors as raw bytes, meta through msgpack), so nothing but what a
continuation carries can reach the next denoiser.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tests.e2e.test_batching import assert_close
from tests.worker.test_role_pipelines import FLUX, WAN, over_the_wire
from triptych.lora import LoraCatalog
from triptych.params import GenerationParams, LoraWeight
from triptych.roles import Role
from triptych_worker.batching import run_merged
from triptych_worker.pipeline import RolePipeline, load_role_pipeline
from triptych_worker.resume import ADAPTERS, RESUME, CannotResume, capture, check_adapter_sources, restore, start
from triptych_worker.stages import PIXELS, StageBatch

STEPS = 6
CASES = {
    "flux": ("tiny-flux", msgspec.structs.replace(FLUX, num_inference_steps=STEPS, guidance_scale=3.5)),
    "flux-kontext-edit": ("tiny-flux-kontext", msgspec.structs.replace(FLUX, num_inference_steps=STEPS)),
    "wan-unipc-cfg": (
        "tiny-wan",
        msgspec.structs.replace(WAN, num_inference_steps=STEPS, guidance_scale=4.0, negative_prompt="blurry"),
    ),
}
DENOISERS = 3  # continuations alternate among them


@pytest.fixture(scope="module")
def pipelines(tiny_models: dict[str, Path]) -> dict[tuple[str, Role], RolePipeline]:
    out: dict[tuple[str, Role], RolePipeline] = {}
    for name in ("tiny-flux", "tiny-flux-kontext", "tiny-wan"):
        out[name, Role.ENCODER] = load_role_pipeline(str(tiny_models[name]), Role.ENCODER)
        out[name, Role.DECODER] = load_role_pipeline(str(tiny_models[name]), Role.DECODER)
        for i in range(DENOISERS):
            out[name, f"denoiser-{i}"] = load_role_pipeline(str(tiny_models[name]), Role.DENOISER)  # type: ignore[index]
    return out


@pytest.fixture(scope="module")
def reference_image() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 56), (200, 30, 90)).save(buf, format="PNG")
    return buf.getvalue()


def _params(case: str, reference_image: bytes) -> tuple[str, GenerationParams]:
    name, params = CASES[case]
    if name == "tiny-flux-kontext":
        params = msgspec.structs.replace(params, image=reference_image)
    return name, params


def denoise_moving(pipelines, name: str, batch: StageBatch, stops: list[int]) -> StageBatch:
    """Denoise `batch`, handing it to the next denoiser at each step of `stops` (in order)."""
    pending = list(stops)
    reached = [0]

    def progress(step: int, total: int, latents=None) -> None:
        reached[0] = step

    hop = 0
    while True:
        denoiser = pipelines[name, f"denoiser-{hop % DENOISERS}"]
        batch.on_progress = progress
        batch.hand_off = lambda: bool(pending) and reached[0] == pending[0]
        batch = denoiser.run(batch)
        if RESUME not in batch.meta:
            return batch
        assert batch.meta[RESUME]["step"] == pending.pop(0)
        batch = over_the_wire(batch)
        hop += 1


_ENCODED: dict[tuple[str, GenerationParams], StageBatch] = {}


def encoded(pipelines, name: str, params: GenerationParams) -> StageBatch:
    """The encoder's outputs over the wire (encoded once per request: a Kontext reference is slow)."""
    if (name, params) not in _ENCODED:
        _ENCODED[name, params] = pipelines[name, Role.ENCODER].run(StageBatch(params))
    return over_the_wire(_ENCODED[name, params])


def generate(pipelines, name: str, params: GenerationParams, stops: list[int]) -> torch.Tensor:
    batch = encoded(pipelines, name, params)
    batch = denoise_moving(pipelines, name, batch, stops)
    assert not stops or RESUME not in batch.meta
    return pipelines[name, Role.DECODER].run(over_the_wire(batch)).tensors[PIXELS]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_request_moved_once_or_three_times_gives_the_pixels_of_one_that_never_moved(
    pipelines, reference_image, case: str
) -> None:
    name, params = _params(case, reference_image)
    unmoved = generate(pipelines, name, params, [])
    for stops in ([1], [3], [STEPS - 1], [1, 2, 5], [2, 3, 4]):
        assert torch.equal(generate(pipelines, name, params, stops), unmoved), stops


def test_a_continuation_carries_its_inputs_latents_and_the_multistep_history(pipelines, reference_image) -> None:
    name, params = _params("wan-unipc-cfg", reference_image)
    batch = encoded(pipelines, name, params)
    steps: list[int] = []
    batch.on_progress = lambda step, total, latents=None: steps.append(step)
    batch.hand_off = lambda: len(steps) == 3
    batch = pipelines[name, "denoiser-0"].run(batch)
    assert steps == [1, 2, 3]
    assert set(batch.tensors) == {
        "prompt_embeds", "negative_prompt_embeds", "latents",
        "scheduler.model_outputs.0", "scheduler.model_outputs.1", "scheduler.last_sample",
    }  # fmt: skip
    state = batch.meta[RESUME]
    assert state["step"] == 3 and state["scheduler"]["class"] == "UniPCMultistepScheduler"
    assert state["scheduler"]["lower_order_nums"] == 2
    msgspec.msgpack.encode(batch.meta)  # meta crosses the head as msgpack


def test_a_handed_off_group_continues_as_a_group_with_the_pixels_of_requests_run_alone(pipelines) -> None:
    """A batched forward (two requests of two outputs each) stopped at step 2 and continued batched."""
    name, params = "tiny-flux", msgspec.structs.replace(CASES["flux"][1], num_outputs=2)
    prompts = ("a cat sitting on a red chair", "a lighthouse at dusk")
    requests = [msgspec.structs.replace(params, prompt=p, seed=s) for p, s in zip(prompts, (5, 6), strict=True)]
    alone = [generate(pipelines, name, request, []) for request in requests]
    batches = [encoded(pipelines, name, request) for request in requests]
    reached = [0]
    for hop, stop in enumerate((2, -1)):
        denoiser = pipelines[name, f"denoiser-{hop}"]
        for b in batches:
            b.on_progress = lambda step, total, latents=None: reached.__setitem__(0, step)
            b.hand_off = functools.partial(lambda at: reached[0] == at, stop)
        with torch.no_grad():
            for stage in denoiser.stages:
                assert all(e is None for e in stage.run_many(batches))
        if stop > 0:
            assert all(b.meta[RESUME]["step"] == stop for b in batches)
        batches = [over_the_wire(b) for b in batches]
    for b, expected in zip(batches, alone, strict=True):
        assert RESUME not in b.meta
        assert torch.equal(pipelines[name, Role.DECODER].run(b).tensors[PIXELS], expected)


def test_an_unknown_scheduler_is_refused_by_name() -> None:
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler()
    scheduler.set_timesteps(4)
    with pytest.raises(CannotResume, match="DDIMScheduler"):
        capture(scheduler, 1)


@pytest.mark.parametrize("case", ["flux", "wan-unipc-cfg"])
def test_a_member_asked_to_hand_off_leaves_its_group_and_the_others_run_on_in_place(pipelines, case: str) -> None:
    """A group of three, the middle request asked at step 2 (a drain asks only as many as there is room
    for elsewhere): it alone stops there, its continuation finishes on another denoiser, and the other
    two run their remaining steps where they are; every request's pixels are those of it run alone, within
    the tolerance of any batched forward (docs/batching.md)."""
    name, params = CASES[case]
    requests = [msgspec.structs.replace(params, prompt=f"{params.prompt} {i}", seed=params.seed + i) for i in range(3)]
    alone = [generate(pipelines, name, request, []) for request in requests]
    batches = [encoded(pipelines, name, request) for request in requests]
    steps: list[int] = []
    batches[0].on_progress = lambda step, total, latents=None: steps.append(step)
    batches[1].hand_off = lambda: len(steps) == 2
    with torch.no_grad():
        for stage in pipelines[name, "denoiser-0"].stages:
            assert all(e is None for e in stage.run_many(batches))
    assert steps == list(range(1, STEPS + 1)), "the others ran every step, none twice"
    assert batches[1].meta[RESUME]["step"] == 2
    moved = denoise_moving(pipelines, name, over_the_wire(batches[1]), [])
    for b, expected in zip((batches[0], moved, batches[2]), alone, strict=True):
        assert RESUME not in b.meta
        # a group's rows are within the batching tolerance of a request alone (docs/batching.md)
        assert_close(pipelines[name, Role.DECODER].run(over_the_wire(b)).tensors[PIXELS].numpy(), expected.numpy())


def test_run_merged_runs_on_the_members_not_asked_and_stops_when_every_one_is() -> None:
    """Without a model: a fake loop of 4 steps over the merged rows that asks before every step."""
    ran: list[tuple[int, int]] = []  # (rows, step) of every step run

    def loop(merged: StageBatch) -> None:
        first = merged.meta.pop(RESUME, {"step": 0})["step"]
        for step in range(first, 4):
            if merged.should_hand_off():
                merged.meta[RESUME] = {"step": step}
                return
            ran.append((len(merged.tensors["x"]), step))
            merged.report_progress(step + 1, 4)

    def member(asked_at: int | None) -> StageBatch:
        batch = StageBatch(FLUX, tensors={"x": torch.zeros(1)})
        steps: list[int] = []
        batch.on_progress = lambda step, total, latents=None: steps.append(step)
        batch.hand_off = lambda: asked_at is not None and len(steps) >= asked_at
        return batch

    batches = [member(None), member(1), member(3)]
    assert run_merged(batches, frozenset(), loop) == [None, None, None]
    assert ran == [(3, 0), (2, 1), (2, 2), (1, 3)]
    assert [b.meta.get(RESUME) for b in batches] == [None, {"step": 1}, {"step": 3}]
    ran.clear()
    every = [member(2), member(2)]
    assert run_merged(every, frozenset(), loop) == [None, None]
    assert ran == [(2, 0), (2, 1)] and [b.meta[RESUME] for b in every] == [{"step": 2}] * 2


def _broken(resume: dict[str, Any], change: str) -> dict[str, Any]:
    out = copy.deepcopy(resume)
    if change == "no scheduler":
        del out["scheduler"]
    elif change == "scheduler not a map":
        out["scheduler"] = "x"
    elif change == "no class":
        del out["scheduler"]["class"]
    elif change == "timestep not a number":
        out["scheduler"]["timestep"] = "soon"
    elif change == "step past the schedule":
        out["step"] = 99
    elif change == "history missing":  # UniPC's: what its restore reads besides the common keys
        out["scheduler"].pop("model_outputs", None)
        out["scheduler"].pop("lower_order_nums", None)
    elif change == "begin index infinite":  # int(inf) raises OverflowError, which escaped as a 500
        out["scheduler"]["begin_index"] = float("inf")
    elif change == "begin index not 0":  # a continuation always begins its schedule at 0
        out["scheduler"]["begin_index"] = 2
    elif change == "history count infinite":
        out["scheduler"]["lower_order_nums"] = float("inf")
    return out


@pytest.mark.parametrize("name", ["FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler"])
@pytest.mark.parametrize(
    "change",
    ["no scheduler", "scheduler not a map", "no class", "timestep not a number", "step past the schedule",
     "history missing", "begin index infinite", "begin index not 0", "history count infinite"],
)  # fmt: skip
def test_a_malformed_continuation_state_is_refused_naming_it(name: str, change: str) -> None:
    """Another denoiser's message: a KeyError or IndexError before, now CannotResume (its request
    fails with a message naming meta.resume); a well-formed one still restores."""
    import diffusers

    scheduler = getattr(diffusers, name)()
    scheduler.set_timesteps(4)
    resume, tensors = capture(scheduler, 1)
    if name == "FlowMatchEulerDiscreteScheduler" and change in ("history missing", "history count infinite"):
        assert restore(scheduler, _broken(resume, change), tensors) == 1  # it keeps no history
        return
    with pytest.raises(CannotResume, match=r"meta\.resume\.(scheduler is malformed|step 99|scheduler\.begin_index 2)"):
        restore(scheduler, _broken(resume, change), tensors)
    scheduler.set_timesteps(4)
    assert restore(scheduler, resume, tensors) == 1


@pytest.mark.parametrize("history", [1, 3], ids=["shorter", "longer"])
def test_a_multistep_history_of_another_solver_order_is_refused_and_leaves_the_scheduler_clean(history: int) -> None:
    """A continuation from a UniPC of another solver_order (or forged) is refused before any of it is
    set, and a fresh schedule starts as a new scheduler does: the next request steps through its whole
    schedule (a short history kept there made every later step() raise IndexError)."""
    import diffusers

    sender = diffusers.UniPCMultistepScheduler(solver_order=history)
    sender.set_timesteps(4)
    resume, tensors = capture(sender, 1)
    receiver = diffusers.UniPCMultistepScheduler(solver_order=2)
    receiver.set_timesteps(4)
    with pytest.raises(CannotResume, match=r"meta\.resume\.scheduler is malformed .*solver_order"):
        restore(receiver, resume, tensors)
    receiver.timestep_list = [receiver.timesteps[0]]  # even one a partial restore left: start() clears it
    receiver.set_timesteps(4)
    assert start(receiver, StageBatch(GenerationParams("x", 8, 8)), {}) == 0
    sample = torch.zeros(1, 4, 2, 2)
    for t in receiver.timesteps:  # the whole schedule steps: no IndexError
        sample = receiver.step(torch.ones_like(sample), t, sample).prev_sample


def test_on_a_rank_a_group_whose_continuation_cannot_resume_fails_together_and_the_instance_lives() -> None:
    """On a rank (retry_alone off) CannotResume is raised by every rank at the same point: the group's
    requests fail with it, and nothing goes up to take the instance down; another failure still does."""
    from triptych_worker.pipeline import BatchedAdapterStage

    class Batched(BatchedAdapterStage):
        name = "denoise"
        retry_alone = False

        def __init__(self, error: Exception) -> None:
            self.error = error

        def run(self, batch: StageBatch) -> None:
            raise self.error

        def run_batched(self, batches: list[StageBatch]) -> list[Exception | None]:
            raise self.error

    group = [StageBatch(GenerationParams("a", 8, 8)), StageBatch(GenerationParams("b", 8, 8))]
    refused = CannotResume("another schedule")
    assert Batched(refused).run_many(group) == [refused, refused]
    with pytest.raises(RuntimeError, match="out of memory"):
        Batched(RuntimeError("out of memory")).run_many(group)


# --- the adapter files a request's steps use ------------------------------------------------------------

STYLED = msgspec.structs.replace(CASES["flux"][1], loras=(LoraWeight("style", 1.0),))


class StyleCatalogue:
    """A --lora-catalog file naming adapter `style`, which `point` sends to another tiny adapter's
    folder (the processes re-read it at their next request), and the pipelines that read it."""

    def __init__(self, tiny_models: dict[str, Path], tiny_loras: dict[str, Path], folder: Path):
        self.model, self.loras, self.path = str(tiny_models["tiny-flux"]), tiny_loras, folder / "loras.txt"

    def point(self, adapter: str) -> None:
        self.path.write_text(f"style={self.loras[adapter]}\n")

    def source(self, adapter: str) -> str:
        return str(self.loras[adapter])

    def role(self, role: Role, adapter: str | None = None) -> RolePipeline:
        """`role` reading the file, or a catalogue of its own naming `adapter` (another denoiser's)."""
        own = None if adapter is None else {"style": self.source(adapter)}
        catalogue = LoraCatalog(own, path=None if own else str(self.path))
        return load_role_pipeline(self.model, role, "cpu", 0, catalogue, 1 << 30)


@pytest.fixture
def style(tiny_models, tiny_loras, tmp_path) -> StyleCatalogue:  # type: ignore[no-untyped-def]
    catalogue = StyleCatalogue(tiny_models, tiny_loras, tmp_path)
    catalogue.point("flux-ink")
    return catalogue


def _stopping_at(batch: StageBatch, step: int) -> StageBatch:
    """`batch`, asked to hand off at the boundary before `step`."""
    progress: list[int] = []
    batch.on_progress = lambda at, total, latents=None: progress.append(at)
    batch.hand_off = lambda: len(progress) == step
    return batch


def test_a_continuation_resumes_only_with_the_adapter_file_its_earlier_steps_used(style: StyleCatalogue) -> None:
    """Suspended at step 3 with `style` = ink, a request resumes into the latents of one that never
    stopped where the catalogue still gives ink; where it gives paper now (re-read meanwhile, or another
    denoiser's in a rolling update) it is refused, naming the adapter. It used to run its last steps
    with paper: the latents of neither file."""
    encoded = style.role(Role.ENCODER).run(StageBatch(STYLED))
    unmoved = style.role(Role.DENOISER, "flux-ink").run(over_the_wire(encoded)).tensors["latents"]
    denoiser = style.role(Role.DENOISER)
    suspended = over_the_wire(denoiser.run(_stopping_at(over_the_wire(encoded), 3)))
    assert suspended.meta[RESUME]["step"] == 3
    assert suspended.meta[RESUME][ADAPTERS] == {"style": style.source("flux-ink")}
    style.point("flux-paper")
    for paper in (denoiser, style.role(Role.DENOISER, "flux-paper")):  # in place, and moved
        with pytest.raises(CannotResume, match=r"^adapter 'style': its earlier steps used '.*flux-ink', .*flux-paper"):
            paper.run(over_the_wire(suspended))
    assert torch.equal(style.role(Role.DENOISER, "flux-ink").run(suspended).tensors["latents"], unmoved)


def test_the_members_that_stay_when_one_leaves_the_group_keep_their_adapter_file(style: StyleCatalogue) -> None:
    """A group of two with `style` = ink, one asked to leave at step 3 while the catalogue is pointed at
    paper: the other runs its last steps with ink, as if the catalogue had not changed. It used to go on
    with paper (run_merged runs the stage again for those that stay, which read the catalogue anew)."""
    encoded = [style.role(Role.ENCODER).run(StageBatch(msgspec.structs.replace(STYLED, seed=s))) for s in (1, 2)]

    def stayer_when_the_catalogue_goes_to(adapter: str) -> torch.Tensor:
        style.point("flux-ink")
        denoiser, group = style.role(Role.DENOISER), [over_the_wire(b) for b in encoded]
        _stopping_at(group[1], 3).leave = lambda: style.point(adapter)
        with torch.no_grad():
            for stage in denoiser.stages:
                assert stage.run_many(group) == [None, None]
        assert group[1].meta[RESUME]["step"] == 3 and RESUME not in group[0].meta
        return group[0].tensors["latents"]

    assert torch.equal(stayer_when_the_catalogue_goes_to("flux-paper"), stayer_when_the_catalogue_goes_to("flux-ink"))


def test_a_continuation_from_a_denoiser_that_records_no_adapter_files_resumes_with_this_ones() -> None:
    # An older release's denoiser, mid rolling update, sends no record: refusing it would fail every
    # request with adapters that its draining denoisers hand over.
    check_adapter_sources({RESUME: {"step": 1}}, {"style": "/adapters/ink"})


@pytest.mark.parametrize(
    "recorded",
    [["style"], {"style": 1}, {f"a{i}": "/x" for i in range(5)}],
    ids=["a list", "a source not a string", "more adapters than a request has"],
)
def test_a_malformed_record_of_adapter_files_is_refused_naming_it(recorded: Any) -> None:
    with pytest.raises(CannotResume, match=r"^meta\.resume\.loras must map .* adapter names to sources.*malformed"):
        check_adapter_sources({RESUME: {"step": 1, ADAPTERS: recorded}}, {})
