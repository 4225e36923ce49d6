"""A CR field is declared once: a toy field added to the declaration of spec.transfer reaches the
generated CRD, the docs table, the typed object parse_pipeline returns, and its validation errors.

The typed model is checked against the declaration rather than generated from it (so mypy sees its
types): the one line a new field needs there is its attribute's name and type, and the check says so."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import yaml

from tests.operator.helpers import NAMESPACE, REPO, minimal_spec
from triptych_operator import crd
from triptych_operator.fields import MISSING, Field
from triptych_operator.spec import model, rules
from triptych_operator.spec.declaration import SPEC, TRANSFER
from triptych_operator.spec.model import ModelError, SpecError, TransferSpec, check_all, check_model
from triptych_operator.spec.rules import parse_pipeline

TOY = Field("toyLimit", "integer", "A toy limit, declared only in this test.", default=3, minimum=1, maximum=9)
TOY_TRANSFER = dataclasses.replace(TRANSFER, fields=(*TRANSFER.fields, TOY))
TOY_SPEC = dataclasses.replace(SPEC, fields=tuple(TOY_TRANSFER if f.name == "transfer" else f for f in SPEC.fields))


@dataclass(frozen=True)
class ToyTransferSpec(TransferSpec):
    toy_limit: int  # name and type only: the default, bounds and text are the declaration's


@pytest.fixture
def toy_declared(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOY_SPEC is the declaration everything reads, and PipelineSpec.transfer is the toy's model."""
    monkeypatch.setattr(crd, "SPEC", TOY_SPEC)
    monkeypatch.setitem(crd.DOCS_TABLES, "spec.transfer", TOY_TRANSFER)
    monkeypatch.setattr(rules, "SPEC", TOY_SPEC)
    # PipelineSpec's annotations are strings resolved in model's namespace when the parser reads them.
    monkeypatch.setattr(model, "TransferSpec", ToyTransferSpec)


def transfer_schema() -> dict:
    doc = yaml.safe_load(crd.render_yaml())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["transfer"]


def test_without_the_toy_declaration_the_field_is_nowhere() -> None:
    assert "toyLimit" not in transfer_schema()["properties"]
    assert "toyLimit" not in crd.render_docs((REPO / "docs" / "operator.md").read_text())
    assert not hasattr(parse_pipeline("p", NAMESPACE, minimal_spec()).transfer, "toy_limit")


@pytest.mark.usefixtures("toy_declared")
def test_the_toy_field_reaches_the_generated_crd_schema() -> None:
    assert transfer_schema()["properties"]["toyLimit"] == {
        "type": "integer",
        "description": "A toy limit, declared only in this test.",
        "minimum": 1,
        "maximum": 9,
        "default": 3,
    }


@pytest.mark.usefixtures("toy_declared")
def test_the_toy_field_reaches_the_docs_table_with_the_same_text() -> None:
    docs = crd.render_docs((REPO / "docs" / "operator.md").read_text())
    row = "| `toyLimit` | 1–9 | `3` | A toy limit, declared only in this test. |"  # noqa: RUF001 (the docs' en dash)
    assert row in docs.splitlines()


@pytest.mark.usefixtures("toy_declared")
def test_the_toy_field_reaches_the_typed_object_with_its_default_and_a_given_value() -> None:
    assert parse_pipeline("p", NAMESPACE, minimal_spec()).transfer.toy_limit == 3  # type: ignore[attr-defined]
    given = parse_pipeline("p", NAMESPACE, minimal_spec(transfer={"toyLimit": 7}))
    assert given.transfer.toy_limit == 7  # type: ignore[attr-defined]
    assert given.transfer.mode == "tcp"  # the declared fields around it are untouched


@pytest.mark.usefixtures("toy_declared")
@pytest.mark.parametrize(
    ("value", "message"),
    [(0, "is 0; it must be between 1 and 9"), ("lots", "must be an integer, not 'lots'")],
)
def test_a_bad_toy_value_is_rejected_naming_the_field_and_the_value(value: object, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_pipeline("p", NAMESPACE, minimal_spec(transfer={"toyLimit": value}))
    assert info.value.field == "spec.transfer.toyLimit"
    assert str(info.value) == f"spec.transfer.toyLimit: {message}"


def test_the_model_check_names_a_declared_field_without_an_attribute() -> None:
    with pytest.raises(ModelError, match=r"spec\.transfer\.toyLimit is declared but TransferSpec has no attribute"):
        check_model(TransferSpec, TOY_TRANSFER, "spec.transfer")
    check_model(ToyTransferSpec, TOY_TRANSFER, "spec.transfer")


def test_the_model_check_names_an_attribute_without_a_declared_field() -> None:
    with pytest.raises(ModelError, match=r"ToyTransferSpec\.toy_limit reads spec\.transfer\.toyLimit"):
        check_model(ToyTransferSpec, TRANSFER, "spec.transfer")


def test_the_model_check_rejects_an_attribute_of_another_type() -> None:
    @dataclass(frozen=True)
    class TextLimit(TransferSpec):
        toy_limit: str

    message = r"TextLimit\.toy_limit is str, but spec\.transfer\.toyLimit is declared integer"
    with pytest.raises(ModelError, match=message):
        check_model(TextLimit, TOY_TRANSFER, "spec.transfer")


def test_the_model_check_wants_none_allowed_where_a_field_may_be_unset() -> None:
    @dataclass(frozen=True)
    class NoDefault(TransferSpec):
        toy_limit: int

    unset = dataclasses.replace(TRANSFER, fields=(*TRANSFER.fields, dataclasses.replace(TOY, default=MISSING)))
    with pytest.raises(ModelError, match=r"NoDefault\.toy_limit cannot be None, .* make it `int \| None`"):
        check_model(NoDefault, unset, "spec.transfer")


def test_the_operators_model_matches_its_declaration() -> None:
    check_all()  # also run at import: a field cannot be added to one without the other
