"""A launcher's `--detach`: the run's supervision in a process of its own
that outlives the terminal which started it (docs/guides/runs.md,
"A detached run").

The launching command does its first checks (the prelude: arguments,
refusals, secrets) and makes the run folder as an attached launch does, so
a refused job is refused on the terminal, with its exit code. Then it
starts the same launcher again as the run's supervisor, in a session of its
own (setsid: no controlling terminal, so closing the terminal sends it no
SIGHUP, and Ctrl-C in that terminal does not reach it), stdin from
/dev/null, stdout and stderr into the run folder's `console.log`, and
records that process as the run's launcher. It returns at once with the
run's name and how to follow it: `ddpkit status`, `logs --follow`,
`cancel` and `report` find the run by its name and reach its supervisor by
the recorded pid, as they reach an attached launcher. The supervisor writes
the run's end (state, exit code, summary) into run.json as an attached
launcher does, and its console (the summary and closing line) into
`console.log`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from ..exitcodes import ExitCode
from ..runs import RunFolder

# The supervisor's own flag: the run folder the launching command made, which it supervises.
SUPERVISE_FLAG = "--supervise-run"


def add_detach_arguments(parser: argparse.ArgumentParser) -> None:
    """--detach, and the supervisor's hidden --supervise-run FOLDER."""
    parser.add_argument("--detach", action="store_true",
                        help="return at once and keep supervising the job in a process of its own that outlives "
                             "this terminal (its console: the run folder's console.log); follow it with "
                             "`ddpkit logs RUN --follow`, stop it with `ddpkit cancel RUN`")
    parser.add_argument(SUPERVISE_FLAG, type=Path, metavar="FOLDER", help=argparse.SUPPRESS)


def supervised_run(args: argparse.Namespace) -> RunFolder | None:
    """The run folder this process supervises for a detached launch, if it is one."""
    folder: Path | None = getattr(args, "supervise_run", None)
    return None if folder is None else RunFolder(folder)


def detach(who: str, run: RunFolder, argv: list[str]) -> int:
    """Start `argv` (the launcher again, with SUPERVISE_FLAG and the run
    folder) as the run's supervisor in a session of its own, record it as
    the run's launcher and say how to follow it. `who`: the launcher's
    name, which the lines start with."""
    console = run.console_file
    with console.open("ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    rec = run.hand_over(proc.pid)
    run.event("detached", f"supervised by pid {proc.pid} in a session of its own; its console: {console}")
    print(f"{who}: run {run.path.name} detached: supervised by pid {proc.pid} on {rec.launcher.host}, "
          f"which outlives this terminal; its console: {console}", flush=True)
    print(f"{who}: follow it with `ddpkit logs {rec.id} --follow`; `ddpkit status {rec.id}`, "
          f"`ddpkit cancel {rec.id}`, `ddpkit report {rec.id}`", flush=True)
    return ExitCode.OK


def supervisor_argv(command: list[str], run: RunFolder, options: list[str]) -> list[str]:
    """The command line of a detached run's supervisor: the launcher's
    `command` words (`launch local`) with the run's own spec (as the
    launching command resolved it: the port it drew, the arguments after
    --) and folder, plus the launcher's `options` (grace, log folder, ...)."""
    return [sys.executable, "-m", "ddpkit.cli", *command, "-f", str(run.spec_file), SUPERVISE_FLAG, str(run.path),
            *options]


def absolute(path: Path | None) -> str | None:
    """A path the supervisor, which may start elsewhere, reads the same."""
    return None if path is None else os.path.abspath(path)
