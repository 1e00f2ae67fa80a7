"""`python -m tests.helpers.elastic_gate <ddpkit train flags>`: ddpkit train
that holds every rank right after the first checkpoint its full-size world
writes, so a test can take a node away at a known step.

$ELASTIC_TEST_GATE_DIR/<step>.rank<R> is written (atomically) by each held
rank, holding its world size; the ranks go on once the test creates
$ELASTIC_TEST_GATE_DIR/go. Only a world of $ELASTIC_TEST_GATE_WORLD ranks is
held (a first rendezvous that formed smaller is let through), and only
until `go` exists: the workers started after the node loss run freely."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from ddpkit.train import checkpointing
from ddpkit.train.__main__ import main

GATE_DIR, GATE_WORLD = "ELASTIC_TEST_GATE_DIR", "ELASTIC_TEST_GATE_WORLD"
_real_save = checkpointing.Checkpointer.save


def _held_save(self: checkpointing.Checkpointer, pos: Any) -> Any:
    path = _real_save(self, pos)  # every rank returns after the barrier: the file is complete
    gate = Path(os.environ[GATE_DIR])
    if self.ctx.world_size == int(os.environ[GATE_WORLD]) and not (gate / "go").exists():
        mark = gate / f"{pos.step}.rank{self.ctx.rank}"
        tmp = mark.with_name(mark.name + f".tmp-{os.getpid()}")
        tmp.write_text(str(self.ctx.world_size))
        os.replace(tmp, mark)
        while not (gate / "go").exists():
            time.sleep(0.05)
    return path


if __name__ == "__main__":
    checkpointing.Checkpointer.save = _held_save  # type: ignore[method-assign]
    sys.exit(main())
