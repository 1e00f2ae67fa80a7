"""A run's node log files as `ddpkit logs` reads them: which files hold a
node's or a rank's lines, and each line with the console's prefix
(`[node0 rank1]`, `[node0]`): launch logs tagged by torchrun, Slurm output
labelled by srun (docs/RUNS.md)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...exitcodes import ExitCode
from ...runs import NodeLog, RunRecord
from .common import RunCommandError

_RANK_TAG = re.compile(r"^\[rank(\d+)\]:")  # torchrun's prefix in a launch local node log (supervisor)
_TASK_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")  # srun --label

@dataclass
class Source:
    """One log file and how its lines are picked and prefixed."""

    path: Path
    pick: Callable[[str], str | None]  # the line to print, or None to leave it out
    offset: int = 0
    partial: str = field(default="", repr=False)

    def read(self) -> list[str]:
        """The complete lines written since the last read."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        lines = (self.partial + chunk.decode("utf-8", "replace")).split("\n")
        self.partial = lines.pop()
        return [shown for line in lines if (shown := self.pick(line.rstrip("\r"))) is not None]

    def rest(self) -> list[str]:
        """A last line without its newline, once the run has ended."""
        last, self.partial = self.partial, ""
        shown = self.pick(last) if last else None
        return [] if shown is None else [shown]


def _launch_pick(log: NodeLog, rank: int | None) -> Callable[[str], str | None]:
    """Lines of a launch node log, with the console's prefix: `[node0 rank1]`
    for a worker line torchrun tagged, `[node0]` otherwise."""
    def pick(line: str) -> str | None:
        tag = _RANK_TAG.match(line) if log.rank_tagged else None
        if rank is not None and log.rank_tagged and (tag is None or int(tag.group(1)) != rank):
            return None
        if tag is not None:
            return f"[node{log.node} rank{tag.group(1)}] {line[tag.end():]}"
        return f"[node{log.node}] {line}"
    return pick


def _slurm_pick(rec: RunRecord, node: int | None, rank: int | None) -> Callable[[str], str | None]:
    """Lines of a Slurm job's output: `T: text` from srun --label, task T on
    node T // tasks_per_node (block distribution); the batch shell's own lines
    have no label."""
    assert rec.slurm is not None
    job = rec.slurm

    def pick(line: str) -> str | None:
        m = _TASK_LABEL.match(line)
        if m is None:
            return None if node is not None or rank is not None else f"[batch] {line}"
        task = int(m.group(1))
        on = task // job.tasks_per_node
        if node is not None and on != node:
            return None
        if rank is not None and (task != rank if job.rank_per_task else on != rank // rec.nproc_per_node):
            return None
        return f"[node{on} rank{task}] {m.group(2)}" if job.rank_per_task else f"[node{on}] {m.group(2)}"
    return pick


def sources(rec: RunRecord, node: int | None, rank: int | None) -> tuple[list[Source], str | None]:
    """The files to read, and a note when the logs cannot pick one rank's lines."""
    world = rec.nodes * rec.nproc_per_node
    if rank is not None and not 0 <= rank < world:
        raise RunCommandError(f"--rank {rank}: run {rec.id} has ranks 0-{world - 1}")
    if node is not None and not 0 <= node < rec.nodes:
        raise RunCommandError(f"--node {node}: run {rec.id} has nodes 0-{rec.nodes - 1}")
    note = None
    if rec.slurm is not None:
        if rank is not None and not rec.slurm.rank_per_task:
            note = (f"torchrun mode: the job's output does not tag ranks; showing node {rank // rec.nproc_per_node}, "
                    f"which holds rank {rank}")
        return [Source(Path(rec.slurm.output), _slurm_pick(rec, node, rank))], note
    if not rec.logs:
        raise RunCommandError(f"run {rec.id} ({rec.target}) recorded no node logs", ExitCode.FAILED)
    want = node if rank is None else rank // rec.nproc_per_node
    logs = [log for log in rec.logs if want is None or log.node == want]
    if rank is not None and not all(log.rank_tagged for log in logs):
        note = f"launch {rec.target}'s node logs do not tag ranks; showing node {want}, which holds rank {rank}"
    return [Source(Path(log.path), _launch_pick(log, rank)) for log in logs], note
