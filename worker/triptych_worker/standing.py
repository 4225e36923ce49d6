"""Standing receive slots reserved at start-up, sized for a request at the API's defaults.

A receiver (image encoder, denoiser, decoder) that serves one head reserves its standing slots
(triptych.standing) before the first request, each the size of one default request's inputs for
its role (the tensors its upstream role hands on, from the family's shapes: a 1024x1024 image, an
832x480 81-frame video), and lists them in every heartbeat; the head assigns them without a
transfer_alloc round trip from the first request on. A request whose inputs do not fit one takes
the transfer_alloc path as before. Without the package's shapes (a test pipeline), none is reserved.
"""

from __future__ import annotations

import logging
from typing import Any

from triptych.contract import CONTRACT, IMAGES, VIDEOS
from triptych.families import family_of, read_rules
from triptych.params import GenerationParams
from triptych.roles import Role
from triptych.standing import room_for_standing
from triptych_worker.transfer import ALIGNMENT, Allocation, TransferPool
from triptych_worker.transfer.allocator import align_up

log = logging.getLogger(__name__)


def default_params(kind: str, default_steps: int = 4, default_guidance: float = 3.5) -> GenerationParams:
    """A request at the API's defaults for a model of `kind` ("image" or "video")."""
    endpoint = VIDEOS if kind == "video" else IMAGES
    width, height = (int(side) for side in CONTRACT["size"].default_for(endpoint).split("x"))
    frames = CONTRACT["num_frames"].default_for(endpoint) if kind == "video" else 1
    return GenerationParams(
        "", width, height, num_frames=frames, num_inference_steps=default_steps, guidance_scale=default_guidance
    )


def default_input_bytes(shapes: Any, role: Role, params: GenerationParams, dtype: str | None = None) -> int:
    """The slot bytes a request with `params` needs at `role`: its upstream's outputs (in `dtype`
    where the upstream computes in it; None: shapes that know one dtype only), laid out as staged
    (each tensor at an aligned offset)."""
    upstream = role.spec.receives_from
    assert upstream is not None, f"{role.value} receives no tensors"
    specs = shapes.output_specs(upstream, params) if dtype is None else shapes.output_specs(upstream, params, dtype)
    end = 0
    for spec in specs:
        end = align_up(end, ALIGNMENT) + spec.nbytes
    return end


def slot_size(pipeline: Any, model_path: str, role: Role, dtype: str = "float32") -> int:
    """The size of this receiver's start-up slots (0: it reserves none). The upstream is taken to
    compute in this receiver's `dtype`, as the roles of a pipeline usually do: inputs from an
    upstream in a wider dtype do not fit and take the transfer_alloc path."""
    if role.spec.receives_from is None:
        return 0
    shapes = getattr(pipeline, "shapes", None)  # simulated stages: the family's rules or a fixed payload
    try:
        rules = read_rules(model_path)
    except (OSError, ValueError) as exc:
        if shapes is None:
            log.info("no standing slots reserved at start-up: %s", exc)
            return 0
        params = default_params("image")  # a fixed payload's size does not depend on the request
    else:
        family = family_of(rules.package)
        params = default_params(family.kind, family.default_steps, family.default_guidance)
        if shapes is None:
            return default_input_bytes(rules, role, params, dtype)
    return default_input_bytes(shapes, role, params)


def reserve(pool: TransferPool, nbytes: int, capacity: int, held: int, owner: str) -> list[Allocation]:
    """New standing slots of `nbytes`, up to what the receiver (holding `held`) keeps."""
    slots: list[Allocation] = []
    while nbytes and room_for_standing(held + len(slots), capacity, pool.pool_bytes, nbytes):
        alloc = pool.allocate(nbytes, owner)
        if alloc is None:
            break
        slots.append(alloc)
    return slots
