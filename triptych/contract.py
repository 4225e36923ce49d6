"""The request contract: every parameter a client may send, declared once.

Each `RequestParam` says its name, type, default, the endpoints that take it, its limits (and how
the served model family narrows them), its docs text, its CLI flag and whether the playground's
form shows it. Everything else is built from `CONTRACT` or checked against it:

    head/triptych_head/api/schemas.py   the pydantic request models, hence the OpenAPI schema
    head/triptych_head/api/context.py   the one validation, at the head's door, with the family's limits
    GET /v1/contract                    the playground's form (limits resolved for the served model)
    triptych/client_cli.py              the options of `triptych generate / edit / video`
    triptych/families                   FamilyRules.validate: the same checks on a GenerationParams

Adding a parameter is one `RequestParam` here plus its use in the stages: a parameter whose
`fields` name a GenerationParams field reaches the workers with no other edit.

Pure Python (no pydantic, no torch): the head, the workers and the CLI all import it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from triptych import lora, priority, step_cache
from triptych.guidance import unguided_negative

IMAGES = "/v1/images/generations"
EDITS = "/v1/images/edits"
VIDEOS = "/v1/videos"
ENDPOINTS = (IMAGES, EDITS, VIDEOS)
IMAGE_ENDPOINTS = frozenset({IMAGES, EDITS})
ALL = frozenset(ENDPOINTS)

MIN_SIDE = 16
NARROWED_CACHE = 64  # served models whose limits Contract keeps (a head has one; tests make many)
MAX_SIDE = 4096  # a guard against requests no deployment should attempt; the family narrows it
MAX_SEED = 2**63 - 1
MAX_TEXT = 20_000
MAX_NAME = 256  # model, user, quality, style: names, not text (a client's 5 MB one is refused, not echoed)
MAX_FRAMES = 1025
MIN_DEADLINE_S = 0.001
MAX_DEADLINE_S = 366 * 86400  # any deadline is capped at the request timeout; this only keeps it a sane number
PNG = "png"
IMAGE_FORMATS = (PNG, "jpeg", "webp")  # output_format: how an image answer's files are written
DEFAULT_QUALITY = 100  # output_compression omitted, as OpenAI's API takes it
# OpenAI's parameters this API does not take, and what to give instead: a client sending one is told so
# (a 400 naming it), never served something other than it asked for.
NOT_TAKEN = {
    "input_reference": "videos are made from text only here; for an image edit, POST /v1/images/edits",
    "mask": "an edit changes the whole image as the prompt says (FLUX.1 Kontext); no mask is taken",
    "input_fidelity": "leave it out: an edit keeps the reference as the model does",
    "background": "leave it out: images are opaque",
    "moderation": "leave it out: no moderation step runs here",
    "partial_images": "for images during generation, give stream: true and preview_every",
}


class ParamError(ValueError):
    """A request parameter the contract refuses; `param` is the parameter a client should fix."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ModelTraits(Protocol):
    """What a family's limits depend on: FamilyRules (from the package's configs) and ModelInfo
    (what the head knows of the served model) both have it."""

    @property
    def pipeline_class(self) -> str: ...
    @property
    def kind(self) -> str: ...  # "image" or "video"
    @property
    def size_multiple(self) -> int: ...
    @property
    def max_steps(self) -> int: ...
    @property
    def frame_step(self) -> int: ...  # videos have 1 + k * frame_step frames
    @property
    def max_side(self) -> int: ...  # the widest and tallest it makes, in pixels (e.g. its positional table)
    @property
    def max_frames(self) -> int: ...  # the most frames a video may have
    @property
    def negative_prompt(self) -> bool: ...  # takes a negative prompt (classifier-free guidance)
    @property
    def edits(self) -> bool: ...  # takes a reference image
    @property
    def step_cache_modes(self) -> tuple[str, ...]: ...  # the step cache modes (triptych.step_cache) it serves


