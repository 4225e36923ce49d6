"""How much device time a request still needs from each role: the autoscaling signal.

Queue length is a poor signal for diffusion: one 81-frame video costs as much denoising as
hundreds of small images. The head instead estimates, per role, the device-seconds of work that
every accepted request still needs from that role, and exports the sum
(`triptych_role_pending_work_seconds`) for the HPA.

The estimate is `units(role, params) x seconds_per_unit(role)`:
- denoiser: outputs x megapixels x frames x steps (one DiT forward per step over every latent frame);
- decoder: outputs x megapixels x frames (one VAE decode of every frame);
- encoders: outputs (one prompt or reference image, whatever the size).

A request naming LoRA adapters that no ready denoiser holds adds, to the denoiser's estimate, one
adapter load per such adapter (the denoiser it goes to loads them): `lora_load_s` each, a prior
until the denoisers' heartbeats report how long their loads took.

`seconds_per_unit` starts at a prior (PRIOR_SECONDS_PER_UNIT); the first stage time a worker
reports for the role replaces it, and later ones (the workers' own seconds, not queueing) move an
exponentially weighted mean, so after a few requests it is this deployment's own hardware and model
(a report counts at most the time the head saw pass since it dispatched the hop: one figure beyond
that would set what admission refuses requests by, and none would come to correct it). A request
running now counts its estimate minus the time it has run (at least a tenth of it: a stage that
overruns its estimate is still work).
"""

from __future__ import annotations

from triptych.params import GenerationParams
from triptych.roles import ROLE_SPECS, Role

MEGAPIXEL = 1_000_000
SMOOTHING = 0.2  # weight of the newest observation in the running mean
MIN_REMAINING_FRACTION = 0.1

# Device-seconds per unit before anything was observed: orders of magnitude of a mid-size DiT
# (FLUX-class, one H100) so that the first requests already move the signal the right way.
PRIOR_SECONDS_PER_UNIT: dict[Role, float] = {role: spec.prior_seconds_per_unit for role, spec in ROLE_SPECS.items()}
# Seconds a denoiser takes to load one LoRA adapter before any reported it: a FLUX.1 adapter (tens of
# MiB) read from local disk and wrapped into the transformer's layers, copied to the GPU.
LORA_LOAD_PRIOR_S = 2.0


def lora_loads(params: GenerationParams, held: frozenset[str]) -> int:
    """The adapters a request names that no ready denoiser holds (`held`): the loads it will cost."""
    return len({lora.name for lora in params.loras} - held)


def work_units(role: Role, params: GenerationParams) -> float:
    """The size of a request's work for `role`, in that role's unit (see the module docstring)."""
    outputs = params.num_outputs
    if role is Role.DENOISER:
        return outputs * params.width * params.height / MEGAPIXEL * params.num_frames * params.num_inference_steps
    if role is Role.DECODER:
        return outputs * params.width * params.height / MEGAPIXEL * params.num_frames
    return float(outputs)


class WorkEstimator:
    """Seconds per unit of work for each role, calibrated from the stage times workers report."""

    def __init__(self, prior: dict[Role, float] | None = None):
        self._per_unit = dict(PRIOR_SECONDS_PER_UNIT if prior is None else prior)
        self._observed: set[Role] = set()
        self.lora_load_s = LORA_LOAD_PRIOR_S  # one adapter load on a denoiser (observe_lora_load)

    def seconds_per_unit(self, role: Role) -> float:
        return self._per_unit.get(role, 0.0)

    def calibrated(self, role: Role) -> bool:
        """Whether a worker has reported `role`'s stage time yet (False: the prior)."""
        return role in self._observed

    def estimate(self, role: Role, params: GenerationParams, loads: int = 0) -> float:
        """Device-seconds `role` needs for a request with these parameters; `loads`: LoRA adapters the
        denoiser must load for it first (lora_loads)."""
        extra = loads * self.lora_load_s if role is Role.DENOISER else 0.0
        return work_units(role, params) * self.seconds_per_unit(role) + extra

    def remaining(self, role: Role, params: GenerationParams, running_for: float | None, loads: int = 0) -> float:
        """What is left of the estimate; `running_for` is how long it has run on a worker (None: not started)."""
        total = self.estimate(role, params, loads)
        if running_for is None:
            return total
        return max(total - running_for, total * MIN_REMAINING_FRACTION)

    def observe(self, role: Role, params: GenerationParams, worker_seconds: float) -> None:
        """A worker finished `role`'s stages for a request in `worker_seconds` of its own time."""
        units = work_units(role, params)
        if units <= 0 or worker_seconds <= 0:
            return
        sample = worker_seconds / units
        if role in self._observed:
            sample = (1 - SMOOTHING) * self._per_unit[role] + SMOOTHING * sample
        self._per_unit[role] = sample
        self._observed.add(role)

    def observe_lora_load(self, seconds: float) -> None:
        """A denoiser's heartbeat: its adapter loads took `seconds` each on average (0: none yet)."""
        if seconds > 0:
            self.lora_load_s = seconds
