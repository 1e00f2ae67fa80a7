"""A node whose workers failed says so to the Slurm batch script: when its
first worker failed and the agent's exit code, in a file of its own in the
job's records folder, `<node>.run<R>.failed` (R: SLURM_RESTART_COUNT, so a
requeued run reads its own), one line `<microseconds since the epoch> <code>`.

Why: srun's status is its tasks' highest code. After one node failed,
`--kill-on-bad-exit=1` stops the others with SIGTERM, and a node stopped so
may end 143 (or 1), which hides the first failure's code (a stall's 13).
The batch script (templates/slurm) reads these files after the step, by
each host's name (no directory listing: an NFS client caches those), and
ends the job with the code of the node that failed first. Plain text, not a
record: the batch host may have no Python (a container job)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from .. import envnames
from ..agreed import NODE_FAILURE_FILE
from . import nodelog


def path_for(env: Mapping[str, str]) -> Path | None:
    """This node's file, where a Slurm job's records folder is; None elsewhere."""
    node_file = nodelog.slurm_node_file(env)
    if node_file is None:
        return None
    name = NODE_FAILURE_FILE.format(node=node_file.stem, run=env.get(envnames.SLURM_RESTART_COUNT) or "0")
    return node_file.with_name(name)


def leave(code: int, failed_at: float | None, env: Mapping[str, str] | None = None) -> None:
    """Say that this node failed at `failed_at` (time.time(); None: now) and its
    agent exits `code`; nothing where no Slurm job's records folder is, or it
    cannot be written (the batch script then keeps srun's status)."""
    path = path_for(os.environ if env is None else env)
    if path is None:
        return
    at = time.time() if failed_at is None else failed_at
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}")
        part.write_text(f"{int(at * 1_000_000)} {int(code)}\n", encoding="ascii")
        os.replace(part, path)  # whole or absent for its reader
    except OSError:
        pass
