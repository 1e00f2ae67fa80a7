"""What a run folder's `run.json` and `events.jsonl` hold, as models (the
files are these models' JSON; docs/guides/runs.md shows them)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

from .. import records
from ..shared.exitcodes import ExitCode


class RunState(str, Enum):
    RUNNING = "running"
    PENDING = "pending"  # Slurm only: queued, not started (read from Slurm, never stored)
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # Shown, never stored: the record says running but its launcher is gone without recording its end
    # (killed with SIGKILL, its host rebooted).
    ABANDONED = "abandoned"
    RENDERED = "rendered"  # Kubernetes/compose files ddpkit wrote for kubectl or docker compose to run


class RunTarget(str, Enum):
    """Where a run runs, as its run folder records it and `ddpkit runs` shows
    it: one word per way ddpkit starts a job or hands it over, each the key of
    the one backend that follows the run after its launch
    (launch/control/backends/). `ddpkit render`'s words (targets.TARGETS) are
    four of them. The rank contract's rows (contract.RowKey) are finer: a
    Slurm run takes `slurm` or `slurm-srun` by its mode, a Kubernetes run its
    kind's row, and `launch docker`'s containers take compose's row, yet its
    run is docker's: its own launcher supervises it, as it does local's and
    ssh's, where a compose run is a file `docker compose` starts."""

    LOCAL = "local"  # launch local
    DOCKER = "docker"  # launch docker
    SSH = "ssh"  # launch ssh (render ssh: launch.sh, which records no run)
    SLURM = "slurm"  # submit slurm (render slurm: the script, which records no run)
    K8S = "k8s"  # render k8s: kubectl starts it
    COMPOSE = "compose"  # render compose: docker compose starts it

    def __str__(self) -> str:  # the word, wherever it is printed (an f-string, a table cell)
        return self.value


def state_for_code(code: int) -> RunState:
    """The stored end state of a launcher's run from its exit code: 130 is
    what every launcher exits with after Ctrl-C or SIGTERM (`ddpkit cancel`)."""
    if code == ExitCode.OK:
        return RunState.FINISHED
    return RunState.CANCELLED if code == ExitCode.INTERRUPTED else RunState.FAILED


class _Model(BaseModel):
    # A record written by a newer ddpkit may carry more: read what we know.
    model_config = ConfigDict(extra="ignore")


# The summary's exit-code cell of a node that ended without an exit status (a dropped connection, a removed
# container). Older run.json files say "lost" there, a word that now means only a node the watchdog found silent.
NO_EXIT_STATUS_CELL = "none"
_OLD_CELLS = {"lost": NO_EXIT_STATUS_CELL}


class NodeRow(_Model):
    """One row of the supervisor's summary table, as printed."""

    node: int
    exit_code: str  # "0", "130", NO_EXIT_STATUS_CELL, "-" (never started)
    status: str  # summary.SummaryStatus's words: "ok", "failed first", "stopped", ...
    host: str
    first_failure: str = ""
    straggler: str = ""  # the ranks of this node the watchdog named stragglers (launch/supervise/stragglers.py)

    @field_validator("exit_code")
    @classmethod
    def _current_word(cls, value: str) -> str:
        return _OLD_CELLS.get(value, value)


class RunSummary(_Model):
    """The supervisor's end-of-run summary: its table, closing line and the
    workers' cause lines, exactly as the launcher printed them."""

    title: str
    elapsed_s: float
    rows: list[NodeRow]
    closing: str
    causes: list[str] = []
    problems: list[str] = []


class NodeLog(_Model):
    """One node's log file. `rank_tagged`: worker lines carry torchrun's
    `[rank<R>]:` prefix (launch local), so `ddpkit logs --rank` can pick
    one rank's lines; otherwise it shows the node that holds the rank."""

    node: int
    host: str
    path: str
    rank_tagged: bool = False


class SlurmJob(_Model):
    """A submitted job: what `status`, `logs` and `cancel` ask Slurm about,
    and the grace chain's link `cancel` follows (spec.grace)."""

    job_id: int
    script: str
    output: str  # the job's output file (slurm.output resolved), which `logs` reads
    tasks_per_node: int  # srun --label numbers tasks; task t runs on node t // tasks_per_node
    rank_per_task: bool  # srun mode: task id == global rank
    signal: str  # preemption.signal, e.g. "USR2": sent to the batch shell first
    signal_grace_s: int  # the Slurm link of the grace chain: signal to scancel

    @property
    def records_folder(self) -> Path:
        """Where the job's nodes keep their records: the rendered script's
        DDPKIT_RECORDS, beside it in the folder it was submitted from."""
        script = Path(self.script)
        return records.slurm_folder(script.parent, script.stem, self.job_id)


class Applied(_Model):
    """Files `ddpkit render` wrote for another tool to run (`kubectl apply`,
    `docker compose up`): what `status` and `logs` ask that tool about."""

    tool: str  # "kubectl" or "compose"
    files: list[str]  # the files render wrote (when it wrote to stdout: their copies in the run folder)
    kind: str = ""  # kubectl: the job object's kind and API group, e.g. PyTorchJob, kubeflow.org
    group: str = ""
    object_name: str = ""
    namespace: str = ""
    project: str = ""  # compose: the project name (the file's `name:`)


class Launcher(_Model):
    """The process that owns a launch run. `start_ticks` (field 22 of
    /proc/<pid>/stat) tells a reused pid from the launcher itself."""

    pid: int
    host: str
    start_ticks: int | None = None


class RemoteRun(_Model):
    """Where a run detached onto another host lives (`launch ssh --detach`:
    its first host), as the machine that started it keeps it: this copy is a
    handle; `status`, `logs`, `cancel` ask the run folder there over SSH, as
    these settings reach it, and `report` reads the files copied back."""

    alias: str  # the host as the hostfile named it
    hostname: str
    port: int
    user: str
    identity_files: list[str] = []
    ssh_config: str | None = None  # the launch's --ssh-config, --known-hosts (None: the defaults)
    known_hosts: str | None = None
    python: str  # the interpreter that runs ddpkit there (command.python)
    runs_dir: str  # the runs root there, which holds the run's folder
    folder: str  # the run's folder there


class RunRecord(_Model):
    """run.json."""

    id: str
    name: str
    target: RunTarget
    nodes: int
    nproc_per_node: int
    started: float  # epoch seconds
    launcher: Launcher
    state: RunState = RunState.RUNNING
    stop_grace_s: float = 0.0  # how long the launcher's nodes get to stop after SIGTERM (spec.grace)
    logs: list[NodeLog] = []
    slurm: SlurmJob | None = None
    applied: Applied | None = None
    ended: float | None = None
    exit_code: int | None = None
    summary: RunSummary | None = None
    # --detach: the launcher is a supervisor in a session of its own (its console: console.log)
    detached: bool = False
    remote: RemoteRun | None = None  # a handle on a run that lives on another host (launch ssh --detach)

    @property
    def folder_name(self) -> str:
        return f"{self.name}-{self.id}"


class RunEvent(_Model):
    """One line of events.jsonl."""

    time: float
    # start or rendered (the first), detached (launch --detach: its supervisor's pid), files, submitted, preflight;
    # the supervisor's notes: failed first, failed,
    # lost, excluded, restart, interrupted, stall, straggler, preempted, stop; cancel (ddpkit cancel); exit (the last).
    kind: str
    detail: str = ""
    node: int | None = None
