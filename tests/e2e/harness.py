"""Test-side shorthands over triptych_dev.localdeploy (real processes on loopback)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from triptych.roles import Role
from triptych_dev.localdeploy import Device, LocalDeployment, local_deployment

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
    simulate: bool = False,
    spare: dict[Role, int] | None = None,
    host: str = "127.0.0.1",
    full_pipeline: bool = False,
    heads: int = 1,
    devices: Mapping[Role, Sequence[Sequence[Device]]] | None = None,
) -> Iterator[LocalDeployment]:
    """`simulate`: model-free workers (`--simulate`; timing per role through role_flags). `spare`: ports
    the head lists for workers started later with `dep.start_worker(role)` (`dep.stop_worker` drains one).
    `discovery_files`: the head reads file:// worker lists, which start_worker and unlist_worker rewrite.
    `host`: the address every process binds and is reached on (loopback by default).
    `full_pipeline`: `denoisers` full-pipeline workers only (the other counts are ignored).
    `heads`: replicated heads sharing the workers (`dep.head_urls`).
    `devices`: per role, each instance's devices (["cpu", "cpu"]: two CPU ranks; localdeploy.device_flags)."""
    counts = {Role.ENCODER: encoders, Role.DENOISER: denoisers, Role.DECODER: decoders}
    if full_pipeline:
        counts = {Role.DENOISER: denoisers}
    flags = (*CPU, *(("--simulate",) if simulate else ()), *worker_flags)
    with local_deployment(
        model, tmp, counts, head_flags=head_flags, worker_flags=flags, role_flags=role_flags,
        null_payload_bytes=null_payload, head_first=head_first, spare=spare, discovery_files=discovery_files,
        host=host, full_pipeline=full_pipeline, heads=heads, devices=devices,
    ) as dep:  # fmt: skip
        yield dep