@dataclass(frozen=True)
class Limits:
    """What values a parameter takes. Numbers: `minimum`..`maximum`, and with `step` only
    `offset + k * step`. `unsupported`: the reason the family takes no value at all.

    Messages are templates over: field, value, minimum, maximum, step, below and above (the valid
    values nearest `value`, within minimum..maximum), nearest (those of them other than `value`,
    "A or B"), pipeline and kind.
    """

    minimum: float | None = None
    maximum: float | None = None
    step: int | None = None
    offset: int = 0
    min_length: int | None = None
    max_length: int | None = None
    choices: tuple[str, ...] | None = None
    unsupported: str | None = None
    message: str | None = None  # a number out of range (default: "... must be between ...")
    step_message: str | None = None  # a number between the steps (default: "... must be offset + a multiple ...")

    def narrowed(self, other: Limits) -> Limits:
        """These limits and `other`'s together (a family narrows the contract's)."""
        lo = [v for v in (self.minimum, other.minimum) if v is not None]
        hi = [v for v in (self.maximum, other.maximum) if v is not None]
        merged = replace(
            self,
            minimum=max(lo) if lo else None,
            maximum=min(hi) if hi else None,
            step=other.step or self.step,
            offset=other.offset if other.step else self.offset,
            unsupported=other.unsupported or self.unsupported,
            message=other.message or self.message,
            step_message=other.step_message or self.step_message,
            choices=tuple(c for c in self.choices if c in other.choices)
            if self.choices is not None and other.choices is not None
            else other.choices or self.choices,
        )
        if merged.step and merged.minimum is not None and merged.maximum is not None:
            # Whole steps at both ends, so a form's min/step (HTML counts steps from min) stays valid.
            s, o = merged.step, merged.offset
            merged = replace(
                merged,
                minimum=o + math.ceil((merged.minimum - o) / s) * s,
                maximum=o + math.floor((merged.maximum - o) / s) * s,
            )
        return merged

    @property
    def refuses(self) -> bool:
        """Whether check() can refuse a value (lengths are the HTTP models', schemas.py)."""
        bounds = (self.unsupported, self.choices, self.minimum, self.maximum, self.step)
        return any(b is not None for b in bounds)

    def check(self, name: str, value: Any, traits: ModelTraits | None = None) -> str | None:
        """Why `value` (of the field `name`) is refused, or None when it is taken."""
        if self.unsupported is not None:
            if value is None or value == "":
                return None
            pipeline, kind = _words(traits)
            return self.unsupported.format(field=name, value=value, pipeline=pipeline, kind=kind)
        if isinstance(value, str) and self.choices is not None and value not in self.choices:
            # The HTTP models take the contract's choices (schemas.py); a family may take fewer.
            pipeline = _words(traits)[0]
            return f"{name} {value!r} is not available for {pipeline}: choose one of {', '.join(self.choices)}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None  # other strings are the HTTP models' (schemas.py)
        lo, hi = self.minimum, self.maximum
        s, o = self.step, self.offset
        in_range = (lo is None or value >= lo) and (hi is None or value <= hi)  # False for nan
        if in_range and not (s and (value - o) % s):
            return None  # taken: the message's words are worked out only for a value refused
        if not math.isfinite(value):  # nan or infinity: no nearest valid value to suggest
            return f"{name} {value} must be a finite number"
        pipeline, kind = _words(traits)
        below = above = value
        if s:
            below = o + math.floor((value - o) / s) * s
            above = below if below == value else below + s
        # Suggestions a client can send: within the limits (narrowed() made both ends whole steps).
        below, above = _within(below, lo, hi), _within(above, lo, hi)
        nearest = " or ".join(str(_num(v)) for v in dict.fromkeys((below, above)) if v != value)
        words = {
            "field": name, "value": value, "minimum": _num(lo), "maximum": _num(hi), "step": s,
            "below": _num(below), "above": _num(above), "nearest": nearest, "pipeline": pipeline, "kind": kind,
        }  # fmt: skip
        if not in_range:
            if lo == hi:
                default = "{field} {value} must be {minimum}"
            elif hi is None:
                default = "{field} {value} must be at least {minimum}"
            elif lo is None:
                default = "{field} {value} must be at most {maximum}"
            else:
                default = "{field} {value} must be between {minimum} and {maximum}"
            return (self.message or default).format(**words)
        if s and (value - o) % s:
            return (self.step_message or "{field} {value} must be {offset} + a multiple of {step}").format(
                **words, offset=o
            )
        return None


