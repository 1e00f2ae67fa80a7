"""The life of a run, as one backend per target answers for it, in the
shape of TorchX's Scheduler (schedule, describe, log_iter, cancel): what
state the run is in and where that came from, its logs, and how it is
stopped. Where the backend starts the run it schedules it too: Slurm's
(`Slurm.schedule`: sbatch; `Slurm.follow`: `submit --follow`). A launch's
own supervisor starts and watches a local, docker or ssh run (launch/);
the run folder holds what it recorded. The launcher that starts the run
(`launcher`) is not ddpkit's for a rendered job: ddpkit then names the
tool's command instead of running it. The backends whose logs are files
(`Launched`, `Slurm`) also give them as lines (`log_iter`), which `logs`
prints; a rendered job's logs are its tool's stream, printed as it comes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ....runs import RunRecord, RunState, StoredRun
from ..logs import LogRequest


@dataclass(frozen=True)
class Now:
    """A run's state as shown: from its record, its launcher's pid, Slurm,
    kubectl or docker compose."""

    state: RunState
    exit_code: int | None
    detail: str  # where the state came from, e.g. "Slurm RUNNING on node1,node2 (squeue)"
    ended: float | None


class RunBackend(Protocol):
    """One target's runs: local, docker and ssh (ddpkit's launcher), Slurm,
    Kubernetes (kubectl) and docker compose."""

    @property
    def launcher(self) -> str:
        """What starts its runs: `launch local`, `submit slurm`; for a rendered
        job the tool the files were rendered for (`kubectl`, `compose`)."""
        ...

    @property
    def rendered(self) -> bool:
        """ddpkit wrote files that another tool starts: it never saw the start."""
        ...

    def describe(self, run: StoredRun) -> Now:
        """The run's state now; a final state another tool reports is
        recorded in the run folder (Slurm forgets its jobs)."""
        ...

    def status_lines(self, run: StoredRun) -> list[str]:
        """`ddpkit status`'s lines after the folder: where the logs and files are."""
        ...

    def logs(self, run: StoredRun, request: LogRequest) -> int:
        """Print the run's logs (RunCommandError where they cannot be); the exit code."""
        ...

    def cancel(self, run: StoredRun, now: Now) -> int:
        """Stop the run so that its nodes checkpoint first; the exit code."""
        ...


def log_lines(rec: RunRecord) -> list[str]:
    """`status`'s line for each node log the run recorded."""
    return [f"log       node{log.node} {log.path}" for log in rec.logs]
