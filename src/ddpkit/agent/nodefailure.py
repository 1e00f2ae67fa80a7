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
record: the batch host may have no Python (a container job).

An srun-mode task (one srun task per process, no agent: `python -m
ddpkit.run`, `python -m ddpkit.train`) leaves the same file for its node
when it ends with a failure of its own (`task_ended`); its node's first
failure stands (the file is never replaced), as several tasks share a node.
A task that a stop ended (the stop's 75, a signal's 128+N, a stop signal
the preamble took) leaves none: srun stopped it after another failed.
ddpkit's own verdicts that end a process at once with os._exit, skipping
the task's last lines (the hang watchdog's 13 and 14, a start-up check-in's
4), go through `exit_now`, which leaves the file first. A task that a signal
killed, or the program's own os._exit, leaves none: the batch script then
keeps srun's status."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from ..shared import envnames
from ..shared.agreed import NODE_FAILURE_FILE
from ..shared.exitcodes import ExitCode
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
        try:
            os.link(part, path)  # whole or absent for its reader, and the node's first failure stays
        finally:
            part.unlink()
    except OSError:  # FileExistsError: another process of the node failed first
        pass


def task_ended(code: int, stopped: bool, env: Mapping[str, str] | None = None) -> None:
    """An agent-less task (srun mode) ended with `code`: leave its node's
    failure file when that is a failure of its own, not a stop (`stopped`: a
    stop signal reached it). Under torchrun's agent the agent speaks for the node."""
    env = os.environ if env is None else env
    if code == 0 or stopped or code == ExitCode.PREEMPTED or code >= 128 or envnames.TORCHELASTIC_RUN_ID in env:
        return
    leave(code, None, env)


def exit_now(code: int) -> NoReturn:
    """End this process at once with `code` (os._exit: no atexit handlers, no
    waiting for threads; for a verdict taken while the main thread is stuck),
    leaving the node's failure file first where this is an srun task."""
    try:
        task_ended(code, stopped=False)
    finally:
        os._exit(code)
