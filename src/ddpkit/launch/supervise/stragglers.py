"""The stragglers a job's watchdog named (train/watchdog/straggler.py STRAGGLER_LINE),
read back from the workers' lines for the launcher's summary: a `straggler`
column, shown when there is one."""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"ddpkit watchdog: STRAGGLER rank (\d+) node (\d+) host (\S+): ([^;]*)")
MARK = "ddpkit watchdog: STRAGGLER"  # a cheap test before the expression


@dataclass(frozen=True)
class NamedStraggler:
    rank: int
    node: int
    host: str
    detail: str  # "0.312s of own work a step against the job's median 0.013s (24.0x, limit 1.33x) at step 23"

    @classmethod
    def parse(cls, body: str) -> NamedStraggler | None:
        found = _LINE.search(body) if MARK in body else None
        return cls(int(found.group(1)), int(found.group(2)), found.group(3), found.group(4)) if found else None

    @property
    def line(self) -> str:
        return f"rank {self.rank} ({self.host}): {self.detail}"


def straggler_cell(named: list[NamedStraggler], node: int) -> str:
    """The summary's straggler cell of one node (its ranks, first time each was named)."""
    return "\n".join(s.line for s in named if s.node == node)
