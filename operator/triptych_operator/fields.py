"""A spec declared once, as a tree of `Field`s, and the three things generated from it.

    schema(field)       the CRD's OpenAPI v3 schema, CEL rules included (crd.py writes the CRD)
    read(field, value)  the parser's checks: types, bounds, enums, required fields, defaults, and the
                        same cross-field rules, evaluated in Python (spec/model.py builds its
                        dataclasses from what this returns)
    docs_table(field)   a Markdown table of the fields (crd.py writes them into docs/operator.md)

A cross-field `Rule` is made by one of the constructors below, which write its CEL and its Python
check from the same arguments, so the two cannot disagree. A rule the constructors cannot express
is CEL only (`cel_only`), and its description says which Python code is the full check.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, localcontext
from typing import Any

from triptych.config import parse_size

Schema = dict[str, Any]
# Returns None when the object passes, else the field to name (relative, "" for the object itself).
Check = Callable[[Mapping[str, Any]], str | None]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
# A size of at least 1 byte: a count, or one with a unit as Kubernetes (256Mi) or triptych (256MiB, 256M)
# writes it. The parser reads exactly what this admits (fields._read_size), so the CRD and it agree.
SIZE_PATTERN = "^0*[1-9][0-9]*([KMGT]i?B?)?$"
# A resource quantity (requests, limits) as a pod takes it: k8s.io/apimachinery resource.Quantity's grammar
# (a number, then a binary suffix Ki..Ei, a decimal one n, u, m, k..E, or an integer exponent e3),
# without the '-': a pod's quantities may not be negative. The API server checks a string with it (the
# CRD's `pattern`), the parser every value (_read_quantity_map); a JSON integer is a quantity too.
QUANTITY_PATTERN = r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
QUANTITY_EXAMPLES = "e.g. 500m, 2, 1.5Gi, 128Mi or 1e3"
_DECIMAL_EXPONENT = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


class FieldError(ValueError):
    """A value that does not fit its declaration; `str()` starts with the field's path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Rule:
    """A rule across an object's fields: CEL for the API server, `check` for the parser."""

    cel: str
    message: str
    check: Check | None = None  # None: CEL only (see the module docstring)
    reason: str | None = None

    def schema(self) -> Schema:
        out: Schema = {"rule": self.cel, "message": self.message}
        if self.reason:
            out["reason"] = self.reason
        return out


def _has(obj: Mapping[str, Any], name: str) -> bool:
    return obj.get(name) is not None


def exactly_one(a: str, b: str, message: str) -> Rule:
    return Rule(f"has(self.{a}) != has(self.{b})", message, lambda o: None if _has(o, a) != _has(o, b) else "")


def excludes(a: str, others: Sequence[str], message: str) -> Rule:
    """Setting `a` forbids every one of `others`; the error names `a`."""
    any_other = " || ".join(f"has(self.{b})" for b in others)
    return Rule(
        f"!has(self.{a}) || !({any_other})",
        message,
        lambda o: a if _has(o, a) and any(_has(o, b) for b in others) else None,
    )


def needs(a: str, b: str, message: str) -> Rule:
    """Setting `a` requires `b`; the error names `b`."""
    return Rule(f"!has(self.{a}) || has(self.{b})", message, lambda o: b if _has(o, a) and not _has(o, b) else None)


def required_when(name: str, flag: str, message: str) -> Rule:
    """`name` is required while the boolean `flag` (which has a default) is true."""
    return Rule(
        f"!self.{flag} || has(self.{name})", message, lambda o: name if o.get(flag) and not _has(o, name) else None
    )


def required_when_equal(name: str, key: str, value: str, message: str) -> Rule:
    return Rule(
        f"!has(self.{key}) || self.{key} != '{value}' || has(self.{name})",
        message,
        lambda o: name if o.get(key) == value and not _has(o, name) else None,
    )


def not_above(low: str, high: str, message: str) -> Rule:
    """`low` <= `high` when `high` is set (`low` has a default)."""
    return Rule(
        f"!has(self.{high}) || self.{low} <= self.{high}",
        message,
        lambda o: "" if _has(o, high) and o[low] > o[high] else None,
    )


