"""What every launcher (launch local, docker, ssh; submit slurm) does first,
in one order: the job's trainer arguments checked, the target's refusals,
the spec's warnings, the secrets' values read from this environment. Each
check raises the input error its cli reports (exit 2) before anything is
written or started. Then the pieces each launcher takes when its own steps
come to them: the run folder, the console, the lines it prints.

A launcher's `--detach` arguments are here too, with what its detached
supervisor does first: a stop signal (`ddpkit cancel`) that comes before
the supervisor's own handlers are installed is held, not lost, and acted on
when its first node starts (`hold_stop_signals`, `replay_held_stop`); and
the supervisor tells the command that started it that it is ready
(`say_ready`), which returns only then."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from ..runs import RunFolder, RunTarget
from ..spec.yamlfile import dump_yaml, warn_env
from ..targets.refusals import refuse
from ..train.argcheck import check_command
from .secrets import secret_values

if TYPE_CHECKING:
    from rich.console import Console

    from ..contract import RowKey
    from ..render.engine import Rendered
    from ..spec import JobSpec


@dataclass(frozen=True)
class Prelude:
    """A job that passed the prelude, and what its launcher needs of it."""

    spec: JobSpec
    who: str  # what the launcher's lines start with, e.g. "launch local"
    # The secrets' values (launch/secrets.py), in the spec's order; empty when not read (a dry run).
    secrets: dict[str, str] = field(repr=False)

    def run_folder(self, target: RunTarget, nodes: int | None = None, rendered: Rendered | None = None) -> RunFolder:
        """The run's folder (`ddpkit runs`), made now; `nodes`: when the
        launcher counts them itself (launch ssh: the hosts); `rendered`: the
        files it hands a scheduler (submit slurm: the script), kept there too.
        The nodes' time to stop that it records: Slurm's signal before the
        job's end for a Slurm job, the launcher's grace for the others."""
        spec = self.spec
        grace = spec.grace.slurm_signal_s if target == RunTarget.SLURM else spec.grace.launcher_grace_s
        run = RunFolder.create(name=spec.name, target=target, nodes=spec.nodes if nodes is None else nodes,
                               nproc_per_node=spec.nproc_per_node, spec_yaml=dump_yaml(spec), stop_grace_s=grace)
        if rendered is not None:
            rendered.write(run.rendered_dir)
        return run

    def run_line(self, run: RunFolder) -> str:
        """The line naming the run and how to ask about it."""
        return f"{self.who}: run {run.path.name} (ddpkit status {run.record().id})"

    @property
    def note_line(self) -> str | None:
        """The watchdog's start-up note on a script with its progress off, if any."""
        note = self.spec.watchdog.script_note(self.spec.command, self.spec.preamble.progress)
        return None if note is None else f"{self.who}: {note}"


def prelude(spec: JobSpec, who: str, target: RowKey | None, read_secrets: bool = True) -> Prelude:
    """The checks every launcher makes first. `target`: whose refusals apply;
    None where the launcher renders the job, and rendering refuses it (submit
    slurm). `read_secrets` False: a dry run, which sends no value."""
    check_command(spec.command.module, spec.command.args)
    if target is not None:
        refuse(spec, target)
    warn_env(spec, who)
    return Prelude(spec, who, secret_values(spec, who) if read_secrets else {})


def make_console(stderr: bool = False) -> Console:
    """A console on stdout (node output) or stderr: no highlighting, and
    160 columns when it is not a terminal (a log, a pipe)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, highlight=False, width=None if stream.isatty() else 160)


# ---- --detach -------------------------------------------------------------------------

# The supervisor's own flags: the run folder the launching command made, which it supervises, and the
# descriptor it says it is ready on (detach.py, launch/ssh/detached.py).
SUPERVISE_FLAG = "--supervise-run"
READY_FLAG = "--ready-fd"
READY = "ready"  # the word a detached supervisor writes on its ready descriptor, with its pid
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def add_detach_arguments(parser: argparse.ArgumentParser, where: str = "a process of its own") -> None:
    """--detach, and the supervisor's hidden --supervise-run FOLDER and --ready-fd N."""
    parser.add_argument("--detach", action="store_true",
                        help=f"return once the job's supervisor runs in {where}, which outlives this terminal "
                             "(its console: the run folder's console.log); follow it with "
                             "`ddpkit logs RUN --follow`, stop it with `ddpkit cancel RUN`")
    parser.add_argument(SUPERVISE_FLAG, type=Path, metavar="FOLDER", help=argparse.SUPPRESS)
    parser.add_argument(READY_FLAG, type=int, metavar="FD", help=argparse.SUPPRESS)


def supervised_run(args: argparse.Namespace) -> RunFolder | None:
    """The run folder this process supervises for a detached launch, if it is one."""
    folder: Path | None = getattr(args, "supervise_run", None)
    return None if folder is None else RunFolder(folder)


def supervisor_argv(command: list[str], run: RunFolder, options: list[str]) -> list[str]:
    """The command line of a detached run's supervisor: the launcher's
    `command` words (`launch local`) with the run's own spec (as the
    launching command resolved it: the port it drew, the arguments after
    --) and folder, plus the launcher's `options` (grace, log folder, ...)."""
    return [sys.executable, "-m", "ddpkit.cli", *command, "-f", str(run.spec_file), SUPERVISE_FLAG, str(run.path),
            *options]


_held: list[int] = []  # the stop signals a detached supervisor got before its first node started


def _hold(signum: int, frame: FrameType | None) -> None:
    _held.append(signum)


def hold_stop_signals() -> None:
    """A detached supervisor's first step: SIGINT and SIGTERM are noted, not
    fatal, until its first node starts (`replay_held_stop`); they may have
    been blocked since before its start (detach.py), and are let through now.
    A handler, not a blocked mask, from here on: the processes it starts
    get the default action back, as exec gives every caught signal."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _hold)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def replay_held_stop() -> None:
    """Called as a node starts, inside the supervisor's own handlers: a stop
    signal that came before them stops the run now, as it would have then."""
    if _held:
        _held.clear()
        raise KeyboardInterrupt


def say_ready(fd: int | None) -> None:
    """Tell the launching command that this supervisor handles stop signals
    (and, for launch ssh, that every host passed its preflight): the word and
    this pid on `fd`, which is then closed (its reader sees the end)."""
    if fd is None:
        return
    try:
        os.write(fd, f"{READY} {os.getpid()}\n".encode())
    except OSError:
        pass  # the launching command is gone: the run goes on without it
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
