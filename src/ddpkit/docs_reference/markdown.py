"""Small Markdown builders shared by the reference pages."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from typing import Any

CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")


def _one_line(text: str) -> str:
    """Text on one line with its pipes escaped, as a table cell needs it."""
    return " ".join(text.replace("|", "\\|").split())


def prose(text: str) -> str:
    """Text with `<`, `>` and `&` outside code spans as entities: a
    placeholder such as `PET_<FLAG>` in prose would otherwise be an HTML tag
    that swallows the rest of its section (and of its search entry)."""
    parts, end = [], 0
    for span in CODE_SPAN.finditer(text):
        parts += [html.escape(text[end:span.start()], quote=False), span.group(0)]
        end = span.end()
    parts.append(html.escape(text[end:], quote=False))
    return "".join(parts)


def cell(text: str) -> str:
    """Prose safe inside one cell of a Markdown table or a heading: pipes
    escaped, lines joined, no HTML."""
    return prose(_one_line(text))


def code(value: str) -> str:
    """Inline code that survives a table cell (a backtick inside widens the fence)."""
    fence = "``" if "`" in value else "`"
    pad = " " if value.startswith("`") or value.endswith("`") else ""
    return f"{fence}{pad}{_one_line(value)}{pad}{fence}"


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
