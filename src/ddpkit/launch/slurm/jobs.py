"""What Slurm says about submitted jobs, read in one place: its job states
in a run's words, and the state of every job a command asks about, asked
once for them all (`SlurmQueue`; `queue_state` for one job, asked anew each
poll by `submit --follow`, `logs --follow` and `cancel`)."""

from __future__ import annotations

import subprocess
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from ...host import scontrol
from ...runs import RunState
from ...shared.exitcodes import ExitCode
from . import checks as slurm_checks

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED", "SPECIAL_EXIT"}
# Slurm's words for a job that has not started, or is starting, or is between runs.
QUEUED_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESV_DEL_HOLD",
                 "SUSPENDED"}


def is_final(slurm_state: str) -> bool:
    """Whether the job has ended (`CANCELLED by 0` counts: Slurm adds who)."""
    return slurm_state.split()[0] in FINAL_STATES if slurm_state else False


def exit_status(slurm_state: str, exit_code: str) -> int:
    """0 only for COMPLETED; otherwise the job's exit code, 128+signal, or FAILED."""
    if slurm_state == "COMPLETED":
        return ExitCode.OK
    code, _, sig = exit_code.partition(":")
    if code.isdigit() and int(code):
        return int(code)
    return 128 + int(sig) if sig.isdigit() and int(sig) else ExitCode.FAILED


def run_state(slurm_state: str) -> RunState:
    """A run folder's state for one of Slurm's job states."""
    word = slurm_state.split()[0] if slurm_state else ""
    if word == "COMPLETED":
        return RunState.FINISHED
    if word == "CANCELLED":
        return RunState.CANCELLED
    if word in FINAL_STATES:
        return RunState.FAILED
    return RunState.PENDING if word in QUEUED_STATES else RunState.RUNNING


def hostnames(nodelist: str) -> list[str]:
    if not nodelist or nodelist == "(null)":
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
    return scontrol.hostnames(out.stdout)


def _slurm(*words: str) -> str:
    """A Slurm command's output; "" where it failed (a job it does not know)."""
    out = subprocess.run(list(words), capture_output=True, text=True, check=False)
    return out.stdout.strip() if out.returncode == 0 else ""


# ---- every job a command shows, asked once -------------------------------------------


@dataclass(frozen=True)
class JobState:
    """One Slurm job's state as Slurm reports it: squeue while it is queued
    or running, then sacct or scontrol (`list_jobs`, the one reader). The
    node list stays compressed (`node[1-2]`): expanding it costs a
    subprocess, spent only where it is shown (`hostnames`)."""

    state: str
    exit_code: str
    nodelist: str
    source: str  # the command that listed it: squeue, sacct or scontrol
    reason: str = "None"
    restarts: int = 0  # how often Slurm requeued the job (squeue, scontrol; sacct lists the latest run)
    stdout: str | None = None  # the output file, its pattern filled in (squeue, scontrol)

    @property
    def hopeless(self) -> bool:
        """Pending for a reason that waiting cannot clear."""
        return self.state == "PENDING" and self.reason in slurm_checks.HOPELESS_REASONS

    @property
    def finished(self) -> bool:
        return is_final(self.state)

    @property
    def exit_status(self) -> int:
        return exit_status(self.state, self.exit_code)


def accounting() -> bool:
    """Whether the cluster keeps accounting (sacct answers for finished jobs)."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=False)
    storage = scontrol.config_value(out.stdout, "AccountingStorageType")
    return storage is not None and storage not in ("", "accounting_storage/none")


def _rows(text: str, width: int) -> Iterable[tuple[int, list[str]]]:
    """`JOBID|field|...` lines as (job id, the other fields); an array or
    heterogeneous job's id (`12_3`, `12+0`) is none of ddpkit's."""
    for line in text.splitlines():
        job, *rest = (line.split("|") + [""] * width)[:width + 1]
        if job.strip().isdigit():
            yield int(job), rest


# `-O` (not `-o`) for the restart count and the output file; `:|` ends each field with a
# pipe and leaves it unpadded and whole.
_SQUEUE_FIELDS = "JobID:|,State:|,Reason:|,NodeList:|,RestartCnt:|,STDOUT:|"


def _squeue(job_ids: Collection[int]) -> dict[int, JobState]:
    ids = ",".join(map(str, sorted(job_ids)))
    text = _slurm("squeue", "-h", "-j", ids, "-O", _SQUEUE_FIELDS)
    return {job: JobState(state, "", nodelist, "squeue", reason or "None", _count(restarts), stdout or None)
            for job, (state, reason, nodelist, restarts, stdout) in _rows(text, 5)}


def _count(text: str) -> int:
    return int(text) if text.strip().isdigit() else 0


def _sacct(job_ids: Collection[int]) -> dict[int, JobState]:
    """The last row of each job: a requeued job's latest run."""
    ids = ",".join(map(str, sorted(job_ids)))
    text = _slurm("sacct", "-n", "-X", "-P", "-j", ids, "-o", "JobID,State,ExitCode,NodeList")
    return {job: JobState(state, code, nodelist, "sacct") for job, (state, code, nodelist) in _rows(text, 3)}


def _scontrol(job_ids: Collection[int]) -> dict[int, JobState]:
    """`scontrol show job` takes one id: more are read from its list of every job it knows."""
    one = [str(j) for j in job_ids] if len(job_ids) == 1 else []
    text = _slurm("scontrol", "show", "job", "-o", *one)
    found = {}
    for line in text.splitlines():
        f = scontrol.fields(line)
        job = f.get("JobId", "")
        if job.isdigit() and int(job) in job_ids:
            found[int(job)] = JobState(f["JobState"], f.get("ExitCode", ""), f.get("NodeList", ""), "scontrol",
                                     f.get("Reason", "None"), _count(f.get("Restarts", "")), f.get("StdOut") or None)
    return found


def list_jobs(job_ids: Collection[int]) -> dict[int, JobState]:
    """Each job's state: squeue while it is queued or running; once it has
    left the queue, sacct when the cluster keeps accounting, else scontrol
    (which forgets a job MinJobAge after it ended). A job no source knows is
    left out. At most four commands, however many jobs: squeue, `scontrol
    show config`, sacct and `scontrol show job`, each once."""
    found = _squeue(job_ids) if job_ids else {}
    left = [j for j in job_ids if j not in found]
    if left and accounting():
        found |= _sacct(left)
        left = [j for j in left if j not in found]
    if left:
        found |= _scontrol(left)
    return found


class SlurmQueue:
    """The jobs one command shows, listed on the first question and kept for
    the call (`list_jobs`); a Slurm command missing here is raised again on
    every question (FileNotFoundError). `shows_nodes`: the command shows
    each job's nodes, worth a `scontrol show hostnames` per job."""

    def __init__(self, job_ids: Iterable[int], *, shows_nodes: bool = False) -> None:
        self.job_ids = frozenset(job_ids)
        self.shows_nodes = shows_nodes
        self._found: dict[int, JobState] | None = None
        self._missing: FileNotFoundError | None = None

    def asks(self, job_id: int) -> bool:
        """Whether the command asks Slurm about this job (`runs`: only the active ones)."""
        return job_id in self.job_ids

    def get(self, job_id: int) -> JobState | None:
        if self._missing is not None:
            raise self._missing
        if self._found is None:
            try:
                self._found = list_jobs(self.job_ids)
            except FileNotFoundError as exc:
                self._missing = exc
                raise
        return self._found.get(job_id)


def queue_state(job_id: int) -> JobState | None:
    """One job's state, asked now (a command that waits on it asks again each poll)."""
    return SlurmQueue([job_id]).get(job_id)
