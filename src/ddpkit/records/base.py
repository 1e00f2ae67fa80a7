"""What every record is: a frozen dataclass with a kind and a version."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

OMITTED_WHEN_NONE = "omitted when none"


def optional(compare: bool = True) -> Any:
    """A field that some writers of its kind never fill: left out of the JSON when None;
    `compare` False: not part of what the record says (two records equal without it)."""
    return field(default=None, compare=compare, metadata={OMITTED_WHEN_NONE: True})


class RecordError(ValueError):
    """A record this reader cannot read; the message says which and why."""


@dataclass(frozen=True)
class Record:
    """The base of every record: its kind and the version of its fields."""

    kind: ClassVar[str] = ""
    version: ClassVar[int] = 1
