"""The roles a `triptych serve` process can take."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """What one process runs. Worker roles own a GPU pool; SERVER is the GPU-less head."""

    MONOLITHIC = "monolithic"
    ENCODER = "encoder"
    PROMPT_ENCODER = "prompt_encoder"
    IMAGE_ENCODER = "image_encoder"
    DENOISER = "denoiser"
    DECODER = "decoder"
    SERVER = "server"

    @property
    def is_worker(self) -> bool:
        return self not in (Role.MONOLITHIC, Role.SERVER)

    def runs_affinity(self, affinity: Role) -> bool:
        """Whether a process of this role instantiates a stage declaring `affinity`.

        Monolithic runs everything; the combined encoder also runs the split encoders' stages.
        """
        if self is Role.MONOLITHIC:
            return True
        if self is Role.ENCODER:
            return affinity in (Role.ENCODER, Role.PROMPT_ENCODER, Role.IMAGE_ENCODER)
        return affinity is self


WORKER_ROLES: tuple[Role, ...] = (
    Role.ENCODER,
    Role.PROMPT_ENCODER,
    Role.IMAGE_ENCODER,
    Role.DENOISER,
    Role.DECODER,
)