def _words(traits: ModelTraits | None) -> tuple[str, str]:
    """The pipeline and kind a message names."""
    return (traits.pipeline_class, traits.kind) if traits is not None else ("this model", "image")


def _within(v: float, lo: float | None, hi: float | None) -> float:
    return min(max(v, lo if lo is not None else v), hi if hi is not None else v)


def _num(v: float | None) -> float | int | None:
    return int(v) if isinstance(v, float) and v.is_integer() else v


FamilyLimits = Callable[[ModelTraits], Limits]
Check = tuple[str, str, Limits]  # a parameter's name, a field it sets, and the limits of its values


@dataclass(frozen=True)
class RequestParam:
    """One request parameter, declared once."""

    name: str
    type: type  # str, int, float or bool; list: a list of LoRA adapters (schemas.py builds its items)
    doc: str
    endpoints: frozenset[str]
    default: Any = None  # None: optional; the server (or the model) chooses
    defaults: Mapping[str, Any] = field(default_factory=dict)  # an endpoint's own default
    required: bool = False
    limits: Limits = Limits()
    family: FamilyLimits | None = None  # how the served model family narrows `limits`
    fields: tuple[str, ...] | None = None  # the GenerationParams fields it sets; None: (name,); (): the head's own
    cli: str | None = None  # the `triptych generate / edit / video` option; None: not on the command line
    form: bool = False  # the playground's form shows it
    accepted_only: bool = False  # taken for OpenAI compatibility, changes nothing

    @property
    def sets(self) -> tuple[str, ...]:
        return (self.name,) if self.fields is None else self.fields

    def default_for(self, endpoint: str) -> Any:
        return self.defaults.get(endpoint, self.default)

    def limits_for(self, traits: ModelTraits | None) -> Limits:
        """The limits for the served model (the contract's own when there is none)."""
        if traits is None or self.family is None:
            return self.limits
        return self.limits.narrowed(self.family(traits))


