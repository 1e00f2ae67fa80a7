"""The job spec's fields, read from its JSON Schema: one `SchemaField` per
field a user can set, with its type, default and allowed values in words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Node = dict[str, Any]

# A field pydantic lists without a default is one the user must give.
REQUIRED = object()
# A section or list whose default is built by a factory: the schema shows none.
NO_DEFAULT = object()


@dataclass(frozen=True)
class SchemaField:
    """One settable field. `path` is dotted (`watchdog.loss_s`); a field of a
    list's items reads `k8s.volumes[].name`. `parts` is the same path split,
    with "[]" marking a list step."""

    parts: tuple[str, ...]
    type: str
    default: object
    allowed: str
    description: str
    section_note: str  # the description of the model the field belongs to
    node: Node  # the field's schema, $refs resolved, null stripped

    @property
    def path(self) -> str:
        return ".".join(self.parts).replace(".[]", "[]")

    @property
    def top(self) -> str:
        """The top-level key the field lives under (its page section)."""
        return self.parts[0] if len(self.parts) > 1 else ""

    @property
    def in_list_item(self) -> bool:
        return "[]" in self.parts


class SchemaWalk:
    """Walks a pydantic JSON Schema ($defs and $refs) into SchemaFields."""

    def __init__(self, schema: Node):
        self.defs: dict[str, Node] = schema.get("$defs", {})
        self.schema = schema

    def resolve(self, node: Node) -> Node:
        """`node` with a $ref replaced by its definition (the node's own keys win)."""
        if "$ref" not in node:
            return node
        target = self.defs[node["$ref"].rsplit("/", 1)[-1]]
        return {**target, **{k: v for k, v in node.items() if k != "$ref"}}

    def without_null(self, node: Node) -> tuple[Node, bool]:
        """(the node less its `null` alternative, whether null was allowed)."""
        node = self.resolve(node)
        options = node.get("anyOf")
        if not options:
            return node, False
        kept = [o for o in options if o.get("type") != "null"]
        if len(kept) == len(options) or len(kept) != 1:
            return node, len(kept) != len(options)
        merged = {**self.resolve(kept[0]), **{k: v for k, v in node.items() if k != "anyOf"}}
        return merged, True

    def type_words(self, node: Node) -> str:
        """What a value of `node` is, in the words the pages use."""
        node = self.resolve(node)
        if "const" in node:
            return f"the value {node['const']!r}"
        if "enum" in node:
            return "one of the allowed values"
        if "anyOf" in node:
            return " or ".join(self.type_words(o) for o in node["anyOf"])
        kind = node.get("type")
        if kind == "array":
            return "list of " + self.type_words(node.get("items", {}))
        if kind == "object" and "properties" in node:
            return f"section ({node.get('title', 'object')})"
        if kind == "object":
            values = node.get("additionalProperties")
            return "mapping of text to " + (self.type_words(values) if isinstance(values, dict) else "anything")
        words = {"string": "text", "integer": "integer", "number": "number", "boolean": "true or false", "null": "absent"}
        return words.get(str(kind), str(kind))

    def fields(self) -> list[SchemaField]:
        return self._walk(self.schema, ())

    def _walk(self, model: Node, prefix: tuple[str, ...]) -> list[SchemaField]:
        found: list[SchemaField] = []
        required = set(model.get("required", []))
        note = str(model.get("description", ""))
        for name, raw in model.get("properties", {}).items():
            node, nullable = self.without_null(raw)
            parts = (*prefix, name)
            default = raw.get("default", REQUIRED if name in required else NO_DEFAULT)
            item, _ = self.without_null(node.get("items", {})) if node.get("type") == "array" else ({}, False)
            item_model = self._model_among(item)
            if "properties" in node and not nullable:
                found += self._walk(node, parts)  # a section that is always there: its fields are what a user sets
                continue
            found.append(SchemaField(parts, self.type_words(raw), default, allowed(node), _description(raw, node),
                                     note, node))
            if "properties" in node:  # an optional section (absent by default): its fields too
                found += self._walk(node, parts)
            elif item_model is not None:
                found += self._walk(item_model, (*parts, "[]"))
        return found

    def _model_among(self, item: Node) -> Node | None:
        """The model a list's items are (or may be, beside a plain value), if any."""
        if "properties" in item:
            return item
        for option in item.get("anyOf", []):
            resolved = self.resolve(option)
            if "properties" in resolved:
                return resolved
        return None


def _description(raw: Node, node: Node) -> str:
    """The field's own description, else its type's (an enum or a model documents itself)."""
    return str(raw.get("description") or node.get("description") or "")


def allowed(node: Node) -> str:
    """The values `node` accepts beyond its type, in words (empty: any of its type)."""
    if "enum" in node:
        return ", ".join(f"`{v}`" for v in node["enum"])
    if "const" in node:
        return f"`{node['const']}`"
    words = []
    for key, text in (("minimum", "at least {}"), ("exclusiveMinimum", "more than {}"),
                      ("maximum", "at most {}"), ("exclusiveMaximum", "less than {}"),
                      ("minLength", "at least {} characters"), ("maxLength", "at most {} characters"),
                      ("minItems", "at least {} items"), ("maxItems", "at most {} items"),
                      ("pattern", "matching `{}`")):
        if key in node:
            words.append(text.format(node[key]))
    if not words and "anyOf" in node:
        return "; ".join(a for a in (allowed(o) for o in node["anyOf"]) if a)
    return ", ".join(words)
