"""`python -m tests.helpers.same_warning`: what a real job's ranks do when a
library warns: every rank prints the same warning at about the same time
(stderr, through the warnings module), then a line of its own (stdout). The
launcher's console should show the warning once, with the ranks named; the
node logs keep every copy.

With $SAME_WARNING_BARRIER (a folder every rank sees) the ranks wait for each
other there before they warn, so the copies arrive together however unevenly
the machine starts the processes."""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

WARNING = "the same warning from every rank (tests.helpers.same_warning)"
BARRIER = "SAME_WARNING_BARRIER"


def own_line(rank: str, world: str) -> str:
    return f"same_warning: rank {rank} of {world}"


def barrier(folder: Path, rank: str, world: int, timeout_s: float = 120.0) -> None:
    (folder / f"rank{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(folder.glob("rank*"))) < world:
        if time.monotonic() > deadline:
            raise SystemExit(f"same_warning: waited {timeout_s}s for {world} ranks in {folder}")
        time.sleep(0.01)


def main() -> int:
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    if os.environ.get(BARRIER):
        barrier(Path(os.environ[BARRIER]), rank, int(world))
    warnings.warn(WARNING, UserWarning, stacklevel=1)
    sys.stderr.flush()
    print(own_line(rank, world), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
