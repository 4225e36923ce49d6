"""Test-side shorthands over triptych.localdeploy (real processes on loopback)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from triptych.localdeploy import LocalDeployment, local_deployment
from triptych.roles import Role

CPU = ("--device", "cpu")


@contextmanager
def deployment(
    model: Path,
    tmp: Path,
    encoders: int = 1,
    denoisers: int = 1,
    decoders: int = 1,
    head_flags: Sequence[str] = (),
    worker_flags: Sequence[str] = (),
    role_flags: dict[Role, Sequence[str]] | None = None,
    null_payload: int | None = None,
    head_first: bool = True,
    discovery_files: bool = False,
) -> Iterator[LocalDeployment]:
    counts = {Role.ENCODER: encoders, Role.DENOISER: denoisers, Role.DECODER: decoders}
    with local_deployment(
        model, tmp, counts, head_flags=head_flags, worker_flags=(*CPU, *worker_flags), role_flags=role_flags,
        null_payload_bytes=null_payload, head_first=head_first, discovery_files=discovery_files,
    ) as dep:  # fmt: skip
        yield dep
