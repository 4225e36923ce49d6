"""One declaration, three outputs: a field added to a declaration shows up in the CRD schema, the
parser and the docs table, with the same default, bounds and cross-field rule in each."""

from __future__ import annotations

import pytest

from triptych_operator.fields import Field, FieldError, docs_table, not_above, read, required_when, schema

BASE = (
    Field("replicas", "integer", "Pods.", default=1, minimum=0),
    Field("mode", "string", "How.", enum=("fast", "slow"), default="fast"),
)
NEW = Field("burst", "integer", "Extra pods during a rollout.", default=2, minimum=0, maximum=8)


def toy(*extra: Field) -> Field:
    return Field(
        "toy",
        "object",
        "A toy section.",
        default={},
        fields=(*BASE, *extra),
        rules=(not_above("replicas", "burst", "replicas must be <= burst"),) if extra else (),
    )


def test_a_new_field_reaches_the_schema() -> None:
    assert "burst" not in schema(toy())["properties"]
    out = schema(toy(NEW))
    assert out["properties"]["burst"] == {
        "type": "integer",
        "description": "Extra pods during a rollout.",
        "minimum": 0,
        "maximum": 8,
        "default": 2,
    }
    assert out["x-kubernetes-validations"] == [
        {"rule": "!has(self.burst) || self.replicas <= self.burst", "message": "replicas must be <= burst"}
    ]


def test_a_new_field_reaches_the_parser_with_its_default_bounds_and_rule() -> None:
    assert "burst" not in read(toy(), {}, "spec.toy")
    assert read(toy(NEW), None, "spec.toy") == {"replicas": 1, "mode": "fast", "burst": 2}
    with pytest.raises(FieldError) as info:
        read(toy(NEW), {"burst": 9}, "spec.toy")
    assert str(info.value) == "spec.toy.burst: is 9; it must be between 0 and 8"
    with pytest.raises(FieldError) as info:
        read(toy(NEW), {"replicas": 3}, "spec.toy")
    assert str(info.value) == "spec.toy: replicas must be <= burst"


def test_a_new_field_reaches_the_docs_table() -> None:
    assert "`burst`" not in docs_table(toy())
    row = "| `burst` | 0–8 | `2` | Extra pods during a rollout. |"  # noqa: RUF001 (the docs' en dash)
    assert row in docs_table(toy(NEW)).splitlines()


def test_a_rule_says_the_same_in_cel_and_in_python() -> None:
    rule = required_when("host", "enabled", "host is required when enabled")
    assert rule.cel == "!self.enabled || has(self.host)"
    assert rule.check is not None
    assert rule.check({"enabled": True, "host": None}) == "host"
    assert rule.check({"enabled": False, "host": None}) is None
    assert rule.check({"enabled": True, "host": "a.example"}) is None
