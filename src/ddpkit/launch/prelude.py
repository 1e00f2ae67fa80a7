"""What every launcher (launch local, docker, ssh; submit slurm) does first,
in one order: the job's trainer arguments checked, the target's refusals,
the spec's warnings, the secrets' values read from this environment. Each
check raises the input error its cli reports (exit 2) before anything is
written or started. Then the pieces each launcher takes when its own steps
come to them: the run folder, the console, the lines it prints."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..runs import RunFolder, RunTarget
from ..specfile import dump_yaml, warn_env
from ..targets.refusals import refuse
from ..train.argcheck import check_command
from .secrets import secret_values

if TYPE_CHECKING:
    from rich.console import Console

    from ..contract import Target
    from ..render import Rendered
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


def prelude(spec: JobSpec, who: str, target: Target | None, read_secrets: bool = True) -> Prelude:
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
