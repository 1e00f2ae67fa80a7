"""`ddpkit runs`, `status RUN`, `logs RUN`, `cancel RUN`: the life cycle of
the runs that `launch local|docker|ssh`, `submit slurm` and `render
k8s|compose` recorded (ddpkit.runs owns the folders). Each command finds
the run and asks its target's backend (backends/): the launcher's pid,
Slurm (one batched query for every job the command shows), kubectl or
docker compose.

RUN is a run id (or its folder's name), a job name (its latest run) or a
Slurm job id. docs/guides/runs.md."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from ...runs import RunRecord, RunState, StoredRun, all_runs, resolve
from ...shared.exitcodes import ExitCode
from ...shared.wording import plural
from ..supervise.summary import summary_table
from .backends import Backends, Now, RunBackend
from .backends.slurm import queue_for
from .common import ACTIVE, ControlCommand, one_line
from .logs import LogRequest

if TYPE_CHECKING:
    from rich.console import Console

STATE_STYLE = {RunState.RUNNING: "cyan", RunState.PENDING: "yellow", RunState.FINISHED: "green",
               RunState.FAILED: "red", RunState.CANCELLED: "yellow", RunState.ABANDONED: "bold red",
               RunState.RENDERED: "blue"}


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def _took(rec: RunRecord, backend: RunBackend, now: Now) -> str:
    if backend.rendered:  # started by kubectl or docker compose, at a time ddpkit never saw
        return "-"
    if now.ended is not None:
        return f"{now.ended - rec.started:.1f}s"
    return f"{time.time() - rec.started:.0f}s so far" if now.state in ACTIVE else "-"


def _console() -> Console:
    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _one(text: str, *, shows_nodes: bool = False) -> tuple[StoredRun, RunBackend]:
    """The run RUN names, and its backend."""
    run = resolve(text)
    return run, Backends(queue_for([run], shows_nodes=shows_nodes)).of(run)


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
    # Slurm is asked once for every run still active in its record; an ended one's record is kept.
    backends = Backends(queue_for(found, ended_too=False))
    for run in found:
        rec, backend = run.record, backends.of(run)
        now = backend.describe(run)
        table.add_row(rec.id, rec.name, rec.target, Text(now.state.value, style=STATE_STYLE[now.state]),
                      f"{rec.nodes}x{rec.nproc_per_node}", _when(rec.started), _took(rec, backend, now),
                      "-" if now.exit_code is None else str(now.exit_code))
    console.print(table)
    return ExitCode.OK


# ---- ddpkit status RUN ------------------------------------------------------------------


def _add_run_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="a run id, a job name (its latest run) or a Slurm job id")


def _status(args: argparse.Namespace) -> int:
    from rich.text import Text

    run, backend = _one(args.run, shows_nodes=True)
    rec, now = run.record, backend.describe(run)
    console = _console()
    exit_text = "" if now.exit_code is None else f", exit code {now.exit_code}"
    console.print(Text.assemble(f"run {rec.id}: ", (now.state.value, STATE_STYLE[now.state]), exit_text))
    lines = [f"job       {rec.name}, {rec.target}: {plural(rec.nodes, 'node')} x {plural(rec.nproc_per_node, 'process')}",
             f"rendered  {_when(rec.started)}" if backend.rendered
             else f"started   {_when(rec.started)}, {_took(rec, backend, now)}",
             f"where     {now.detail}",
             f"folder    {run.folder.path}",
             *backend.status_lines(run)]
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
    run, backend = _one(args.run)
    request = LogRequest.from_args(args)
    request.check(run.record)
    return backend.logs(run, request)


# ---- ddpkit cancel RUN ------------------------------------------------------------------


def _cancel(args: argparse.Namespace) -> int:
    run, backend = _one(args.run)
    return backend.cancel(run, backend.describe(run))


RUNS = ControlCommand(_add_runs, one_line("runs", _runs))
STATUS = ControlCommand(_add_run_arg, one_line("status", _status))
LOGS = ControlCommand(_add_logs, one_line("logs", _logs))
CANCEL = ControlCommand(_add_run_arg, one_line("cancel", _cancel))
