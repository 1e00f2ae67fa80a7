"""Wording shared by every part of the tool: counts with their noun."""

from __future__ import annotations


def plural(count: int, noun: str) -> str:
    """`1 epoch`, `2 epochs`, `1 process`, `3 processes`: the count and its noun."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {noun}{'es' if noun.endswith(('s', 'sh', 'x', 'z')) else 's'}"  # epoch: epochs
