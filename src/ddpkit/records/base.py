"""What every record is: a frozen dataclass with a kind and a version."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

OMITTED_WHEN_NONE = "omitted when none"


def optional() -> Any:
    """A field that some writers of its kind never fill: left out of the JSON when None."""
    return field(default=None, metadata={OMITTED_WHEN_NONE: True})


class RecordError(ValueError):
    """A record this reader cannot read; the message says which and why."""


@dataclass(frozen=True)
class Record:
    """The base of every record: its kind and the version of its fields."""

    kind: ClassVar[str] = ""
    version: ClassVar[int] = 1