def absent_within(obj: str, names: Sequence[str], message: str) -> Rule:
    """None of `names` may be set inside the object `obj`; the error names the first that is."""
    none_set = " && ".join(f"!has(self.{obj}.{n})" for n in names)
    cel = f"!has(self.{obj}) || ({none_set})"

    def check(o: Mapping[str, Any]) -> str | None:
        inner = o.get(obj) or {}
        return next((f"{obj}.{n}" for n in names if _has(inner, n)), None)

    return Rule(cel, message, check)


def all_one_unless_positive(
    count: str, obj: str, names: Sequence[str], message: str, reason: str | None = None
) -> Rule:
    """While `count` is 0, every one of `names` set inside `obj` must be 1; the error names the first that is not."""
    ones = " && ".join(f"self.{obj}.?{n}.orValue(1) == 1" for n in names)

    def check(o: Mapping[str, Any]) -> str | None:
        if o.get(count, 0) > 0:
            return None
        inner = o.get(obj) or {}
        return next((f"{obj}.{n}" for n in sorted(names) if inner.get(n) not in (None, 1)), None)

    return Rule(f"self.{count} > 0 || !has(self.{obj}) || ({ones})", message, check, reason)


def not_above_limit(name: str, limit: int, message: str) -> Rule:
    """`name` (which has a default) is at most `limit`; the error names `name`."""
    return Rule(f"self.{name} <= {limit}", message, lambda o: name if o[name] > limit else None)


def each_at_most(obj: str, limits: Mapping[str, int], message: str) -> Rule:
    """Each of `limits` set inside the object `obj` is at most its limit; the error names the first above."""
    bounds = " && ".join(f"self.{obj}.?{n}.orValue({limit}) <= {limit}" for n, limit in limits.items())

    def check(o: Mapping[str, Any]) -> str | None:
        inner = o.get(obj) or {}
        return next((f"{obj}.{n}" for n, limit in limits.items() if (inner.get(n) or 0) > limit), None)

    return Rule(f"!has(self.{obj}) || ({bounds})", message, check)


def not_both_zero(a: str, b: str, message: str) -> Rule:
    """`a` and `b` (both optional) are not both set to 0."""
    return Rule(
        f"!has(self.{a}) || !has(self.{b}) || self.{a} + self.{b} > 0",
        message,
        lambda o: "" if o.get(a) == 0 and o.get(b) == 0 else None,
    )


def as_re2(pattern: str) -> re.Pattern[str]:
    """`pattern` as CEL's RE2 reads it, for Python's re: `$` is the end of the text only (Python's also
    matches before a final newline, so the parser and the API server would disagree on "/a/..\n")."""
    return re.compile(re.sub(r"(?<!\\)\$", r"\\Z", pattern))


def bounded_match(name: str, max_length: int, pattern: str, message: str) -> Rule:
    """The string `name` is at most `max_length` long and matches `pattern` (CEL's RE2 and Python's re
    agree on the simple patterns this is used with, `$` read as RE2 does)."""
    compiled = as_re2(pattern)
    return Rule(
        f"self.{name}.size() <= {max_length} && self.{name}.matches('{pattern}')",
        message,
        lambda o: None if len(o[name]) <= max_length and compiled.match(o[name]) else name,
    )


def matches_and_avoids(name: str, pattern: str, avoid: str, message: str) -> Rule:
    """The string `name` matches `pattern` and holds nothing `avoid` matches (both searched, as CEL's
    `matches` does; CEL's RE2 and Python's re agree on the simple patterns this is used with, `$` read
    as RE2 does)."""
    wanted, unwanted = as_re2(pattern), as_re2(avoid)
    return Rule(
        f"self.{name}.matches('{pattern}') && !self.{name}.matches('{avoid}')",
        message,
        lambda o: None if wanted.search(o[name]) and not unwanted.search(o[name]) else name,
        reason="FieldValueInvalid",
    )


def cel_only(cel: str, message: str, reason: str | None = None) -> Rule:
    return Rule(cel, message, None, reason)


