"""`ddpkit runs`, `status RUN`, `logs RUN`, `cancel RUN`: the life cycle of
the runs that `launch local|docker|ssh` and `submit slurm` recorded
(ddpkit.runs owns the folders; this module asks the launcher or Slurm).

RUN is a run id (or its folder's name), a job name (its latest run) or a
Slurm job id. A launch run's launcher is stopped the way Ctrl-C stops it
(SIGTERM: launch/supervise/interrupt.py), so it stops its nodes with the grace chain's
time to checkpoint and records the run as cancelled. A Slurm job first gets
the spec's pre-emption signal in its batch shell, as `--signal=B:SIG@N` would
send it before the time limit, then scancel once the job left its run or the
Slurm link of the grace chain is up. docs/RUNS.md."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ... import envnames
from ...exitcodes import ExitCode
from ...runs import RunRecord, RunState, StoredRun, all_runs, launcher_alive, resolve, shown_state
from ...text import plural
from ..slurm import submit as submit_slurm
from ..supervise import proctree
from ..supervise.summary import summary_table
from . import applied
from .common import Command, RunCommandError, one_line
from .logs import sources

if TYPE_CHECKING:
    from rich.console import Console

POLL_S = 0.5
STOP_MARGIN_S = 60.0  # beyond the nodes' grace: the launcher's own teardown and summary
SLURM_END_S = 60.0  # scancel to a final state
ACTIVE = (RunState.RUNNING, RunState.PENDING)


# ---- the state a run is in now ------------------------------------------------------


@dataclass(frozen=True)
class Live:
    """A run's state as shown: the record, the launcher's pid, or Slurm."""

    state: RunState
    exit_code: int | None
    detail: str  # where the state came from, e.g. "Slurm RUNNING on node1,node2 (squeue)"
    ended: float | None


def live(run: StoredRun, *, ask_slurm: bool = True) -> Live:
    """ask_slurm: also for a run recorded as ended (`status` shows where Slurm's
    word comes from); `runs` asks only about the runs still active."""
    rec = run.record
    if rec.applied is not None:
        return _applied_live(rec)
    if rec.slurm is None or not ask_slurm:
        return _launch_live(rec)
    try:
        found = submit_slurm.queue_state(rec.slurm.job_id)
    except FileNotFoundError as exc:  # listing runs on a host without Slurm's client: show what is recorded
        return Live(rec.state, rec.exit_code, f"Slurm job {rec.slurm.job_id}: {exc.filename} is not installed here "
                                              "(run this on a Slurm login node)", rec.ended)
    if found is None:
        return Live(rec.state, rec.exit_code, f"Slurm job {rec.slurm.job_id}: unknown to squeue, sacct and scontrol",
                    rec.ended)
    state, source = found
    detail = f"Slurm {state.state}"
    if state.state == "PENDING":
        detail += f" ({state.reason})"
    if state.nodes:
        detail += f" on {','.join(state.nodes)}"
    detail += f" ({source})"
    shown = submit_slurm.run_state(state.state)
    if state.finished:
        if rec.state in ACTIVE:  # kept: Slurm forgets the job (MinJobAge), the record does not
            try:
                run.folder.finish(state.exit_status, state=shown)
                rec = run.folder.record()
            except OSError:  # someone else's run folder: show the state, keep nothing
                return Live(shown, state.exit_status, detail, None)
        return Live(rec.state, rec.exit_code, detail, rec.ended)
    return Live(shown, None, detail, None)


def _launch_live(rec: RunRecord) -> Live:
    state = shown_state(rec)
    where = f"pid {rec.launcher.pid} on {rec.launcher.host}"
    if rec.slurm is not None:
        where = f"Slurm job {rec.slurm.job_id}"
    elif state == RunState.LOST:
        where += ": gone without recording its end (killed?)"
    elif state == RunState.RUNNING and launcher_alive(rec) is None:
        where += " (another host: this one cannot see it)"
    return Live(state, rec.exit_code, f"launcher {where}" if rec.slurm is None else where, rec.ended)


def _applied_live(rec: RunRecord) -> Live:
    """A rendered job: kubectl or docker compose knows its state."""
    try:
        now = applied.state(rec)
    except applied.ToolMissing as exc:
        return Live(RunState.RENDERED, None, f"{rec.applied and rec.applied.tool} is not installed here; "
                                             f"where it is: {exc}", None)
    return Live(now.state, now.exit_code, now.detail, None)


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def _took(rec: RunRecord, now: Live) -> str:
    if rec.applied is not None:  # started by kubectl or docker compose, at a time ddpkit never saw
        return "-"
    if now.ended is not None:
        return f"{now.ended - rec.started:.1f}s"
    return f"{time.time() - rec.started:.0f}s so far" if now.state in ACTIVE else "-"


STATE_STYLE = {RunState.RUNNING: "cyan", RunState.PENDING: "yellow", RunState.FINISHED: "green",
               RunState.FAILED: "red", RunState.CANCELLED: "yellow", RunState.LOST: "bold red",
               RunState.RENDERED: "blue"}


def _console() -> Console:
    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


# ---- ddpkit runs ----------------------------------------------------------------------


def _add_runs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", help="only the runs of this job")
    parser.add_argument("-n", "--last", type=int, metavar="N", help="only the newest N runs")


def _runs(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from ...runs import runs_root

    found = [r for r in all_runs() if args.name is None or r.record.name == args.name]
    if args.last is not None:
        found = found[:max(args.last, 0)]
    console = _console()
    if not found:
        console.print(f"no runs in {runs_root()}", markup=False)
        return ExitCode.OK
    table = Table(title=f"runs in {runs_root()}, newest first", title_justify="left")
    for column in ("run", "name", "target", "state", "nodes", "start", "duration", "exit"):
        table.add_column(column, overflow="fold")
    for run in found:
        rec = run.record
        now = live(run, ask_slurm=rec.state in ACTIVE)
        table.add_row(rec.id, rec.name, rec.target, Text(now.state.value, style=STATE_STYLE[now.state]),
                      f"{rec.nodes}x{rec.nproc_per_node}", _when(rec.started), _took(rec, now),
                      "-" if now.exit_code is None else str(now.exit_code))
    console.print(table)
    return ExitCode.OK


# ---- ddpkit status RUN ------------------------------------------------------------------


def _add_run_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="a run id, a job name (its latest run) or a Slurm job id")


def _status(args: argparse.Namespace) -> int:
    from rich.text import Text

    run = resolve(args.run)
    rec, now = run.record, live(run)
    console = _console()
    exit_text = "" if now.exit_code is None else f", exit code {now.exit_code}"
    console.print(Text.assemble(f"run {rec.id}: ", (now.state.value, STATE_STYLE[now.state]), exit_text))
    lines = [f"job       {rec.name}, {rec.target}: {plural(rec.nodes, 'node')} x {plural(rec.nproc_per_node, 'process')}",
             f"rendered  {_when(rec.started)}" if rec.applied else f"started   {_when(rec.started)}, {_took(rec, now)}",
             f"where     {now.detail}",
             f"folder    {run.folder.path}"]
    if rec.slurm is not None:
        lines.append(f"output    {rec.slurm.output}")
    lines += [f"log       node{log.node} {log.path}" for log in rec.logs]
    lines += [f"file      {f}" for f in (rec.applied.files if rec.applied else [])]
    for line in lines:
        console.print(line, markup=False, soft_wrap=True)  # a path or a command stays on one line
    events = run.folder.events()
    if events:
        console.print("events", markup=False)
        for ev in events[-10:]:
            node = "" if ev.node is None else f" node{ev.node}"
            console.print(f"  {time.strftime('%H:%M:%S', time.localtime(ev.time))} {ev.kind}{node}: {ev.detail}",
                          markup=False)
    if rec.summary is not None:
        console.print(summary_table(rec.summary))
        console.print(Text(rec.summary.closing, style="bold red" if rec.exit_code else "green"))
    return ExitCode.OK


# ---- ddpkit logs RUN --------------------------------------------------------------------


def _add_logs(parser: argparse.ArgumentParser) -> None:
    _add_run_arg(parser)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--node", type=int, metavar="N", help="only node N's log")
    which.add_argument("--rank", type=int, metavar="R", help="only global rank R's lines")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the run ends")
    parser.add_argument("--tail", type=int, metavar="N", help="only the last N lines (of each node)")



def _logs(args: argparse.Namespace) -> int:
    run = resolve(args.run)
    rec = run.record
    if rec.applied is not None:
        return _applied_logs(rec, args)
    found, note = sources(rec, args.node, args.rank)
    if note:
        print(f"ddpkit logs: {note}", file=sys.stderr)
    missing = [s.path for s in found if not s.path.exists()]
    if missing and not args.follow:
        print(f"ddpkit logs: no log yet at {', '.join(map(str, missing))}", file=sys.stderr)
    for source in found:
        lines = source.read()
        if not args.follow:
            lines += source.rest()
        if args.tail is not None:
            lines = lines[-args.tail:] if args.tail > 0 else []
        _out(lines)
    if not args.follow:
        return ExitCode.OK
    while True:
        ended = live(resolve(rec.id)).state not in ACTIVE  # read before the files: no line is missed
        for source in found:
            _out(source.read() + (source.rest() if ended else []))
        if ended:
            return ExitCode.OK
        time.sleep(POLL_S)


def _out(lines: list[str]) -> None:
    if lines:
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()


def _applied_logs(rec: RunRecord, args: argparse.Namespace) -> int:
    """kubectl logs or docker compose logs, run here or named: a pod or a
    container holds a node, so --rank shows the node that holds the rank."""
    world = rec.nodes * rec.nproc_per_node
    if args.rank is not None and not 0 <= args.rank < world:
        raise RunCommandError(f"--rank {args.rank}: run {rec.id} has ranks 0-{world - 1}")
    if args.node is not None and not 0 <= args.node < rec.nodes:
        raise RunCommandError(f"--node {args.node}: run {rec.id} has nodes 0-{rec.nodes - 1}")
    node = args.node if args.rank is None else args.rank // rec.nproc_per_node
    if args.rank is not None:
        print(f"ddpkit logs: a pod or container holds a node; showing node {node}, which holds rank {args.rank}",
              file=sys.stderr)
    words, here = applied.logs_command(rec, node, args.tail, args.follow)
    if not here:
        raise RunCommandError(f"{words[0]} is not installed here; where it is, run: {shlex.join(words)}",
                              ExitCode.PREFLIGHT)
    return ExitCode.OK if subprocess.run(words, check=False).returncode == 0 else ExitCode.FAILED


# ---- ddpkit cancel RUN ------------------------------------------------------------------


def _cancel(args: argparse.Namespace) -> int:
    run = resolve(args.run)
    now = live(run)
    rec = run.folder.record()
    if rec.applied is not None:
        raise RunCommandError(f"run {rec.id} was rendered for {rec.applied.tool}, which started it, not ddpkit; "
                              f"stop it with: {applied.cancel_command(rec)}")
    if now.state == RunState.LOST and rec.target == "local":
        return _cancel_leftovers(run)
    if now.state not in ACTIVE:
        print(f"ddpkit cancel: run {rec.id} has already ended: {now.state.value}"
              + ("" if now.exit_code is None else f", exit code {now.exit_code}"))
        return ExitCode.OK if now.state != RunState.LOST else ExitCode.FAILED
    if rec.slurm is not None:
        return _cancel_slurm(run, now)
    return _cancel_launch(run)


def _cancel_launch(run: StoredRun) -> int:
    rec = run.record
    alive = launcher_alive(rec)
    if alive is None:
        raise RunCommandError(f"run {rec.id}'s launcher runs on {rec.launcher.host} (pid {rec.launcher.pid}); "
                              f"run `ddpkit cancel {rec.id}` there")
    run.folder.event("cancel", f"ddpkit cancel: SIGTERM to the launcher (pid {rec.launcher.pid})")
    try:
        # What Ctrl-C does: the supervisor stops every node with the grace chain's launcher grace.
        os.kill(rec.launcher.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    print(f"ddpkit cancel: sent SIGTERM to launcher pid {rec.launcher.pid} of run {rec.id}; its nodes get "
          f"{rec.stop_grace_s:g} s to checkpoint and stop", flush=True)
    deadline = time.monotonic() + rec.stop_grace_s + STOP_MARGIN_S
    while launcher_alive(rec) and time.monotonic() < deadline:
        time.sleep(0.1)
    if launcher_alive(rec):
        raise RunCommandError(f"run {rec.id}'s launcher (pid {rec.launcher.pid}) is still running "
                              f"{rec.stop_grace_s + STOP_MARGIN_S:g} s after SIGTERM; see `ddpkit status {rec.id}`",
                              ExitCode.FAILED)
    after = run.folder.record()
    state = shown_state(after)
    print(f"ddpkit cancel: run {rec.id} {state.value}"
          + ("" if after.exit_code is None else f" (launcher exit code {after.exit_code})"))
    return ExitCode.OK if state == RunState.CANCELLED else ExitCode.FAILED


def _cancel_leftovers(run: StoredRun) -> int:
    """A launch local run whose launcher died (SIGKILL, the OOM killer) leaves
    its torchrun agents and workers running, each in a session of its own:
    they are found by the run id in their environment and stopped as the
    launcher would have (TERM, the grace, KILL)."""
    rec = run.record
    left = proctree.with_env(envnames.DDPKIT_RUN_ID, rec.id)
    if not left:
        print(f"ddpkit cancel: run {rec.id} has already ended: lost (its launcher is gone and left nothing running)")
        return ExitCode.FAILED
    run.folder.event("cancel", f"ddpkit cancel: the launcher is gone; SIGTERM to the {len(left)} processes it left")
    print(f"ddpkit cancel: run {rec.id}'s launcher (pid {rec.launcher.pid}) is gone; stopping the {len(left)} "
          f"processes it left running (SIGTERM, SIGKILL after {rec.stop_grace_s:g} s)", flush=True)
    proctree.signal_all(left, signal.SIGTERM)
    # Polled by the environment, not the pids: an ended process awaiting its
    # (new) parent's wait() has none, and must not hold up the stop.
    deadline = time.monotonic() + rec.stop_grace_s
    while proctree.with_env(envnames.DDPKIT_RUN_ID, rec.id) and time.monotonic() < deadline:
        time.sleep(0.1)
    proctree.signal_all(proctree.with_env(envnames.DDPKIT_RUN_ID, rec.id), signal.SIGKILL)
    run.folder.finish(None, state=RunState.CANCELLED)
    print(f"ddpkit cancel: run {rec.id} cancelled (its launcher was lost; no exit code)")
    return ExitCode.OK


def _scancel(*words: str) -> None:
    done = subprocess.run(["scancel", *words], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RunCommandError(f"scancel {' '.join(words)}: {done.stderr.strip() or f'exit {done.returncode}'}",
                              ExitCode.FAILED)


def _cancel_slurm(run: StoredRun, now: Live) -> int:
    rec = run.record
    assert rec.slurm is not None
    job = rec.slurm
    if now.state == RunState.RUNNING:
        # What --signal=B:SIG@N delivers before the time limit: the batch shell forwards it
        # to the step and the trainer checkpoints (templates/slurm/job.sbatch.j2).
        run.folder.event("cancel", f"ddpkit cancel: SIG{job.signal} to the batch shell, scancel after at most "
                                   f"{job.signal_grace_s} s")
        _scancel("--batch", f"--signal={job.signal}", str(job.job_id))
        print(f"ddpkit cancel: sent SIG{job.signal} to Slurm job {job.job_id}'s batch shell (its checkpoint signal); "
              f"scancel once it stops, at most {job.signal_grace_s} s from now", flush=True)
        deadline = time.monotonic() + job.signal_grace_s
        while time.monotonic() < deadline:
            found = submit_slurm.queue_state(job.job_id)
            if found is None or found[0].state not in ("RUNNING", "COMPLETING"):
                # Checkpointed and requeued (or ended): nothing more to wait for.
                left = "unknown to Slurm" if found is None else found[0].state
                run.folder.event("preempted", f"the job left its run after SIG{job.signal}: {left}")
                break
            time.sleep(POLL_S)
        else:
            run.folder.event("stop", f"still running {job.signal_grace_s} s after SIG{job.signal}: scancel")
    else:
        run.folder.event("cancel", "ddpkit cancel: scancel (the job never started: nothing to checkpoint)")
    final = _scancel_until_final(job.job_id)
    if final is None:
        raise RunCommandError(f"Slurm job {job.job_id} did not reach a final state within {SLURM_END_S:g} s of "
                              f"scancel; see `ddpkit status {job.job_id}`", ExitCode.FAILED)
    state = submit_slurm.run_state(final.state)
    run.folder.finish(final.exit_status, state=state)
    print(f"ddpkit cancel: Slurm job {job.job_id} {final.state} (run {rec.id} {state.value})")
    return ExitCode.OK if state == RunState.CANCELLED else ExitCode.FAILED


def _scancel_until_final(job_id: int) -> submit_slurm.JobState | None:
    found = submit_slurm.queue_state(job_id)
    if found is not None and found[0].finished:
        return found[0]
    _scancel(str(job_id))
    deadline = time.monotonic() + SLURM_END_S
    while time.monotonic() < deadline:
        found = submit_slurm.queue_state(job_id)
        if found is not None and found[0].finished:
            return found[0]
        time.sleep(POLL_S)
    return None


RUNS = Command(_add_runs, one_line("runs", _runs))
STATUS = Command(_add_run_arg, one_line("status", _status))
LOGS = Command(_add_logs, one_line("logs", _logs))
CANCEL = Command(_add_run_arg, one_line("cancel", _cancel))
