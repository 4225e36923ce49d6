"""The role descriptor (triptych.roles.ROLE_SPECS) is the only list of roles: every layer's view comes from it."""

from __future__ import annotations

import argparse
import ast
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.source_ast import parse
from triptych.config import ROLE_PARALLEL_FLAGS, SIMULATE_DEFAULTS, URL_FLAGS, ServeArgs
from triptych.ports import RESULT_PORT_OFFSET, result_port
from triptych.roles import COMBINED_ROLES, ROLE_SPECS, SPLIT_ROLES, WORKER_ROLES, Role, route_for
from triptych.serve_flags import add_serve_flags
from triptych_dev.localdeploy import ROLES as LOCAL_ROLES
from triptych_head.state import ROLE_STATES, RequestState
from triptych_head.workload import PRIOR_SECONDS_PER_UNIT
from triptych_operator.constants import PIPELINE_ROLES
from triptych_operator.spec.declaration import DEFAULT_DRAIN_SECONDS, ROLE_DEGREES

ROOT = Path(__file__).resolve().parents[2]
# What ships; tests and benchmarks describe particular deployments (so many encoders, so many denoisers).
SOURCES = (
    "triptych",
    "head/triptych_head",
    "worker/triptych_worker",
    "operator/triptych_operator",
    "devtools/triptych_dev",
)
WORKER_NAMES = {role.name for role in WORKER_ROLES}
WORKER_VALUES = {role.value for role in WORKER_ROLES}


def test_result_ports_follow_the_spec_and_never_collide() -> None:
    assert {r: result_port(19655, r) - 19655 for r in WORKER_ROLES} == {
        Role.ENCODER: 1, Role.DENOISER: 2, Role.DECODER: 3, Role.PROMPT_ENCODER: 4, Role.IMAGE_ENCODER: 5,
    }  # fmt: skip
    assert len(set(RESULT_PORT_OFFSET.values())) == len(WORKER_ROLES)


def test_every_layer_reads_the_descriptor() -> None:
    assert set(URL_FLAGS) == set(RESULT_PORT_OFFSET) == set(ROLE_STATES) == set(PRIOR_SECONDS_PER_UNIT) == set(
        SIMULATE_DEFAULTS
    ) == set(ROLE_PARALLEL_FLAGS) == set(ROLE_SPECS)  # fmt: skip
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    fields = set(ServeArgs.__dataclass_fields__)
    for role, spec in ROLE_SPECS.items():
        assert f"--{role.value.replace('_', '-')}-urls" in flags and URL_FLAGS[role] in fields
        assert all(attr in fields and "--" + attr.replace("_", "-") in flags for attr in spec.parallel_flags.values())
        waiting, running, _ = ROLE_STATES[role]
        assert (waiting, running) == (
            RequestState[f"{spec.stage_states}_WAITING"],
            RequestState[f"{spec.stage_states}_RUNNING"],
        )
    assert LOCAL_ROLES == COMBINED_ROLES
    assert set(PIPELINE_ROLES) <= {role for role, spec in ROLE_SPECS.items() if spec.crd_field}
    assert {role: ROLE_DEGREES[role] for role in PIPELINE_ROLES} == {
        r: ROLE_SPECS[r].operator_degrees for r in PIPELINE_ROLES
    }
    assert {role: DEFAULT_DRAIN_SECONDS[role] for role in PIPELINE_ROLES} == {
        r: ROLE_SPECS[r].drain_seconds for r in PIPELINE_ROLES
    }


def test_topologies_and_routes() -> None:
    assert COMBINED_ROLES == (Role.ENCODER, Role.DENOISER, Role.DECODER)
    assert SPLIT_ROLES == (Role.PROMPT_ENCODER, Role.IMAGE_ENCODER, Role.DENOISER, Role.DECODER)
    four = frozenset(SPLIT_ROLES)
    assert route_for(four, has_reference=False) == [Role.PROMPT_ENCODER, Role.DENOISER, Role.DECODER]
    assert route_for(four, has_reference=True) == list(SPLIT_ROLES)
    assert route_for(frozenset(COMBINED_ROLES), has_reference=True) == list(COMBINED_ROLES)
    assert Role.ENCODER.runs_affinity(Role.IMAGE_ENCODER) and not Role.PROMPT_ENCODER.runs_affinity(Role.IMAGE_ENCODER)


STATE_WORDS = {state.value for state in RequestState} | {state.value.split("_")[0] for state in RequestState}


def _role_lists(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """Collection displays (tuple, list, set, dict keys or values) naming two or more worker roles."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            items: list[ast.expr | None] = [*node.keys, *node.values]
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = list(node.elts)
        else:
            continue
        names = set()
        for item in items:
            if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "Role":
                names.add(item.attr) if item.attr in WORKER_NAMES else None
            elif isinstance(item, ast.Constant) and item.value in WORKER_VALUES:
                names.add(str(item.value))
        if len(names) >= 2:
            found.append((node.lineno, sorted(names)))
    return found


def _state_to_role_chains(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """Functions that name two or more worker roles beside request states: a hand mapping of states
    to roles (an if-chain, or a lookup), which ROLE_STATES and RequestEvent.role make unnecessary."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        strings = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        roles, states = strings & WORKER_VALUES, strings & STATE_WORDS
        if len(roles) >= 2 and states:
            found.append((node.lineno, sorted(roles | states)))
    return found


def test_the_checks_catch_a_hand_mapping_of_states_to_roles() -> None:
    as_dict = 'ROLE_OF = {"ENCODER": "encoder", "DENOISING": "denoiser"}'
    as_chain = (
        "def role_of(state):\n"
        "    if state.startswith('ENCODER'):\n        return 'encoder'\n"
        "    if state == 'DENOISING_RUNNING':\n        return 'denoiser'\n"
    )
    assert _role_lists(parse(as_dict)) and _state_to_role_chains(parse(as_chain))


def _offenders(folder: str, finder: Callable[[ast.AST], list[tuple[int, list[str]]]]) -> list[str]:
    """`finder`'s findings in every shipped source file of `folder` but the role table itself."""
    offenders = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path == ROOT / "triptych" / "roles.py" or "tiny_models" in path.parts:
            continue
        for line, names in finder(parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {names}")
    return offenders


@pytest.mark.parametrize("folder", SOURCES)
def test_no_state_to_role_mapping_by_hand(folder: str) -> None:
    offenders = _offenders(folder, _state_to_role_chains)
    assert offenders == [], "use triptych_head.state.ROLE_STATES or RequestEvent.role:\n" + "\n".join(offenders)


@pytest.mark.parametrize("folder", SOURCES)
def test_no_second_list_of_roles_anywhere(folder: str) -> None:
    """Grep-level: no source file but triptych/roles.py spells out a collection of worker roles."""
    offenders = _offenders(folder, _role_lists)
    assert offenders == [], "derive these from triptych.roles.ROLE_SPECS:\n" + "\n".join(offenders)