@dataclass(frozen=True)
class Field:
    """One field of the spec: what the CRD, the parser and the docs all say about it.

    `description` is the field's one prose text: the CRD's description (kubectl explain) and the docs'
    Meaning column. Write it as Markdown that reads as plain text too; a `docs/<page>.md` mention
    becomes a link in the docs table.

    `type` is a JSON type (string, integer, boolean, object, array) or one of: `size` (bytes, as an
    integer or a string such as 256MiB), `free` (a Kubernetes type passed through unchecked, e.g.
    Affinity), `string-map`, `quantity-map` (resource quantities by name).
    """

    name: str
    type: str
    description: str = ""
    default: Any = MISSING
    minimum: int | None = None
    maximum: int | None = None
    min_length: int | None = None
    # A string's and an array's upper bounds: what lets the API server bound the cost of a CEL rule on them.
    max_length: int | None = None
    min_items: int | None = None  # an array's
    max_items: int | None = None
    # An array of objects keyed by these fields (x-kubernetes-list-type: map): no two items share their values.
    list_map_keys: tuple[str, ...] = ()
    pattern: str | None = None  # anchored (^...$); RE2 on the API server, re.ASCII in the parser
    enum: tuple[str, ...] | None = None
    required: bool = False
    fields: tuple[Field, ...] = ()
    items: Field | None = None
    rules: tuple[Rule, ...] = ()
    doc_type: str | None = None
    doc_default: str | None = None
    doc_row: bool = False  # an object documented as one row rather than one per field

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)


# ---------------------------------------------------------------- schema


# The Field attributes that become OpenAPI bounds when set, and their keywords.
BOUNDS = (
    ("minimum", "minimum"),
    ("maximum", "maximum"),
    ("min_length", "minLength"),
    ("max_length", "maxLength"),
    ("min_items", "minItems"),
    ("max_items", "maxItems"),
)


