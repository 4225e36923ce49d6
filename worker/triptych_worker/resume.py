"""A denoising loop's state at a step boundary, so that another denoiser continues it
(docs/design.md, "Migration").

At the boundary before step `step`, a request's denoising state is its latents, the inputs the
loop reads (embeddings, ids, an edit's reference latents), the schedule and the scheduler's
state. The receiver rebuilds the schedule itself, exactly as the first denoiser did (set_timesteps
from the request and its meta), so what travels is only what the steps changed: the step index
and, for a multistep scheduler, its history. Tensors go through Mooncake with the inputs
(`scheduler.*`), scalars in meta under RESUME. Each known scheduler class is captured explicitly;
any other is refused, naming it, rather than resumed into different pixels. So is a continuation
whose earlier steps used other LoRA adapter files than this denoiser's catalogue gives now (the
denoising stage records and checks them, `check_adapter_sources`): every step of a request uses the
files its first step did.

torch is imported inside functions so that the module loads without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from triptych.lora import MAX_ADAPTERS

if TYPE_CHECKING:
    import torch

    from triptych_worker.stages import StageBatch

RESUME = "resume"
"""The meta key of a continuation: {"step": the next step to run, "scheduler": its scalars, and for a
request naming LoRA adapters "loras": name -> the source its steps so far used (`ADAPTERS`)}."""
ADAPTERS = "loras"
"""Under RESUME: the adapter sources (triptych.lora catalogue entries) the earlier steps used."""
TENSOR_PREFIX = "scheduler."
"""Names of the scheduler's history tensors among a continuation's tensors."""


class CannotResume(ValueError):
    """The scheduler's state cannot be captured or restored exactly."""


def step_of(meta: dict[str, Any]) -> int | None:
    """The step a continuation's meta resumes at (None: not a continuation; -1: a malformed one,
    which `check_continuation` fails). Never raises: the queue groups jobs by it before any of them runs."""
    resume = meta.get(RESUME)
    if resume is None:
        return None
    step = resume.get("step") if isinstance(resume, dict) else None
    return step if type(step) is int and step >= 0 else -1


MALFORMED = "the sending denoiser's continuation is malformed"


def check_continuation(meta: dict[str, Any]) -> None:
    """Refuse a continuation whose meta does not say where it resumes (another worker's message:
    it fails its own request, naming what is wrong, and nothing else)."""
    if step_of(meta) == -1:
        raise CannotResume(
            f"meta.{RESUME} must be a map with a non-negative integer 'step', got {meta[RESUME]!r:.200}; {MALFORMED}"
        )


def adapter_sources(meta: dict[str, Any]) -> dict[str, str] | None:
    """The adapter sources a continuation's earlier steps used, name -> source ({}: none; None: a
    malformed record, which `check_adapter_sources` refuses). Never raises: the queue groups jobs by
    it before any of them runs."""
    resume = meta.get(RESUME)
    recorded = resume.get(ADAPTERS, {}) if isinstance(resume, dict) else {}
    if not isinstance(recorded, dict) or len(recorded) > MAX_ADAPTERS:
        return None
    if not all(isinstance(name, str) and isinstance(source, str) for name, source in recorded.items()):
        return None
    return dict(recorded)


