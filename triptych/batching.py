"""Which requests may share one batched forward: the compatibility rule, in one place.

The head groups queued requests by `batch_key` (head/triptych_head/batcher.py) and a worker runs
only requests with equal keys as one batch (worker/triptych_worker/batching.py). Two requests are
compatible when every parameter that changes the tensors' shapes or the math of a batched stage is
the same (one head and its workers serve one model, so the model is the same already):

- size and length: height, width, num_frames (latent shapes, token counts, the schedule's shift);
- num_inference_steps and guidance_scale (the schedule, FLUX's guidance embedding, CFG's mix);
- negative prompt present or not (with CFG: whether the uncond branch runs on a given text);
- max_sequence_length (the text embeddings' length);
- num_outputs (rows per request: a batch is a whole number of requests of the same width);
- the step cache, its knob resolved (the denoiser applies one cache hook to the whole batch);
- the LoRA adapters, with their weights and order (the denoiser activates one set for the whole batch).

What may differ: prompt, negative prompt text and seed. Each request's initial noise is made from
its own seed alone (LatentPreparationStage runs per request), so it is what it would be alone.
Edits (a reference image) are never batched: the reference's size, known only once the image
encoder has decoded it, sets the number of its tokens; each one gets a key of its own.
"""

from __future__ import annotations

from typing import Any

from triptych.params import GenerationParams


def batch_key(params: GenerationParams, request_id: str = "") -> tuple[Any, ...]:
    """Requests with equal keys may run as one batch; `request_id` keeps an edit's key its own."""
    p = params
    if p.has_reference:
        return ("edit", request_id)
    return (
        p.height,
        p.width,
        p.num_frames,
        p.num_inference_steps,
        p.guidance_scale,
        p.negative_prompt is not None,
        p.max_sequence_length,
        p.num_outputs,
        p.resolved_step_cache,
        p.loras,
    )
