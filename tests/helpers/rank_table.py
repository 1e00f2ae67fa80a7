"""A rank's pid as the rank table (printed by rank 0 at start) gives it.

A worker that ddpkit.agent forked from its zygote shows the agent's
environment in /proc/PID/environ (no exec gave it one of its own), so a
worker is found by its row, not by RANK=N there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


def pid_of(lines: Iterable[str], rank: int) -> int | None:
    """The pid in `rank`'s row of the first rank table in `lines`, or None."""
    row = re.compile(rf"│ {rank}\s+│ \d+\s+│ \d+\s+│ [^│]+│ (\d+)\s+│")
    for line in lines:
        found = row.search(line)
        if found:
            return int(found.group(1))
    return None