def check_adapter_sources(meta: dict[str, Any], sources: dict[str, str]) -> None:
    """Refuse a continuation whose earlier steps used other adapter files than `sources` (what this
    denoiser's catalogue gives now for the request's adapters): its later steps would use the new
    files, and the pixels would be those of neither. A continuation with no record at all comes from a
    denoiser that kept none (an older release, mid rolling update: where its requests migrate most):
    it resumes with this denoiser's files, as every continuation did before the record."""
    if isinstance(meta.get(RESUME), dict) and ADAPTERS not in meta[RESUME]:
        return
    recorded = adapter_sources(meta)
    if recorded is None:
        raise CannotResume(
            f"meta.{RESUME}.{ADAPTERS} must map at most {MAX_ADAPTERS} adapter names to sources, got "
            f"{meta[RESUME].get(ADAPTERS)!r:.200}; {MALFORMED}"
        )
    differ = sorted(name for name in {*recorded, *sources} if recorded.get(name) != sources.get(name))
    if differ:
        said = "; ".join(
            f"adapter {name!r:.70}: its earlier steps used {recorded.get(name)!r:.200}, this denoiser's "
            f"catalogue gives {sources.get(name)!r:.200}"
            for name in differ
        )
        raise CannotResume(
            f"{said}; a continuation resumes only with the adapter files it started with (the catalogue "
            "changed while the request was suspended or moving, or the denoisers' catalogues differ): "
            "send the request again"
        )