@dataclass(frozen=True)
class Contract:
    params: tuple[RequestParam, ...]
    # Each parameter's limits per served model, worked out once: a head checks every request against them.
    _narrowed: dict[Any, tuple[Check, ...]] = field(default_factory=dict, compare=False, hash=False, repr=False)
    _taken: dict[str, tuple[RequestParam, ...]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __iter__(self) -> Iterator[RequestParam]:
        return iter(self.params)

    def __getitem__(self, name: str) -> RequestParam:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def taken_by(self, endpoint: str) -> tuple[RequestParam, ...]:
        taken = self._taken.get(endpoint)
        if taken is None:
            taken = self._taken[endpoint] = tuple(p for p in self.params if endpoint in p.endpoints)
        return taken

    def with_param(self, param: RequestParam) -> Contract:
        """This contract with `param` added, or replacing the one of its name."""
        return Contract((*(p for p in self.params if p.name != param.name), param))

    def check(self, values: Mapping[str, Any], traits: ModelTraits | None) -> None:
        """Raise ParamError, naming the parameter, for the first value the served model cannot take
        (then for a step cache knob the request's mode does not take).

        `values` are keyed by field: GenerationParams' fields, and the head's own parameters by name.
        """
        for param, name, limits in self._checks(traits):
            value = values.get(name)
            if value is not None:
                why = limits.check(name, value, traits)
                if why is not None:
                    raise ParamError(param, why)
        knob = step_cache.check_knobs(values)
        if knob is not None:
            raise ParamError(*knob)
        why = lora.check_request(values.get(lora.FIELD) or ())
        if why is not None:
            raise ParamError(lora.FIELD, why)
        why = unguided_negative(values)
        if why is not None:
            raise ParamError("negative_prompt", why)

    def _checks(self, traits: ModelTraits | None) -> tuple[Check, ...]:
        """What check() looks at for `traits`: each field a parameter sets (its name for the head's
        own), with limits that can refuse a value. Cached for hashable traits, such as ModelInfo."""
        try:
            cached = self._narrowed.get(traits)
        except TypeError:  # unhashable traits: worked out each time
            return self._work_out_checks(traits)
        if cached is None:
            if len(self._narrowed) >= NARROWED_CACHE:
                self._narrowed.clear()
            cached = self._narrowed[traits] = self._work_out_checks(traits)
        return cached

    def _work_out_checks(self, traits: ModelTraits | None) -> tuple[Check, ...]:
        narrowed = ((p, p.limits_for(traits)) for p in self.params)
        return tuple((p.name, name, lim) for p, lim in narrowed if lim.refuses for name in p.sets or (p.name,))

    def describe(self, endpoint: str, traits: ModelTraits | None) -> dict[str, dict[str, Any]]:
        """The parameters `endpoint` takes with the served model's limits, as JSON (the playground's form)."""
        out: dict[str, dict[str, Any]] = {}
        for p in self.taken_by(endpoint):
            lim = p.limits_for(traits)
            entry = {
                "type": p.type.__name__, "default": p.default_for(endpoint), "required": p.required,
                "doc": p.doc, "form": p.form, "minimum": _num(lim.minimum), "maximum": _num(lim.maximum),
                "step": lim.step, "min_length": lim.min_length, "max_length": lim.max_length,
                "choices": list(lim.choices) if lim.choices else None,
                "supported": lim.unsupported is None,
            }  # fmt: skip
            out[p.name] = {k: v for k, v in entry.items() if v is not None}
        return out


def _sides(t: ModelTraits) -> Limits:
    m = t.size_multiple
    return Limits(
        minimum=m,
        maximum=t.max_side,
        step=m,
        message="{field} {value} is out of range: this model makes {minimum}..{maximum} pixels",
        step_message="{field} {value} is not a multiple of {step}, which this model needs "
        "(VAE downsampling x transformer patch); try {below}",
    )


def _frames(t: ModelTraits) -> Limits:
    if t.kind != "video" or t.frame_step < 1:
        return Limits(minimum=1, maximum=1, message="{field} {value} must be 1: {pipeline} makes images")
    text = (
        "{field} {value} is invalid: {pipeline} needs 1 + a multiple of {step} frames, at most {maximum} "
        "(e.g. {nearest})"
    )
    return Limits(maximum=t.max_frames, step=t.frame_step, offset=1, message=text, step_message=text)


NO_CFG = (
    "negative_prompt is not supported by {pipeline}: it uses embedded guidance (guidance_scale), "
    "not classifier-free guidance; leave negative_prompt empty"
)
COMPATIBILITY = "Accepted for OpenAI client compatibility; changes nothing"
NAMED = Limits(max_length=MAX_NAME)
TEXT_ONLY = "image: {pipeline} makes {kind}s from text only; it takes no image"

CONTRACT = Contract(
    (
        RequestParam(
            "model",
            str,
            "Served model id (optional; there is one per deployment)",
            ALL,
            limits=NAMED,
            fields=(),
        ),
        RequestParam(
            "prompt",
            str,
            "What to make",
            ALL,
            required=True,
            limits=Limits(min_length=1, max_length=MAX_TEXT),
            form=True,
        ),
        RequestParam(
            "negative_prompt",
            str,
            "What to steer away from (models with classifier-free guidance)",
            ALL,
            limits=Limits(max_length=MAX_TEXT),
            family=lambda t: Limits(unsupported=None if t.negative_prompt else NO_CFG),
            cli="--negative-prompt",
            form=True,
        ),
        RequestParam(
            "size",
            str,
            "WIDTHxHEIGHT in pixels, each a multiple of the model's size multiple (edits: the reference's size)",
            ALL,
            defaults={IMAGES: "1024x1024", EDITS: None, VIDEOS: "832x480"},
            limits=Limits(minimum=MIN_SIDE, maximum=MAX_SIDE),
            family=_sides,
            fields=("width", "height"),
            cli="--size",
            form=True,
        ),
        RequestParam(
            "seed",
            int,
            "Same seed, same pixels (omitted: a random one)",
            ALL,
            limits=Limits(minimum=0, maximum=MAX_SEED),
            cli="--seed",
            form=True,
        ),
        RequestParam(
            "num_inference_steps",
            int,
            "Denoising steps (omitted: the model's default)",
            ALL,
            limits=Limits(minimum=1, maximum=500),
            family=lambda t: Limits(maximum=t.max_steps),
            cli="--steps",
            form=True,
        ),
        RequestParam(
            "guidance_scale",
            float,
            "How closely to follow the prompt (omitted: the model's default)",
            ALL,
            limits=Limits(minimum=0, maximum=100),
            cli="--guidance",
        ),
        RequestParam(
            "preview_every",
            int,
            "Progress events carry a low-resolution preview every k denoising steps (0: none)",
            ALL,
            default=0,
            limits=Limits(minimum=0, maximum=500),
            fields=(),
            form=True,
        ),
        RequestParam(
            "deadline_seconds",
            float,
            "Seconds from now by which the result is wanted (omitted, or later than the request timeout: the "
            "timeout); a request the head estimates would miss it gets 429 deadline_unachievable at once",
            ALL,
            limits=Limits(minimum=MIN_DEADLINE_S, maximum=MAX_DEADLINE_S),
            fields=(),
            cli="--deadline",
        ),
        RequestParam(
            priority.FIELD,
            str,
            "How urgent: low, normal or high. Higher levels are dispatched first and may suspend a lower one's "
            "denoising at a step boundary; an API key may cap the level (docs/serving.md#priority-and-preemption)",
            ALL,
            default=priority.DEFAULT,
            limits=Limits(choices=priority.LEVELS),
            fields=(),
            cli="--priority",
        ),
        RequestParam(
            "n",
            int,
            "How many images to make",
            IMAGE_ENDPOINTS,
            default=1,
            limits=Limits(minimum=1, maximum=8),
            fields=("num_outputs",),
            cli="--n",
        ),
        RequestParam(
            "response_format",
            str,
            "b64_json: the images in the answer; url: links to them",
            IMAGE_ENDPOINTS,
            default="b64_json",
            limits=Limits(choices=("b64_json", "url")),
            fields=(),
        ),
        RequestParam(
            "output_format",
            str,
            "How the images are written: png (lossless), jpeg or webp (smaller, at output_compression)",
            IMAGE_ENDPOINTS,
            default=PNG,
            limits=Limits(choices=IMAGE_FORMATS),
            fields=(),
            cli="--output-format",
        ),
        RequestParam(
            "output_compression",
            int,
            f"jpeg and webp: their quality, 0 (smallest) to 100 (best; omitted: {DEFAULT_QUALITY})",
            IMAGE_ENDPOINTS,
            limits=Limits(minimum=0, maximum=100),
            fields=(),
            cli="--output-compression",
        ),
        RequestParam(
            "stream",
            bool,
            "Answer with Server-Sent Events: progress, previews, then the result",
            IMAGE_ENDPOINTS,
            default=False,
            fields=(),
        ),
        RequestParam(
            "image",
            str,
            "The reference image: a file part, or an http(s) URL (the image encoder fetches it; the head does "
            "when no size is given, to keep the reference's size)",
            frozenset({EDITS}),
            required=True,
            limits=Limits(max_length=4096),
            fields=("image", "image_url"),
            family=lambda t: Limits(unsupported=None if t.edits else TEXT_ONLY),
        ),
        RequestParam(
            "num_frames",
            int,
            "Frames of the video",
            frozenset({VIDEOS}),
            default=81,
            limits=Limits(minimum=1, maximum=MAX_FRAMES),
            family=_frames,
            cli="--frames",
            form=True,
        ),
        RequestParam(
            "seconds",
            float,
            "How long the video lasts, as OpenAI's API takes it (a number, or its text as OpenAI's SDK sends it); "
            "made into the num_frames nearest seconds x fps that the model takes (4 at 16 fps: 65); give it or "
            "num_frames",
            frozenset({VIDEOS}),
            limits=Limits(minimum=0.001, maximum=MAX_FRAMES),  # the model narrows it through num_frames
            fields=(),
            cli="--seconds",
        ),
        RequestParam(
            "fps",
            int,
            "Frames per second of the MP4",
            frozenset({VIDEOS}),
            default=16,
            limits=Limits(minimum=1, maximum=120),
            fields=(),
            cli="--fps",
        ),
        RequestParam(
            # Not taken by any endpoint yet: every request gets the stock default; workers still check it.
            "max_sequence_length",
            int,
            "Prompt tokens the text encoders see",
            frozenset(),
            default=512,
            limits=Limits(minimum=1, maximum=512),
        ),
        RequestParam(
            "step_cache",
            str,
            "Reuse work of earlier denoising steps (faster, not the same pixels as none): "
            + "; ".join(f"{m.name} {m.doc}" for m in step_cache.MODES.values())
            + " (docs/serving.md#step-caching)",
            ALL,
            default=step_cache.NONE,
            limits=Limits(choices=step_cache.CHOICES),
            family=lambda t: Limits(choices=(step_cache.NONE, *t.step_cache_modes)),
            cli="--step-cache",
        ),
        RequestParam(
            step_cache.THRESHOLD,
            float,
            "step_cache first_block: the relative change of the first block's output below which the other "
            "blocks are skipped (omitted: 0.05; higher skips more)",
            ALL,
            limits=Limits(minimum=step_cache.MIN_THRESHOLD, maximum=step_cache.MAX_THRESHOLD),
            cli="--step-cache-threshold",
        ),
        RequestParam(
            step_cache.INTERVAL,
            int,
            "step_cache pyramid_attention_broadcast and taylorseer: compute in full once every N calls or steps "
            "(omitted: 2 and 5; higher skips more)",
            ALL,
            limits=Limits(minimum=step_cache.MIN_INTERVAL, maximum=step_cache.MAX_INTERVAL),
            cli="--step-cache-interval",
        ),
        RequestParam(
            lora.FIELD,
            list,
            f"LoRA adapters of this deployment to apply, at most {lora.MAX_ADAPTERS}, each "
            f'{{"name": NAME, "weight": W}} (weight {lora.MIN_WEIGHT:g}..{lora.MAX_WEIGHT:g}, default 1); '
            "the deployment's catalogue names them (docs/serving.md#lora-adapters)",
            ALL,
            limits=Limits(max_length=lora.MAX_ADAPTERS),
            cli="--lora",
        ),
        RequestParam("quality", str, COMPATIBILITY, IMAGE_ENDPOINTS, limits=NAMED, fields=(), accepted_only=True),
        RequestParam("style", str, COMPATIBILITY, frozenset({IMAGES}), limits=NAMED, fields=(), accepted_only=True),
        RequestParam("user", str, COMPATIBILITY, ALL, limits=NAMED, fields=(), accepted_only=True),
    )
)
"""The request contract Triptych serves."""
