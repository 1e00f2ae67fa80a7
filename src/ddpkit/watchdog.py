"""Stall detection for your own training script (spec `command.script`).

    from ddpkit import watchdog

    for step, batch in enumerate(loader, 1):
        ...                          # forward, backward, optimizer step
        watchdog.progress(step)      # a few attribute writes: no I/O, no collective
    with watchdog.phase("eval"):     # evaluation/checkpointing: slow, but not stalled
        ...

The first `progress` call starts this rank's watchdog thread (torchrun's
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT say where the store is; the
job environment carries the spec's `watchdog:` settings). Under ddpkit's agent a
script needs none of this: every optimizer step is reported for it
(ddpkit/preamble); a script that calls `progress` itself is counted by its
own calls instead. docs/guides/hangs.md has the details.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from .shared import envnames
from .shared.agreed import metrics_to_launcher
from .train.watchdog import stall
from .train.watchdog import stall_model as _wd

__all__ = ["phase", "progress", "stop"]

_state: dict[str, stall.Watchdog | None] = {}


def progress(step: int) -> None:
    """Report that `step` finished; the first call starts the watchdog."""
    _state["script"] = None  # the script reports its own steps: the preamble's count stands aside
    _report(step)


def auto_progress(step: int) -> None:
    """The preamble's report of an optimizer step (ddpkit/preamble), unless
    the script reports its own steps with `progress`, or a watchdog this
    module did not start runs in the process: `ddpkit train`'s, run inside a
    program of the user's own, which reports its steps itself (a second
    watchdog would publish the same rank's heartbeats with other steps, and
    could act on a verdict before the trainer's writes its last step)."""
    if "script" not in _state and not _foreign():
        _report(step)


def _foreign() -> bool:
    found = stall.running()
    return found is not None and found is not _state.get("dog")


def watching() -> bool:
    """Whether this rank's watchdog, started here, runs (from the program's
    start-up or its first reported step), and no other took its place."""
    return _state.get("dog") is not None and not _foreign()


def watch_start_up() -> None:
    """Start this rank's watchdog before its first step (the program's process
    group exists), in start-up (ddpkit/preamble/startup.py); silent until the
    first step says it is on. Not where the script reports its own steps or
    ddpkit train's watchdog runs in the process."""
    if "dog" not in _state and "script" not in _state and not _foreign():
        _state["dog"] = _start()


def _report(step: int) -> None:
    _wd.progress(step)
    if "dog" not in _state:
        _state["dog"] = _start()
    dog = _state["dog"]
    if dog is not None and "said" not in _state:
        _state["said"] = None
        _say_on(dog)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """A block that is progress of another kind: "eval" or "checkpoint"."""
    with _wd.in_phase(_wd.Phase(name)):
        yield


def stop() -> None:
    """The script is done training (a finished rank is not a stalled one)."""
    dog = _state.get("dog")
    if dog is not None:
        dog.stop()


def metrics_file(env: Mapping[str, str]) -> Path | None:
    """Where the launcher has a program's metrics records appended (DDPKIT_METRICS), so the
    watchdog's stall and straggler records join them for `ddpkit report`; None where
    the launcher collects them from the job's output, where those records are already."""
    path = env.get(envnames.DDPKIT_METRICS)
    return Path(path) if path and not metrics_to_launcher(path) else None


def _start() -> stall.Watchdog | None:
    env = os.environ
    world = int(env.get(envnames.WORLD_SIZE, "1"))
    if world <= 1 or envnames.MASTER_ADDR not in env:
        return None  # one process, or not started by a launcher: nothing waits on it
    rank = int(env.get(envnames.RANK, "0"))
    local_world = int(env.get(envnames.LOCAL_WORLD_SIZE, str(world)))
    node = int(env.get(envnames.GROUP_RANK, str(rank // max(local_world, 1))))
    host = env.get(envnames.DDPKIT_HOSTNAME) or socket.gethostname()
    ident = stall.Identity(rank, world, local_world, node, host, os.getpid())
    settings = _wd.Settings.from_env()
    try:
        dog = stall.start(ident, env[envnames.MASTER_ADDR], int(env.get(envnames.MASTER_PORT, "29500")),
                          stall.Outputs(metrics=metrics_file(env)), settings)
    except Exception as exc:  # called from the program's own calls: never end the program for it
        print(f"ddpkit watchdog: rank {rank}: off, its store did not answer ({exc})", file=sys.stderr, flush=True)
        return None
    return dog


def _say_on(dog: stall.Watchdog) -> None:
    if dog.ident.rank == 0:
        print(f"ddpkit watchdog: on for this script: a rank without progress for {dog.settings.stall_s:g}s "
              f"stops the job (a rank still starting while the others wait: "
              f"{dog.settings.first_step_limit:g}s)", file=sys.stderr, flush=True)
