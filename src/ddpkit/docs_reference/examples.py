"""Where a field's example comes from: a job spec a user already reads (the
shipped examples/, the YAML blocks of README.md and docs/), else the schema's
own `examples`, else a value made from the field's type and bounds. Every
example is checked: the spec must accept it, or it is not shown."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..spec import JobSpec
from ..spec.yamlfile import SpecError, build_spec
from .schema_walk import NO_DEFAULT, REQUIRED, SchemaField

YAML_BLOCK = re.compile(r"^```ya?ml[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Example:
    """A fragment of a job spec that sets one field, the whole spec the
    schema accepts it in (the fragment itself, or the document's spec where
    the field needs others beside it), and where it was found."""

    fragment: dict[str, Any]
    context: dict[str, Any]
    source: str  # "examples/cpu-smoke.yaml", "docs/ELASTIC.md", or how it was made
    is_default: bool = False  # the example spells the field's default (it shows nothing by rendering)


def spec_documents(root: Path) -> list[Path]:
    """The files whose job specs a reader copies: examples/, README.md, docs/ (generated pages excepted)."""
    docs = sorted(p for p in (root / "docs").rglob("*.md") if "reference" not in p.relative_to(root / "docs").parts)
    return [*sorted((root / "examples").glob("*.yaml")), root / "README.md", *docs]


def is_job_spec(data: Any) -> bool:
    """A YAML document that is a job spec or a fragment of one: a mapping
    whose keys are all spec fields (a manifest or compose file is not)."""
    return isinstance(data, dict) and bool(data) and set(data) <= set(JobSpec.model_fields)


def _specs_in(path: Path) -> Iterator[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    bodies = [text] if path.suffix == ".yaml" else [m.group(1) for m in YAML_BLOCK.finditer(text)]
    for body in bodies:
        try:
            data = yaml.safe_load(body)
        except yaml.YAMLError:
            continue  # the doc-examples test reports a block that does not parse
        if is_job_spec(data):
            yield data


def _value_at(data: Any, parts: tuple[str, ...]) -> Any:
    """The fragment of `data` that sets the field at `parts` (a list step keeps
    the first item that has the rest), or None where `data` does not set it."""
    if not parts:
        return data
    head, rest = parts[0], parts[1:]
    if head == "[]":
        if not isinstance(data, list):
            return None
        for item in data:
            if _value_at(item, rest) is not None:
                return [item]  # the whole item: its other keys are the context it needs
        return None
    if not isinstance(data, dict) or head not in data or data[head] is None:
        return None
    inner = _value_at(data[head], rest)
    return None if inner is None else {head: inner} if rest else {head: data[head]}


def _accepted(fragment: dict[str, Any]) -> bool:
    try:
        build_spec(fragment)
    except SpecError:
        return False
    return True


def _leaf(fragment: Any, parts: tuple[str, ...]) -> Any:
    for part in parts:
        fragment = fragment[0] if part == "[]" else fragment[part]
    return fragment


def _is_default(fragment: dict[str, Any], parts: tuple[str, ...], defaults: dict[str, Any]) -> bool:
    """Whether the fragment spells what the spec holds anyway (a list's item never is)."""
    if "[]" in parts:
        return False
    try:
        return bool(_leaf(fragment, parts) == _leaf(defaults, parts))
    except (KeyError, TypeError):  # inside a section that is absent by default
        return False


def found_examples(root: Path, fields: list[SchemaField]) -> dict[str, list[Example]]:
    """{field path: every accepted example the documents give for it, in document order}."""
    defaults = build_spec({}).model_dump(mode="json")
    found: dict[str, list[Example]] = {f.path: [] for f in fields}
    for path in spec_documents(root):
        for data in _specs_in(path):
            whole_accepted = _accepted(data)
            for field in fields:
                fragment = _value_at(data, field.parts)
                if not isinstance(fragment, dict):
                    continue
                context = fragment if _accepted(fragment) else data if whole_accepted else None
                if context is not None:
                    is_default = _is_default(fragment, field.parts, defaults)
                    found[field.path].append(Example(fragment, context, str(path.relative_to(root)), is_default))
    return found


def made_examples(field: SchemaField) -> list[Example]:
    """Accepted fragments from the schema's `examples`, then from the field's
    type and bounds; empty when neither gives one the spec accepts."""
    from_schema = [(v, "the schema's example") for v in field.node.get("examples", [])]
    made = []
    for value, source in [*from_schema, *((v, "its type and bounds") for v in _candidates(field))]:
        fragment = _nest(field.parts, value)
        if fragment is not None and _accepted(fragment):
            made.append(Example(fragment, fragment, source))
    return made


def _nest(parts: tuple[str, ...], value: Any) -> dict[str, Any] | None:
    if "[]" in parts:
        return None  # an item needs its required keys: only a document's whole item shows one
    fragment: Any = value
    for part in reversed(parts):
        fragment = {part: fragment}
    return dict(fragment)


def _candidates(field: SchemaField) -> list[Any]:
    """Values of the field's type inside its bounds, the default excepted."""
    node, default = field.node, field.default
    if default in (REQUIRED, NO_DEFAULT):
        default = None
    if "enum" in node:
        return [v for v in node["enum"] if v != default]
    kind = node.get("type")
    if kind == "boolean":
        return [not default] if isinstance(default, bool) else [True, False]
    if kind == "string":
        # plain words, a path, a quantity: whichever the field's own rules accept
        return [v for v in ("example", "/srv/example", "1Gi", "1") if v != default]
    if kind not in ("integer", "number"):
        return []
    low = node.get("minimum", node.get("exclusiveMinimum", 0) + 1)
    high = node.get("maximum", node.get("exclusiveMaximum", low + 1_000_001) - 1)
    values = [default * 2, default + 1] if isinstance(default, (int, float)) else []
    values += [low, low + 1, high]
    cast = int if kind == "integer" else float
    return [cast(v) for v in values if low <= v <= high and v != default]