def schema(field: Field) -> Schema:
    """The OpenAPI v3 schema of `field` (structural, as a CRD needs)."""
    out: Schema = {}
    if field.type == "size":
        out["x-kubernetes-int-or-string"] = True
    elif field.type in ("free", "string-map", "quantity-map"):
        out["type"] = "object"
    else:
        out["type"] = field.type
    if field.description:
        out["description"] = field.description
    if field.type == "free":
        out["x-kubernetes-preserve-unknown-fields"] = True
    if field.type == "string-map":
        out["additionalProperties"] = {"type": "string"}
    if field.type == "quantity-map":
        # `pattern` applies to a string, `minimum` to an integer (as controller-gen writes resource.Quantity)
        out["additionalProperties"] = {"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN, "minimum": 0}
    if field.enum is not None:
        out["enum"] = list(field.enum)
    for attribute, keyword in BOUNDS:
        if (bound := getattr(field, attribute)) is not None:
            out[keyword] = bound
    if field.list_map_keys:
        out["x-kubernetes-list-type"] = "map"
        out["x-kubernetes-list-map-keys"] = list(field.list_map_keys)
    if field.pattern is not None:
        out["pattern"] = field.pattern
    if field.fields:
        out["properties"] = {f.name: schema(f) for f in field.fields}
        required = [f.name for f in field.fields if f.required]
        if required:
            out["required"] = required
    if field.items is not None:
        out["items"] = schema(field.items)
    if field.default is not MISSING:
        out["default"] = field.default
    rules = [r.schema() for r in field.rules]
    if field.type == "size":
        rules.insert(0, _size_rule(field.name))
    if rules:
        out["x-kubernetes-validations"] = rules
    return out


def _size_rule(name: str) -> Schema:
    return {
        "rule": f"type(self) == string ? self.matches('{SIZE_PATTERN}') : self >= 1",
        "message": f"{name} is a byte count of at least 1 or a size such as 256Mi, 256MiB or 1GiB",
    }


# ---------------------------------------------------------------- parser


def read(field: Field, value: Any, where: str) -> Any:
    """`value` checked against `field` with defaults filled in, as the API server would store it
    (unknown keys dropped); raises FieldError naming the first bad field."""
    if value is None:
        if field.default is not MISSING:
            value = copy.deepcopy(field.default)
        elif field.required:
            raise FieldError(where, "is required")
        else:
            return None
    reader = _READERS.get(field.type)
    if reader is None:
        raise TypeError(f"{where}: unknown field type {field.type!r}")
    return reader(field, value, where)


def _read_integer(field: Field, value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(where, f"must be an integer, not {value!r}")
    low, high = field.minimum, field.maximum
    if (low is not None and value < low) or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"<= {high}" if low is None else f"between {low} and {high}"
        if low is not None and low == high:
            bound = str(low)
        raise FieldError(where, f"is {value}; it must be {bound}")
    return value


def _read_string(field: Field, value: Any, where: str) -> str:
    if field.enum is not None and value not in field.enum:
        raise FieldError(where, f"is {value!r}; choose one of {', '.join(field.enum)}")
    if not isinstance(value, str):
        raise FieldError(where, f"must be a string, not {value!r}")
    if field.min_length is not None and len(value) < field.min_length:
        raise FieldError(where, "must not be empty")
    if field.max_length is not None and len(value) > field.max_length:
        raise FieldError(where, f"is {len(value)} characters long; it must be at most {field.max_length}")
    # fullmatch: Python's `$` would also match before a final newline, RE2's does not.
    if field.pattern is not None and not re.fullmatch(field.pattern, value, re.ASCII):
        raise FieldError(where, f"is {value!r}; it must match {field.pattern}")
    return value


def _read_boolean(field: Field, value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise FieldError(where, f"must be true or false, not {value!r}")
    return value


def _read_object(field: Field, value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise FieldError(where, f"must be an object, not {type(value).__name__}")
    out = {f.name: read(f, value.get(f.name), f"{where}.{f.name}") for f in field.fields}
    for rule in field.rules:
        bad = rule.check(out) if rule.check is not None else None
        if bad is not None:
            given = out.get(bad) if bad else None  # a string the rule refuses is quoted, as _read_string does
            raise FieldError(
                f"{where}.{bad}" if bad else where,
                f"is {given!r}; {rule.message}" if isinstance(given, str) else rule.message,
            )
    return out


def _read_array(field: Field, value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise FieldError(where, f"must be a list, not {type(value).__name__}")
    if field.min_items is not None and len(value) < field.min_items:
        raise FieldError(where, f"must list at least {field.min_items}")
    if field.max_items is not None and len(value) > field.max_items:
        raise FieldError(where, f"lists {len(value)}; it may list at most {field.max_items}")
    assert field.items is not None
    items = [read(field.items, item, f"{where}[{i}]") for i, item in enumerate(value)]
    _check_unique(items, field.list_map_keys, where)
    return items


def _check_unique(items: list[Any], keys: tuple[str, ...], where: str) -> None:
    """No two items with the same values of `keys` (the API server's x-kubernetes-list-type: map); names the second."""
    seen: dict[tuple[Any, ...], int] = {}
    for i, item in enumerate(items if keys else ()):
        key = tuple(item.get(k) for k in keys)
        if key in seen:
            shown = ", ".join(f"{k} {v!r}" for k, v in zip(keys, key, strict=True))
            raise FieldError(f"{where}[{i}].{keys[0]}", f"{shown} twice (also {where}[{seen[key]}]); list each once")
        seen[key] = i


def _read_size(field: Field, value: Any, where: str) -> int:
    """Bytes, at least 1: what the CRD's rule admits (an integer >= 1, a string SIZE_PATTERN matches), read by
    triptych's own parse_size, which spells Kubernetes' `256Mi` as `256MiB`."""
    if isinstance(value, str) and re.fullmatch(SIZE_PATTERN, value):
        return parse_size(value + "B" if value.endswith("i") else value)  # reads every string the pattern admits
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise FieldError(where, f"must be a byte count or a size such as 256Mi or 1GiB, not {value!r}")
    if isinstance(value, str):
        raise FieldError(where, f"{value!r} is not a size of at least 1 byte (e.g. 268435456, 256Mi, 256MiB, 1GiB)")
    if value < 1:
        raise FieldError(where, f"is {value}; it must be at least 1 byte")
    return value


def quantity_value(quantity: int | str) -> Decimal:
    """The number a quantity QUANTITY_PATTERN admits stands for (`1.5Gi` -> 1610612736, `500m` -> 0.5), exactly."""
    if isinstance(quantity, int):
        return Decimal(quantity)
    match = re.fullmatch(r"\+?([0-9.]+)(.*)", quantity)
    assert match is not None and re.fullmatch(QUANTITY_PATTERN, quantity, re.ASCII), quantity
    number, suffix = match.groups()
    if suffix.endswith("i"):  # Ki .. Ei
        with localcontext() as ctx:
            ctx.prec = len(number) + 20  # exact: a power of two of at most 19 digits times the number
            return Decimal(number) * 2 ** (10 * "KMGTPE".index(suffix[0]) + 10)
    if suffix in _DECIMAL_EXPONENT:  # n, u, m, k .. E (exa), or none
        return Decimal(f"{number}e{_DECIMAL_EXPONENT[suffix]}")
    return Decimal(f"{number}e{int(suffix[1:])}")  # e3, E-2: a power of ten


def key_path(where: str, key: str) -> str:
    """The path of a map's entry: `where.cpu`, or `where["nvidia.com/gpu"]` for a key that would not read as one."""
    return f"{where}.{key}" if re.fullmatch(r"[A-Za-z0-9_-]+", key) else f'{where}["{key}"]'


def _read_quantity_map(field: Field, value: Any, where: str) -> dict[str, Any]:
    """Resource name -> quantity: a non-negative integer, or a string QUANTITY_PATTERN admits (what a pod's
    requests and limits take; the API server would refuse the child Deployment with anything else)."""
    out = _read_mapping(field, value, where)
    for name, quantity in out.items():
        path = key_path(where, name)
        if isinstance(quantity, bool) or not isinstance(quantity, int | str):
            raise FieldError(
                path,
                f"is {quantity!r}; write a quantity as a string ({QUANTITY_EXAMPLES}) or a whole number",
            )
        if isinstance(quantity, int) and quantity < 0:
            raise FieldError(path, f"is {quantity}; a quantity may not be negative")
        if isinstance(quantity, str) and not re.fullmatch(QUANTITY_PATTERN, quantity, re.ASCII):
            why = "a quantity may not be negative" if quantity.startswith("-") else "it is not a Kubernetes quantity"
            raise FieldError(path, f"is {quantity!r}; {why} ({QUANTITY_EXAMPLES})")
    return out


def _read_mapping(field: Field, value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise FieldError(where, f"must be an object, not {type(value).__name__}")
    if field.type == "string-map" and not all(isinstance(v, str) for v in value.values()):
        raise FieldError(where, "must map names to strings")
    if field.type == "free" and field.fields:
        for f in field.fields:
            read(f, value.get(f.name), f"{where}.{f.name}")
    return dict(value)


_READERS: dict[str, Callable[[Field, Any, str], Any]] = {
    "integer": _read_integer,
    "string": _read_string,
    "boolean": _read_boolean,
    "object": _read_object,
    "array": _read_array,
    "size": _read_size,
    "free": _read_mapping,
    "string-map": _read_mapping,
    "quantity-map": _read_quantity_map,
}


# ---------------------------------------------------------------- docs


def _doc_type(field: Field) -> str:
    if field.doc_type is not None:
        return field.doc_type
    if field.enum is not None:
        return " \\| ".join(f"`{v}`" for v in field.enum)
    if field.type == "integer":
        if field.minimum is not None and field.maximum is not None:
            return f"{field.minimum}–{field.maximum}"  # noqa: RUF001 (the docs' en dash)
        return f"int ≥ {field.minimum}" if field.minimum is not None else "int"
    if field.type == "array" and field.items is not None:
        return f"[]{_doc_type(field.items)}"
    return {"boolean": "bool", "size": "int or size", "string-map": "map", "quantity-map": "map of quantities"}.get(
        field.type, field.type
    )


def _doc_default(field: Field) -> str:
    if field.doc_default is not None:
        return field.doc_default
    if field.default is MISSING or field.default == {}:
        return "–"  # noqa: RUF001 (the docs' en dash)
    return f"`{str(field.default).lower() if isinstance(field.default, bool) else field.default}`"


def _rows(field: Field, prefix: str) -> list[tuple[str, Field]]:
    rows: list[tuple[str, Field]] = []
    for f in field.fields:
        path = f"{prefix}{f.name}"
        if f.type == "object" and f.fields and not f.doc_row:
            rows += _rows(f, path + ".")
        else:
            rows.append((path, f))
    return rows


def _linked(text: str) -> str:
    """`docs/autoscaling.md` (optionally with #anchor) as a link relative to the docs folder."""
    return re.sub(r"`?docs/([\w-]+\.md)(#[\w-]+)?`?", r"[\1](\1\2)", text)


def docs_table(field: Field) -> str:
    """The Markdown table of `field`'s fields (nested objects flattened to dotted paths)."""
    lines = ["| Field | Type | Default | Meaning |", "|---|---|---|---|"]
    for path, f in _rows(field, ""):
        meaning = _linked(f.description.replace("|", "\\|").replace("\n", " "))
        lines.append(f"| `{path}` | {_doc_type(f)} | {_doc_default(f)} | {meaning} |")
    return "\n".join(lines) + "\n"
