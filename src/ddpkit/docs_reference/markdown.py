"""Small Markdown builders shared by the reference pages."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def cell(text: str) -> str:
    """Text safe inside one cell of a Markdown table: pipes escaped, lines joined."""
    return " ".join(text.replace("|", "\\|").split())


def code(value: str) -> str:
    """Inline code that survives a table cell (a backtick inside widens the fence)."""
    fence = "``" if "`" in value else "`"
    pad = " " if value.startswith("`") or value.endswith("`") else ""
    return f"{fence}{pad}{cell(value)}{pad}{fence}"


def literal(value: Any) -> str:
    """A value on one line as a job spec may spell it (JSON is YAML's flow style)."""
    return json.dumps(value)


def table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def generated_note(source: str) -> str:
    """The line each page starts with: where its content comes from."""
    return (f"!!! info \"Generated from {source}\"\n    This page is written by `ddpkit.docs_reference` "
            "when the site is built, so it says what the code says; change the code, not this page.\n")
