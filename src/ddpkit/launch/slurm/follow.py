"""`submit slurm --follow`: the job's output streamed with a `[node]`
prefix per line, its state changes on stderr, until it ends (requeues
included); the exit status is the job's."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from ... import records
from ...exitcodes import ExitCode
from ...runs import Tail
from ...spec import JobSpec
from ...targets.slurm import tasks_per_node
from .jobs import JobState, job_state

POLL_S = 1.0


def node_prefix(line: str, nodes: list[str], tasks_per_node: int) -> str | None:
    """`srun --label` starts each task's line with its task id; block
    distribution puts task t on node t // tasks_per_node. None for a framed
    record: it is for a launcher, not for people."""
    labelled = records.task_labelled(line)
    if labelled is None:
        return f"[batch] {line}"
    task, text = labelled
    if records.is_frame(text):
        return None
    index = task // tasks_per_node
    name = nodes[index] if index < len(nodes) else f"node{index}"
    return f"[{name}] {text}"


def labelling_nodes(known: list[str], state: JobState) -> list[str]:
    """The nodes that task labels index: the allocation as seen while the job
    runs (a requeued run may get others). A COMPLETING job's NodeList holds
    only the nodes still completing, so a line read then must keep the
    running allocation (a task on node1 was labelled node2)."""
    if state.nodes and (not known or state.state.split()[0] == "RUNNING"):
        return state.nodes
    return known


def follow(job_id: int, spec: JobSpec) -> int:
    """Stream until the job ends; its exit status (0 for COMPLETED)."""
    per_node = tasks_per_node(spec)
    state: JobState | None = None
    shown: tuple[str, str, int] | None = None
    output: Tail | None = None
    nodes: list[str] = []
    while True:
        state = job_state(job_id) or state
        if state is None:
            print(f"ddpkit: job {job_id} is unknown to scontrol and sacct", file=sys.stderr)
            return ExitCode.FAILED
        nodes = labelling_nodes(nodes, state)
        if (state.state, state.reason, state.restarts) != shown:
            shown = _announce(job_id, state, shown)
        if state.hopeless:
            return _give_up(job_id, state)
        if output is None and state.stdout:
            output = Tail(Path(state.stdout))
        lines = output.read() if output else []
        if state.finished:
            lines += output.rest() if output else []
        for line in lines:
            text = node_prefix(line, nodes, per_node)
            if text is not None:
                print(text, flush=True)
        if state.finished:
            print(f"ddpkit: job {job_id} ended {state.state} (exit code {state.exit_code})", file=sys.stderr)
            return state.exit_status
        time.sleep(POLL_S)


def _announce(job_id: int, state: JobState, before: tuple[str, str, int] | None) -> tuple[str, str, int]:
    """One stderr line each time the job's state, pending reason or restart count changes."""
    if before is not None and state.restarts > before[2]:
        print(f"ddpkit: job {job_id} was requeued (restart {state.restarts})", file=sys.stderr, flush=True)
    if state.state == "PENDING":
        print(f"ddpkit: job {job_id} PENDING ({state.reason})", file=sys.stderr, flush=True)
    elif before is None or state.state != before[0]:
        print(f"ddpkit: job {job_id} {state.state}", file=sys.stderr, flush=True)
    return state.state, state.reason, state.restarts


def _give_up(job_id: int, state: JobState) -> int:
    """Cancel a job that can never start, rather than leave it queued forever."""
    subprocess.run(["scancel", str(job_id)], capture_output=True, check=False)
    print(f"ddpkit: job {job_id} can never start: Slurm holds it with reason {state.reason} (it breaks a limit of"
          " its partition, QOS or account); cancelled it. Fix the request (nodes, time, account) or check it"
          " first without --no-check", file=sys.stderr, flush=True)
    return ExitCode.PREFLIGHT
