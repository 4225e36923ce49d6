"""The roles a `triptych serve` process can take, and the one table every layer reads about them.

`ROLE_SPECS` is the role descriptor: the head's result port, its `--*-urls` flag, the per-role
parallelism flags, the request states a hop passes, the role's place in a request's route, the
operator's CR field and its default drain time all come from it. Adding a worker role is one
entry here plus the stages that declare it as their affinity (triptych_worker.pipeline).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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
        return self in ROLE_SPECS

    @property
    def spec(self) -> RoleSpec:
        """This worker role's descriptor; KeyError for monolithic and server."""
        return ROLE_SPECS[self]

    @property
    def url_attr(self) -> str:
        """The ServeArgs attribute of the head's URL flag for this role (--prompt-encoder-urls)."""
        return f"{self.value}_urls"

    @property
    def dns_name(self) -> str:
        """The role in Kubernetes object names and labels: 'prompt-encoder' (no underscores there)."""
        return self.value.replace("_", "-")

    @property
    def flag_prefix(self) -> str:
        """'--prompt-encoder-' for Role.PROMPT_ENCODER: how its own flags begin."""
        return f"--{self.value.replace('_', '-')}-"

    def runs_affinity(self, affinity: Role) -> bool:
        """Whether a process of this role instantiates a stage declaring `affinity`.

        Monolithic runs everything; a worker role runs its own stages and those its descriptor
        lists in `also_runs` (the combined encoder runs the split encoders' stages).
        """
        if self is Role.MONOLITHIC:
            return True
        spec = ROLE_SPECS.get(self)
        return spec is not None and (affinity is self or affinity in spec.also_runs)


@dataclass(frozen=True)
class RoleSpec:
    """Everything the layers of Triptych know about one worker role."""

    result_port_offset: int
    """The head's PULL port for this role's results: --scheduler-port + this (docs/design.md, "Port convention")."""
    route_order: int
    """Place in a request's route; the head visits the roles its URL flags list, in this order."""
    stage_states: str
    """The request states a hop to this role passes: f"{stage_states}_WAITING/_RUNNING", then _DONE
    (the decoder's hop ends in DONE)."""
    parallel_flags: dict[str, str] = field(default_factory=dict)
    """Per-role parallelism flags of `triptych serve`: degree -> ServeArgs attribute (--encoder-tp)."""
    operator_degrees: tuple[str, ...] = ("tp", "sp", "cfg")
    """The parallel degrees a DiffusionPipeline may set for this role's pool."""
    crd_field: str | None = None
    """This role's pool in a DiffusionPipeline spec (camelCase), None when the operator runs no such pool."""
    drain_seconds: int = 120
    """Default seconds a draining worker of this role may take (the operator's drainSeconds)."""
    simulate_seconds: tuple[float, float] = (0.02, 0.005)
    """--simulate defaults: (seconds per request, seconds per unit of work)."""
    prior_seconds_per_unit: float = 0.1
    """Device-seconds per unit of work before a worker has reported any (the autoscaling signal)."""
    needs_reference: bool = False
    """Visited only by requests that carry a reference image (image edits)."""
    split_encoder: bool = False
    """One of the split encoders (prompt_encoder, image_encoder), which replace the combined encoder."""
    also_runs: frozenset[Role] = frozenset()
    """Other roles' stages a process of this role runs as well."""
    receives_from: Role | None = None
    """The role whose outputs are this role's inputs (through its receive slots); None: a first role,
    given Work. The image encoder receives the prompt encoder's on an edit's split route."""


ROLE_SPECS: dict[Role, RoleSpec] = {
    Role.ENCODER: RoleSpec(
        result_port_offset=1,
        route_order=0,
        stage_states="ENCODER",
        parallel_flags={"tp": "encoder_tp"},
        crd_field="encoder",
        also_runs=frozenset({Role.PROMPT_ENCODER, Role.IMAGE_ENCODER}),
    ),
    Role.PROMPT_ENCODER: RoleSpec(
        result_port_offset=4,
        route_order=1,
        stage_states="ENCODER",
        crd_field="promptEncoder",
        split_encoder=True,
    ),
    Role.IMAGE_ENCODER: RoleSpec(
        result_port_offset=5,
        route_order=2,
        stage_states="ENCODER",
        crd_field="imageEncoder",
        needs_reference=True,
        split_encoder=True,
        receives_from=Role.PROMPT_ENCODER,
    ),
    Role.DENOISER: RoleSpec(
        result_port_offset=2,
        route_order=3,
        stage_states="DENOISING",
        parallel_flags={
            "tp": "denoiser_tp",
            "sp": "denoiser_sp",
            "ulysses": "denoiser_ulysses",
            "ring": "denoiser_ring",
        },
        operator_degrees=("tp", "sp", "ulysses", "ring", "cfg"),
        crd_field="denoiser",
        receives_from=Role.ENCODER,  # the encoder's outputs (the split encoders' accumulated ones)
        # A drain hands running requests to peers at a step boundary (docs/design.md "Migration"): about a
        # step and a transfer while a peer has room; this bounds the wait for one (node drains, autoscalers).
        drain_seconds=300,
        simulate_seconds=(0.02, 0.25),
        prior_seconds_per_unit=0.2,
    ),
    Role.DECODER: RoleSpec(
        result_port_offset=3,
        route_order=4,
        stage_states="DECODER",
        parallel_flags={"sp": "decoder_sp"},
        crd_field="decoder",
        receives_from=Role.DENOISER,
        simulate_seconds=(0.01, 0.05),
        prior_seconds_per_unit=0.05,
    ),
}

WORKER_ROLES: tuple[Role, ...] = tuple(sorted(ROLE_SPECS, key=lambda role: ROLE_SPECS[role].route_order))
"""Every worker role, in the order a request visits them."""

RECEIVING_ROLES: tuple[Role, ...] = tuple(r for r in WORKER_ROLES if ROLE_SPECS[r].receives_from is not None)
"""The roles that take tensors through receive slots: every worker role that is not a first one."""

COMBINED_ROLES: tuple[Role, ...] = tuple(r for r in WORKER_ROLES if not ROLE_SPECS[r].split_encoder)
"""The three-role topology: encoder, denoiser, decoder."""

SPLIT_ROLES: tuple[Role, ...] = tuple(r for r in WORKER_ROLES if not ROLE_SPECS[r].also_runs)
"""The four-role topology: prompt_encoder, image_encoder, denoiser, decoder."""


def route_for(roles: set[Role] | frozenset[Role], *, has_reference: bool) -> list[Role]:
    """The hops of a request through a deployment running `roles`: in route order, skipping the
    roles only reference images need when the request has none (T2I bypasses the image encoder)."""
    return [role for role in WORKER_ROLES if role in roles and (has_reference or not ROLE_SPECS[role].needs_reference)]


FULL_PIPELINE_ROLE = Role.DENOISER
"""The role of a full-pipeline pool's workers (--disagg-full-pipeline): a head that lists only this
role's URLs sends each request to one of them whole, and gets its pixels back."""


def is_full_pipeline(roles: set[Role] | frozenset[Role] | list[Role]) -> bool:
    """Whether a deployment (or a request's route) of `roles` is a full-pipeline pool."""
    return set(roles) == {FULL_PIPELINE_ROLE}
