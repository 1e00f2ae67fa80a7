"""The stragglers a job's watchdog named (its `straggler` records, which
the run's Findings keep), as the launcher's summary shows them: a `straggler`
column, shown when there is one."""

from __future__ import annotations

from ...records import Straggler


def straggler_cell(named: list[Straggler], node: int) -> str:
    """The summary's straggler cell of one node (its ranks, first time each was named)."""
    return "\n".join(s.line for s in named if s.node == node)