def _flow_match_capture(scheduler: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if scheduler.config.get("stochastic_sampling"):
        raise CannotResume("FlowMatchEulerDiscreteScheduler with stochastic_sampling draws noise at every step")
    return {}, {}


def _flow_match_restore(scheduler: Any, scalars: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Nothing but the step index (set by the caller): sigmas depend on the schedule alone."""


def _unipc_capture(scheduler: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if scheduler.config.get("solver_p") is not None:
        raise CannotResume("UniPCMultistepScheduler with a solver_p scheduler (its state is not captured)")
    tensors = {f"{TENSOR_PREFIX}model_outputs.{i}": t for i, t in enumerate(scheduler.model_outputs) if t is not None}
    if scheduler.last_sample is not None:
        tensors[f"{TENSOR_PREFIX}last_sample"] = scheduler.last_sample
    scalars = {
        "model_outputs": [t is not None for t in scheduler.model_outputs],
        "timestep_list": [None if t is None else int(t) for t in scheduler.timestep_list],
        "lower_order_nums": int(scheduler.lower_order_nums),
        "this_order": getattr(scheduler, "this_order", None),  # set by the first step
    }
    return scalars, tensors


def _unipc_restore(scheduler: Any, scalars: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Checked whole before any of it is set: a continuation refused leaves the scheduler as it was."""
    import torch

    timesteps = scheduler.timesteps
    held, listed = scalars["model_outputs"], scalars["timestep_list"]
    order = int(scheduler.config.solver_order)
    if not (isinstance(held, list) and isinstance(listed, list) and len(held) == len(listed) == order):
        raise ValueError(f"a history of {order} steps (this scheduler's solver_order) was expected")
    model_outputs = [tensors[f"{TENSOR_PREFIX}model_outputs.{i}"] if h else None for i, h in enumerate(held)]
    # The loop passes 0-d tensors of scheduler.timesteps to step(), which keeps them here.
    timestep_list = [
        None if t is None else torch.tensor(t, dtype=timesteps.dtype, device=timesteps.device) for t in listed
    ]
    lower_order_nums, this_order = int(scalars["lower_order_nums"]), scalars["this_order"]
    if not 0 <= lower_order_nums <= order or not (this_order is None or 1 <= int(this_order) <= order):
        raise ValueError(f"lower_order_nums {lower_order_nums} / this_order {this_order} past solver_order {order}")
    scheduler.model_outputs, scheduler.timestep_list = model_outputs, timestep_list
    scheduler.last_sample = tensors.get(f"{TENSOR_PREFIX}last_sample")
    scheduler.lower_order_nums = lower_order_nums
    if this_order is not None:
        scheduler.this_order = int(this_order)


Capture = Callable[[Any], tuple[dict[str, Any], dict[str, "torch.Tensor"]]]
Restore = Callable[[Any, dict[str, Any], dict[str, "torch.Tensor"]], None]

SCHEDULERS: dict[str, tuple[Capture, Restore]] = {
    "FlowMatchEulerDiscreteScheduler": (_flow_match_capture, _flow_match_restore),
    "UniPCMultistepScheduler": (_unipc_capture, _unipc_restore),
}
"""Scheduler class name -> how to capture and restore what its steps change."""


def _handlers(scheduler: Any) -> tuple[Capture, Restore]:
    name = type(scheduler).__name__
    if name not in SCHEDULERS:
        known = ", ".join(sorted(SCHEDULERS))
        raise CannotResume(f"{name}: its state at a step boundary is not known to Triptych (known: {known})")
    return SCHEDULERS[name]


def capture(scheduler: Any, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The scheduler's state before step `step` (0-based): (meta under RESUME, history tensors)."""
    scalars, tensors = _handlers(scheduler)[0](scheduler)
    timestep = float(scheduler.timesteps[step])
    resume = {
        "step": step,
        "scheduler": {"class": type(scheduler).__name__, "begin_index": 0, "timestep": timestep, **scalars},
    }
    return resume, tensors


def restore(scheduler: Any, resume: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """Put `resume` (and the history in `tensors`) into `scheduler`, whose schedule set_timesteps has
    rebuilt as the capturing denoiser's was; returns the step to run next. CannotResume, naming what
    is wrong, for a state this scheduler cannot take: another class or schedule, or one malformed."""
    try:
        scalars, step = resume["scheduler"], int(resume["step"])
        captured, timestep, begin = scalars["class"], float(scalars["timestep"]), int(scalars["begin_index"])
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(inf)
        raise CannotResume(f"meta.{RESUME}.scheduler is malformed ({exc!r:.200}); {MALFORMED}") from None
    if begin != 0:  # capture writes 0: a schedule from its start
        raise CannotResume(f"meta.{RESUME}.scheduler.begin_index {begin} is not 0; {MALFORMED}")
    if captured != type(scheduler).__name__:
        raise CannotResume(f"the request was captured from a {captured!s:.100}, this denoiser runs a "
                           f"{type(scheduler).__name__}; run every denoiser from the same model package")  # fmt: skip
    if not 0 <= step < len(scheduler.timesteps):
        raise CannotResume(f"meta.{RESUME}.step {step} is not a step of this {len(scheduler.timesteps)}-step "
                           f"schedule; {MALFORMED}")  # fmt: skip
    if float(scheduler.timesteps[step]) != timestep:
        raise CannotResume(f"step {step}: this denoiser's schedule differs from the one the request was captured "
                           "with; run every denoiser from the same model package")  # fmt: skip
    try:
        _handlers(scheduler)[1](scheduler, scalars, tensors)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
        raise CannotResume(f"meta.{RESUME}.scheduler is malformed ({exc!r:.200}); {MALFORMED}") from None
    scheduler.set_begin_index(begin)
    scheduler._step_index = step  # step() initialises it only when None
    return step


def start(scheduler: Any, batch: StageBatch, tensors: dict[str, torch.Tensor]) -> int:
    """Where a denoising loop starts: step 0 of a fresh schedule, or where a continuation stopped
    (its scheduler restored from `tensors`, the batch's inputs on the device). The batch is no
    continuation any more: its outputs are the next role's, unless it is suspended again."""
    resume = batch.meta.pop(RESUME, None)
    if resume is None:
        scheduler.set_begin_index(0)
        if hasattr(scheduler, "timestep_list"):  # UniPC: set_timesteps resets its history but this list,
            # which a continuation restored here replaces: a fresh schedule starts as a new scheduler does
            scheduler.timestep_list = [None] * scheduler.config.solver_order
        return 0
    return restore(scheduler, resume, tensors)


def suspend(scheduler: Any, batch: StageBatch, step: int, latents: torch.Tensor) -> None:
    """Stop the loop before step `step`: the batch's outputs become a continuation, its inputs
    (without the history it came with), the latents now and the scheduler's state."""
    resume, history = capture(scheduler, step)
    inputs = {name: t for name, t in batch.tensors.items() if not name.startswith(TENSOR_PREFIX)}
    batch.tensors = {**inputs, "latents": latents, **history}
    batch.meta[RESUME] = resume
