"""Read the rank report table (ddpkit.train.startup.rank_report.print_table) back out
of a log, so container tests can check that every rank reported exactly once.

    python -m tests.infra.rank_table LOG WORLD_SIZE   exit 0 when ranks 0..W-1 appear once
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

# A table row: "│ 0    │ 0          │ 0         │ node0 │ ...", possibly behind
# a compose/launcher prefix such as "node0-1  | ".
_ROW = re.compile(r"│\s*(\d+)\s*│\s*(\d+)\s*│\s*(\d+)\s*│\s*([^│\s]+)\s*│")


@dataclass(frozen=True)
class Row:
    rank: int
    local_rank: int
    node_rank: int
    host: str


def rows(text: str) -> list[Row]:
    found = []
    for line in text.splitlines():
        m = _ROW.search(line)
        if m:
            found.append(Row(int(m[1]), int(m[2]), int(m[3]), m[4]))
    return found


def problems(text: str, world_size: int, nproc_per_node: int | None = None) -> list[str]:
    """Why the log's rank report is not one report of `world_size` ranks."""
    got = rows(text)
    out = []
    if "rank report:" not in text:
        out.append("no rank report in the log")
    ranks = sorted(r.rank for r in got)
    if ranks != list(range(world_size)):
        out.append(f"ranks in the table are {ranks}, expected 0..{world_size - 1} once each")
    if nproc_per_node:
        for r in got:
            if r.rank != r.node_rank * nproc_per_node + r.local_rank:
                out.append(f"rank {r.rank} breaks rank = node_rank * {nproc_per_node} + local_rank ({r})")
    return out


def main(argv: list[str]) -> int:
    text = Path(argv[0]).read_text(encoding="utf-8", errors="replace")
    bad = problems(text, int(argv[1]), int(argv[2]) if len(argv) > 2 else None)
    for p in bad:
        print(f"rank report check: {p}", file=sys.stderr)
    if not bad:
        print(f"rank report check: ranks 0..{int(argv[1]) - 1} each reported once")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
