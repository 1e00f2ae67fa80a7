"""A Slurm job's whole life, in the shape of TorchX's Scheduler: `schedule`
(sbatch, the job recorded in its run folder), `describe` (the command's
one batched query, launch/slurm/jobs.SlurmQueue; a final state is recorded
here and nowhere else), `log_iter` (its output file labelled by srun, the
same lines and prefixes for `logs` and `submit --follow`) and `cancel` as
pre-emption: the spec's signal to the batch shell first, as
`--signal=B:SIG@N` would send it before the time limit, so the trainer
checkpoints, then scancel once the job left its run or the Slurm link of
the grace chain is up. A run whose job is not recorded yet (the folder is
made before sbatch) is its submitting process's."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .... import records
from ....runs import RunFolder, RunState, RunTarget, SlurmJob, StoredRun
from ....shared.exitcodes import ExitCode
from ...slurm.follow import JobWatch
from ...slurm.jobs import JobState, SlurmQueue, hostnames, queue_state, run_state
from ..common import ACTIVE, POLL_S, RunCommandError, already_ended
from ..logs import LogRequest, log_iter, print_files, print_lines, slurm_source
from .base import Now, log_lines
from .launched import Launched

SLURM_END_S = 60.0  # scancel to a final state
SUBMITTING = Launched(RunTarget.SLURM)


class SbatchRefused(Exception):
    """sbatch did not take the job: its exit status and its own words."""

    def __init__(self, returncode: int, stderr: str) -> None:
        super().__init__(stderr)
        self.returncode = returncode
        self.stderr = stderr


@dataclass(frozen=True)
class Slurm:
    """`queue`: the jobs this command asks Slurm about, asked once."""

    queue: SlurmQueue = field(default_factory=lambda: SlurmQueue([]))
    launcher: str = "submit slurm"
    rendered: bool = False

    def schedule(self, folder: RunFolder, script: Path, job: SlurmJob) -> StoredRun:
        """sbatch the script from its folder, where the job's output lands
        (SbatchRefused when it does not take it); `job` is what ddpkit knows
        before sbatch, its output the spec's pattern. The job, recorded."""
        done = subprocess.run(["sbatch", "--parsable", script.name], cwd=script.parent,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SbatchRefused(done.returncode, done.stderr)
        sys.stderr.write(done.stderr)  # sbatch's warnings on a job it took
        job_id = int(done.stdout.strip().split(";")[0])
        try:
            found = queue_state(job_id)
        except FileNotFoundError:  # no squeue here (submit --no-check): the spec's pattern names the file
            found = None
        # Slurm's own name for the file, its pattern filled in; the spec's pattern where it
        # did not say (%j and %x filled in here). Relative to sbatch's folder: `logs` runs from anywhere.
        output = found.stdout if found is not None and found.stdout else job.output
        output = output.replace("%j", str(job_id)).replace("%x", folder.record().name).replace("%%", "%")
        out = Path(output) if Path(output).is_absolute() else script.parent / output
        folder.set_slurm(job.model_copy(update={"job_id": job_id, "script": str(script), "output": str(out)}))
        folder.event("submitted", f"Slurm job {job_id}")
        return StoredRun(folder, folder.record())

    def describe(self, run: StoredRun) -> Now:
        job = run.record.slurm
        if job is None:
            return SUBMITTING.describe(run)
        rec = run.record
        if not self.queue.asks(job.job_id):  # `runs`: a job recorded as ended is not asked about
            return Now(rec.state, rec.exit_code, f"Slurm job {job.job_id}", rec.ended)
        try:
            found = self.queue.get(job.job_id)
        except FileNotFoundError as exc:  # a host without Slurm's client: show what is recorded
            return Now(rec.state, rec.exit_code, f"Slurm job {job.job_id}: {exc.filename} is not installed here "
                                                 "(run this on a Slurm login node)", rec.ended)
        return _now(run, job, found, self.queue.shows_nodes)

    def status_lines(self, run: StoredRun) -> list[str]:
        job = run.record.slurm
        return ([] if job is None else [f"output    {job.output}", *record_lines(job)]) + log_lines(run.record)

    def log_iter(self, run: StoredRun, request: LogRequest,
                 active: Callable[[], bool] | None = None) -> Iterator[list[str]]:
        """The job's output lines a batch at a time, prefixed as the console
        prefixes them; with --follow until `active()` (by default: Slurm,
        asked each poll) says the job has ended."""
        job = run.record.slurm
        assert job is not None, "a job that sbatch took"
        source, _ = slurm_source(run.record, request)
        return log_iter([source], request, active or (lambda: _polled(run, job)[1].state in ACTIVE))

    def logs(self, run: StoredRun, request: LogRequest) -> int:
        job = run.record.slurm
        if job is None:
            return SUBMITTING.logs(run, request)
        source, note = slurm_source(run.record, request)
        return print_files([source], note, request, lambda: _polled(run, job)[1].state in ACTIVE)

    def follow(self, run: StoredRun) -> int:
        """`submit slurm --follow`: `logs --follow`'s lines on stdout, the
        job's state changes on stderr (JobWatch); the job's exit status."""
        job = run.record.slurm
        assert job is not None, "a job that sbatch took"
        watch = JobWatch(job.job_id)
        for lines in self.log_iter(run, LogRequest(follow=True), lambda: watch.seen(_polled(run, job)[0])):
            print_lines(lines)
        if watch.exit_status == ExitCode.PREFLIGHT:  # given up: its end (CANCELLED) is recorded once Slurm says so
            _polled(run, job)
        return watch.close()

    def cancel(self, run: StoredRun, now: Now) -> int:
        rec = run.folder.record()
        if rec.slurm is None:
            return SUBMITTING.cancel(run, now)
        if now.state not in ACTIVE:
            return already_ended(rec.id, now.state, now.exit_code)
        return _cancel(StoredRun(run.folder, rec), rec.slurm, now)


def _now(run: StoredRun, job: SlurmJob, found: JobState | None, with_nodes: bool) -> Now:
    """The run's state from Slurm's listing; a final one is recorded in the
    run folder (only here: Slurm forgets the job after MinJobAge, the
    record does not)."""
    rec = run.record
    if found is None:
        return Now(rec.state, rec.exit_code, f"Slurm job {job.job_id}: unknown to squeue, sacct and scontrol",
                   rec.ended)
    detail = _detail(found, with_nodes)
    shown = run_state(found.state)
    if not found.finished:
        return Now(shown, None, detail, None)
    if rec.state in ACTIVE:
        try:
            rec = run.folder.finish(found.exit_status, state=shown)
        except OSError:  # someone else's run folder: show the state, keep nothing
            return Now(shown, found.exit_status, detail, None)
    return Now(rec.state, rec.exit_code, detail, rec.ended)


def _polled(run: StoredRun, job: SlurmJob) -> tuple[JobState | None, Now]:
    """Slurm asked anew and the record read anew: a command that waits on
    the job (a follower, cancel) polls."""
    found = queue_state(job.job_id)
    return found, _now(StoredRun(run.folder, run.folder.record()), job, found, False)


def record_lines(job: SlurmJob) -> list[str]:
    """What the job's records say: where they are, and each stop (its signal,
    step and checkpoint, per run of a requeued job)."""
    folder = job.records_folder
    found = records.read_folder(folder)
    if not found:
        return [f"records   {folder} (none)"]
    kinds = sorted({s.record.kind for s in found})
    out = [f"records   {folder} ({len(found)}: {', '.join(kinds)})"]
    stops = {(s.record.slurm_restart_count, s.record.step, s.record.signal, s.record.checkpoint)
             for s in found if isinstance(s.record, records.Stop)}
    for restarts, step, signal, checkpoint in sorted(stops, key=lambda t: (t[0], t[1])):
        saved = f"checkpoint at step {step}" if checkpoint else "no checkpoint"
        out.append(f"stopped   run {restarts + 1}: {signal or 'a stop'} at step {step}, {saved}")
    return out


def queue_for(runs: list[StoredRun], *, ended_too: bool = True, shows_nodes: bool = False) -> SlurmQueue:
    """The Slurm jobs of these runs, to be asked about once: every one, or
    (`ended_too` False: `ddpkit runs`) those still active in their record,
    whose end the record keeps once Slurm has forgotten the job."""
    return SlurmQueue([r.record.slurm.job_id for r in runs
                       if r.record.slurm is not None and (ended_too or r.record.state in ACTIVE)],
                      shows_nodes=shows_nodes)


def _detail(found: JobState, with_nodes: bool) -> str:
    detail = f"Slurm {found.state}"
    if found.state == "PENDING":
        detail += f" ({found.reason})"
    nodes = hostnames(found.nodelist) if with_nodes else []
    if nodes:
        detail += f" on {','.join(nodes)}"
    return detail + f" ({found.source})"


def _scancel(*words: str) -> None:
    done = subprocess.run(["scancel", *words], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RunCommandError(f"scancel {' '.join(words)}: {done.stderr.strip() or f'exit {done.returncode}'}",
                              ExitCode.FAILED)


def _cancel(run: StoredRun, job: SlurmJob, now: Now) -> int:
    if now.state == RunState.RUNNING:
        _checkpoint_first(run, job)
    else:
        run.folder.event("cancel", "ddpkit cancel: scancel (the job never started: nothing to checkpoint)")
    final = _scancel_until_final(job.job_id)
    if final is None:
        raise RunCommandError(f"Slurm job {job.job_id} did not reach a final state within {SLURM_END_S:g} s of "
                              f"scancel; see `ddpkit status {job.job_id}`", ExitCode.FAILED)
    state = run_state(final.state)
    _now(StoredRun(run.folder, run.folder.record()), job, final, False)  # the end, recorded
    print(f"ddpkit cancel: Slurm job {job.job_id} {final.state} (run {run.record.id} {state.value})")
    return ExitCode.OK if state == RunState.CANCELLED else ExitCode.FAILED


def _checkpoint_first(run: StoredRun, job: SlurmJob) -> None:
    """What --signal=B:SIG@N delivers before the time limit: the batch shell
    forwards it to the step and the trainer checkpoints
    (templates/slurm/job.sbatch.j2); waited on until the job leaves its run."""
    run.folder.event("cancel", f"ddpkit cancel: SIG{job.signal} to the batch shell, scancel after at most "
                               f"{job.signal_grace_s} s")
    _scancel("--batch", f"--signal={job.signal}", str(job.job_id))
    print(f"ddpkit cancel: sent SIG{job.signal} to Slurm job {job.job_id}'s batch shell (its checkpoint signal); "
          f"scancel once it stops, at most {job.signal_grace_s} s from now", flush=True)
    deadline = time.monotonic() + job.signal_grace_s
    while time.monotonic() < deadline:
        found = queue_state(job.job_id)
        if found is None or found.state not in ("RUNNING", "COMPLETING"):
            # Checkpointed and requeued (or ended): nothing more to wait for.
            left = "unknown to Slurm" if found is None else found.state
            run.folder.event("preempted", f"the job left its run after SIG{job.signal}: {left}")
            return
        time.sleep(POLL_S)
    run.folder.event("stop", f"still running {job.signal_grace_s} s after SIG{job.signal}: scancel")


def _scancel_until_final(job_id: int) -> JobState | None:
    found = queue_state(job_id)
    if found is not None and found.finished:
        return found
    _scancel(str(job_id))
    deadline = time.monotonic() + SLURM_END_S
    while time.monotonic() < deadline:
        found = queue_state(job_id)
        if found is not None and found.finished:
            return found
        time.sleep(POLL_S)
    return None
