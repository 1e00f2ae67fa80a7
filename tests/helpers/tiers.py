"""The two test tiers (docs/TESTING.md): `make test` proves every capability
once; `make test-full` adds the tests marked `full`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

FULL = pytest.mark.full


def one_case_in_ci(values: Iterable[Any], keep: Any) -> list[Any]:
    """Parameters for `pytest.mark.parametrize`: the case `keep` runs in both
    tiers, every other one in `make test-full` only (each proves the same
    capability under another variant). A tuple value fills several argnames.
    Test ids stay what pytest would give the plain values."""
    values = list(values)
    if keep not in values:
        raise ValueError(f"{keep!r} is not one of the cases {values!r}")
    return [value if value == keep else pytest.param(*(value if isinstance(value, tuple) else (value,)), marks=FULL)
            for value in values]


def full_case(*values: Any) -> Any:
    """One case of a parametrized test, run in `make test-full` only."""
    return pytest.param(*values, marks=FULL)
