"""A run's log files as `ddpkit logs` reads them: which lines of which
files hold a node's or a rank's lines, each with the console's prefix
(`[node0 rank1]`, `[node0]`): launch logs tagged by torchrun, Slurm output
labelled by srun (docs/guides/runs.md); their lines, once or followed
until the run ends (`log_iter`), and the printing of them. Rendered jobs'
logs are their tool's."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ... import records
from ...runs import NodeLog, RunRecord, Tail
from ...shared.exitcodes import ExitCode
from .common import POLL_S, RunCommandError

Pick = Callable[[str], str | None]  # the line to print, or None to leave it out


@dataclass(frozen=True)
class LogRequest:
    """What `ddpkit logs` asks for: one node's or one rank's lines (or all),
    the last N of them, and whether to follow the run to its end."""

    node: int | None = None
    rank: int | None = None
    tail: int | None = None
    follow: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LogRequest:
        return cls(args.node, args.rank, args.tail, args.follow)

    def check(self, rec: RunRecord) -> None:
        """A node or rank the run does not have: one line, exit 2."""
        world = rec.nodes * rec.nproc_per_node
        if self.rank is not None and not 0 <= self.rank < world:
            raise RunCommandError(f"--rank {self.rank}: run {rec.id} has ranks 0-{world - 1}")
        if self.node is not None and not 0 <= self.node < rec.nodes:
            raise RunCommandError(f"--node {self.node}: run {rec.id} has nodes 0-{rec.nodes - 1}")

    def node_of_rank(self, rec: RunRecord) -> int | None:
        """The node asked for, or the one that holds the rank asked for."""
        return self.node if self.rank is None else self.rank // rec.nproc_per_node


@dataclass
class LogSource:
    """One log file and how its lines are picked and prefixed."""

    tail: Tail
    pick: Pick

    def read(self) -> list[str]:
        """The complete lines written since the last read."""
        return self._picked(self.tail.read())

    def rest(self) -> list[str]:
        """A last line without its newline, once the run has ended."""
        return self._picked(self.tail.rest())

    def _picked(self, lines: list[str]) -> list[str]:
        return [shown for line in lines if (shown := self.pick(line.rstrip("\r"))) is not None]


def _launch_pick(log: NodeLog, rank: int | None) -> Pick:
    """Lines of a launch node log, with the console's prefix: `[node0 rank1]`
    for a worker line torchrun tagged, `[node0]` otherwise."""
    def pick(line: str) -> str | None:
        tag = records.rank_tagged(line) if log.rank_tagged else None
        if rank is not None and log.rank_tagged and (tag is None or tag[0] != rank):
            return None
        body = tag[1] if tag else line
        if records.is_frame(body):  # a record for the launcher, not a line for people
            return None
        return f"[node{log.node} rank{tag[0]}] {body}" if tag else f"[node{log.node}] {line}"
    return pick


def launch_sources(rec: RunRecord, request: LogRequest, launcher: str) -> tuple[list[LogSource], str | None]:
    """A launch run's node logs to read, and a note when they cannot pick one rank's lines."""
    if not rec.logs:
        raise RunCommandError(f"run {rec.id} ({rec.target}) recorded no node logs", ExitCode.FAILED)
    want = request.node_of_rank(rec)
    logs = [log for log in rec.logs if want is None or log.node == want]
    note = None
    if request.rank is not None and not all(log.rank_tagged for log in logs):
        note = f"{launcher}'s node logs do not tag ranks; showing node {want}, which holds rank {request.rank}"
    return [LogSource(Tail(Path(log.path)), _launch_pick(log, request.rank)) for log in logs], note


def slurm_source(rec: RunRecord, request: LogRequest) -> tuple[LogSource, str | None]:
    """A Slurm job's output file: `T: text` from srun --label, task T on
    node T // tasks_per_node (block distribution); the batch shell's own
    lines have no label. Torchrun mode does not tag ranks: a rank's node."""
    assert rec.slurm is not None
    job, node, rank = rec.slurm, request.node, request.rank

    def pick(line: str) -> str | None:
        labelled = records.task_labelled(line)
        if labelled is None:
            return None if node is not None or rank is not None else f"[batch] {line}"
        task, text = labelled
        if records.is_frame(text):  # a record for the launcher, not a line for people
            return None
        on = task // job.tasks_per_node
        if node is not None and on != node:
            return None
        if rank is not None and (task != rank if job.rank_per_task else on != rank // rec.nproc_per_node):
            return None
        return f"[node{on} rank{task}] {text}" if job.rank_per_task else f"[node{on}] {text}"

    note = None
    if rank is not None and not job.rank_per_task:
        note = (f"torchrun mode: the job's output does not tag ranks; showing node {rank // rec.nproc_per_node}, "
                f"which holds rank {rank}")
    return LogSource(Tail(Path(job.output)), pick), note


def log_iter(found: list[LogSource], request: LogRequest, active: Callable[[], bool]) -> Iterator[list[str]]:
    """The files' lines, a batch at a time: the last `tail` of each, then with
    --follow what they gain until `active()` says the run has ended (TorchX's
    Scheduler.log_iter with should_tail)."""
    for source in found:
        lines = source.read()
        if not request.follow:
            lines += source.rest()
        if request.tail is not None:
            lines = lines[-request.tail:] if request.tail > 0 else []
        yield lines
    if not request.follow:
        return
    while True:
        ended = not active()  # asked before the files are read: no line is missed
        for source in found:
            yield source.read() + (source.rest() if ended else [])
        if ended:
            return
        time.sleep(POLL_S)


def print_files(found: list[LogSource], note: str | None, request: LogRequest, active: Callable[[], bool]) -> int:
    """`log_iter`'s lines on stdout, after the note and the files not there yet on stderr."""
    if note:
        print(f"ddpkit logs: {note}", file=sys.stderr)
    missing = [s.tail.path for s in found if not s.tail.path.exists()]
    if missing and not request.follow:
        print(f"ddpkit logs: no log yet at {', '.join(map(str, missing))}", file=sys.stderr)
    for lines in log_iter(found, request, active):
        print_lines(lines)
    return ExitCode.OK


def print_lines(lines: list[str]) -> None:
    if lines:
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()


def say_node_of_rank(rec: RunRecord, request: LogRequest, holder: str) -> None:
    """Where `holder` (a pod, a container) holds a whole node: --rank R shows the node that holds R, and says so."""
    if request.rank is not None:
        print(f"ddpkit logs: {holder} holds a node; showing node {request.node_of_rank(rec)}, "
              f"which holds rank {request.rank}", file=sys.stderr)
