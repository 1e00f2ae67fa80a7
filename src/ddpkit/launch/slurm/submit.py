"""`ddpkit submit slurm -f JOB.yaml [--follow]`: render, sbatch, and follow.

The script is written to `--dir` (default: the current folder) as
`<name>.sbatch`, and sbatch runs there, so the job's output file
(slurm.output, default `%x-%j.out`) lands beside it. With --follow the
output is streamed with a `[node]` prefix per line until the job ends
(requeues included), and the exit status is the job's: 0 for COMPLETED.
Each submitted job gets a run folder (`ddpkit runs`): the spec, a copy of the
script, the job id and output file, and with --follow its end."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ...exitcodes import ExitCode
from ...render import Rendered
from ...runs import RunFolder, RunState, SlurmJob
from ...spec import JobSpec, doctor_mode
from ...targets import render
from ..prelude import prelude
from . import checks as slurm_checks

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED", "SPECIAL_EXIT"}
POLL_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ...specfile import add_spec_arguments

    add_spec_arguments(parser)
    parser.add_argument("--dir", type=Path, default=Path("."),
                        help="folder for the rendered script and the job's output files (default: .)")
    parser.add_argument("--follow", action="store_true",
                        help="stream the job's output with node prefixes and exit with its final state")
    parser.add_argument("--doctor", action="store_true", help="run `ddpkit doctor` instead of the job's command")
    parser.add_argument("--no-check", action="store_true",
                        help="submit without first checking the job against the partition's nodes and limits")


@dataclass(frozen=True)
class JobState:
    state: str
    exit_code: str
    stdout: str | None
    nodes: list[str]
    reason: str = "None"
    restarts: int = 0

    @property
    def hopeless(self) -> bool:
        """Pending for a reason that waiting cannot clear."""
        return self.state == "PENDING" and self.reason in slurm_checks.HOPELESS_REASONS

    @property
    def finished(self) -> bool:
        return self.state.split()[0] in FINAL_STATES

    @property
    def exit_status(self) -> int:
        """0 only for COMPLETED; otherwise the job's exit code, 128+signal, or FAILED."""
        if self.state == "COMPLETED":
            return ExitCode.OK
        code, _, sig = self.exit_code.partition(":")
        if code.isdigit() and int(code):
            return int(code)
        return 128 + int(sig) if sig.isdigit() and int(sig) else ExitCode.FAILED


# Slurm's words for a job that has not started, or is starting, or is between runs.
QUEUED_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESV_DEL_HOLD",
                 "SUSPENDED"}


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
    return out.stdout.split()


def job_state(job_id: int) -> JobState | None:
    """From scontrol while slurmctld still knows the job, else from sacct."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, check=False)
    if out.returncode == 0 and out.stdout.strip():
        f = slurm_checks.fields(out.stdout)
        return JobState(f["JobState"], f.get("ExitCode", ""), f.get("StdOut"), hostnames(f.get("NodeList", "")),
                        f.get("Reason", "None"), int(f.get("Restarts", "0") or 0))
    acct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State,ExitCode"],
                          capture_output=True, text=True, check=False)
    lines = acct.stdout.strip().splitlines() if acct.returncode == 0 else []
    if not lines:
        return None
    state, _, code = lines[-1].partition("|")
    return JobState(state, code, None, [])


def accounting() -> bool:
    """Whether the cluster keeps accounting (sacct answers for finished jobs)."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "AccountingStorageType":
            return value.strip() not in ("", "accounting_storage/none")
    return False


def queue_state(job_id: int) -> tuple[JobState, str] | None:
    """The job's state and where it was read: squeue while the job is
    queued or running; once it has left the queue, sacct when the cluster
    keeps accounting, else scontrol (which forgets a job MinJobAge after it
    ended). None when no source knows the job."""
    out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r|%N"], capture_output=True, text=True,
                         check=False)
    line = out.stdout.strip() if out.returncode == 0 else ""
    if line:
        state, reason, nodelist = (line.splitlines()[0].split("|") + ["", ""])[:3]
        return JobState(state, "", None, hostnames(nodelist), reason or "None"), "squeue"
    if accounting():
        acct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State,ExitCode,NodeList"],
                              capture_output=True, text=True, check=False)
        rows = acct.stdout.strip().splitlines() if acct.returncode == 0 else []
        if rows:
            state, code, nodelist = (rows[-1].split("|") + ["", ""])[:3]
            return JobState(state, code, None, hostnames(nodelist)), "sacct"
    show = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, check=False)
    if show.returncode == 0 and show.stdout.strip():
        f = slurm_checks.fields(show.stdout)
        return (JobState(f["JobState"], f.get("ExitCode", ""), f.get("StdOut"), hostnames(f.get("NodeList", "")),
                         f.get("Reason", "None"), int(f.get("Restarts", "0") or 0)), "scontrol")
    return None


def submit(script: Path) -> tuple[int, int, str]:
    """(sbatch's exit status, job id or 0, sbatch's stderr)."""
    out = subprocess.run(["sbatch", "--parsable", script.name], cwd=script.parent,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return out.returncode, 0, out.stderr
    return 0, int(out.stdout.strip().split(";")[0]), out.stderr


_LABEL = re.compile(r"^\s*(\d+): ?(.*)$", re.DOTALL)


def node_prefix(line: str, nodes: list[str], tasks_per_node: int) -> str:
    """`srun --label` starts each task's line with its task id; block
    distribution puts task t on node t // tasks_per_node."""
    m = _LABEL.match(line)
    if m is None:
        return f"[batch] {line}"
    index = int(m.group(1)) // tasks_per_node
    name = nodes[index] if index < len(nodes) else f"node{index}"
    return f"[{name}] {m.group(2)}"


def labelling_nodes(known: list[str], state: JobState) -> list[str]:
    """The nodes that task labels index: the allocation as seen while the job
    runs (a requeued run may get others). A COMPLETING job's NodeList holds
    only the nodes still completing, so a line read then must keep the
    running allocation (a task on node1 was labelled node2)."""
    if state.nodes and (not known or state.state.split()[0] == "RUNNING"):
        return state.nodes
    return known


def follow(job_id: int, spec: JobSpec) -> int:
    from ...targets.slurm import tasks_per_node

    offset = 0
    state: JobState | None = None
    shown: tuple[str, str, int] | None = None
    partial = ""
    nodes: list[str] = []
    while True:
        state = job_state(job_id) or state
        if state is not None:
            nodes = labelling_nodes(nodes, state)
        if state is not None and (state.state, state.reason, state.restarts) != shown:
            shown = _announce(job_id, state, shown)
        if state is not None and state.hopeless:
            return _give_up(job_id, state)
        if state and state.stdout and Path(state.stdout).exists():
            with open(state.stdout, encoding="utf-8", errors="replace") as fh:
                fh.seek(offset)
                chunk = fh.read()
                offset = fh.tell()
            lines = (partial + chunk).split("\n")
            partial = lines.pop()
            for line in lines:
                print(node_prefix(line, nodes, tasks_per_node(spec)), flush=True)
        if state is not None and state.finished:
            if partial:
                print(node_prefix(partial, nodes, tasks_per_node(spec)), flush=True)
            print(f"ddpkit: job {job_id} ended {state.state} (exit code {state.exit_code})", file=sys.stderr)
            return state.exit_status
        if state is None:
            print(f"ddpkit: job {job_id} is unknown to scontrol and sacct", file=sys.stderr)
            return ExitCode.FAILED
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


def check_cluster(spec: JobSpec) -> int:
    """0, or the exit code after printing why the cluster can never run the job."""
    try:
        cluster = slurm_checks.read_cluster()
    except FileNotFoundError:
        print(slurm_checks.missing_tool("scontrol"), file=sys.stderr)
        return ExitCode.PREFLIGHT
    except (OSError, subprocess.SubprocessError) as exc:
        line = slurm_checks.unavailable("scontrol", str(exc))
        print(line or f"ddpkit: cannot read the cluster's partitions (scontrol: {slurm_checks.slurm_words(str(exc))});"
                      " is this a Slurm login node? Pass --no-check to submit anyway", file=sys.stderr)
        return ExitCode.PREFLIGHT
    found = slurm_checks.problems(spec, cluster)
    if not found:
        return 0
    print("ddpkit: this job can never run on this cluster (nothing was submitted):", file=sys.stderr)
    for problem in found:
        print(f"  - {problem}", file=sys.stderr)
    return ExitCode.BAD_INPUT


def _check_hint(args: argparse.Namespace) -> str:
    return ", or submit without --no-check to have it checked first" if args.no_check else ""


def run(args: argparse.Namespace) -> int:
    from ...specfile import spec_from_args

    spec = spec_from_args(args)
    if args.doctor:
        spec = doctor_mode(spec)
    # Refused by render, below. The secrets are read to refuse an unset one: sbatch exports
    # this environment to the job, and a secret unset here would be unset on every rank.
    prelude(spec, "submit slurm", None)
    for tool in ("sbatch",) if args.no_check else ("scontrol", "sbatch"):
        if shutil.which(tool) is None:
            print(slurm_checks.missing_tool(tool), file=sys.stderr)
            return ExitCode.PREFLIGHT
    if not args.no_check and (refused := check_cluster(spec)):
        return refused
    rendered = render(spec, "slurm")
    # The run folder before sbatch: a job that was submitted is always recorded.
    run = new_run(spec, rendered)
    folder = args.dir.resolve()
    new = [name for name in rendered.files if not (folder / name).exists()]
    [script] = rendered.write(folder)
    rc, job_id, err = submit(script)
    if rc != 0:
        for name in new:  # nothing left behind by a job that was not submitted
            (folder / name).unlink(missing_ok=True)
        shutil.rmtree(run.path, ignore_errors=True)
        line = slurm_checks.unavailable("sbatch", err)
        if line:
            print(line, file=sys.stderr)
            return ExitCode.PREFLIGHT
        sys.stderr.write(err)  # sbatch's own words on the job, as they are
        print(f"ddpkit: sbatch refused the job (nothing was submitted); fix what it names{_check_hint(args)}",
              file=sys.stderr)
        return ExitCode.BAD_INPUT
    if err:
        sys.stderr.write(err)
    state = job_state(job_id)
    logs = state.stdout if state and state.stdout else str(script.parent / spec.slurm.output)
    record_job(run, spec, job_id, script, logs)
    print(f"submitted Slurm job {job_id}: script {script}, output {logs}", flush=True)
    print(f"ddpkit: run {run.path.name} (ddpkit status {job_id}, ddpkit logs {job_id}, ddpkit cancel {job_id})",
          file=sys.stderr, flush=True)
    note = spec.watchdog.script_note(spec.command, spec.preamble.progress)
    if note:
        print(f"ddpkit: {note}", file=sys.stderr, flush=True)
    if not args.follow:
        return ExitCode.OK
    code = follow(job_id, spec)
    final = job_state(job_id)
    if final is not None and final.finished:
        run.finish(code, state=run_state(final.state))
    return code


def new_run(spec: JobSpec, rendered: Rendered) -> RunFolder:
    """The run folder of a job about to be submitted: the spec and the script."""
    from ...specfile import dump_yaml

    run = RunFolder.create(name=spec.name, target="slurm", nodes=spec.nodes, nproc_per_node=spec.nproc_per_node,
                           spec_yaml=dump_yaml(spec), stop_grace_s=spec.grace.slurm_signal_s)
    rendered.write(run.rendered_dir)
    return run


def record_job(run: RunFolder, spec: JobSpec, job_id: int, script: Path, output: str) -> None:
    """What `ddpkit status/logs/cancel` ask Slurm about, once sbatch took the job."""
    from ...targets.slurm import tasks_per_node

    # The output file is relative to sbatch's folder when slurm.output is: `logs` runs from anywhere.
    # (scontrol names it with %j and %x filled in; the spec's pattern, when it could not, needs them.)
    output = output.replace("%j", str(job_id)).replace("%x", spec.name).replace("%%", "%")
    out = Path(output) if Path(output).is_absolute() else script.parent / output
    run.set_slurm(SlurmJob(job_id=job_id, script=str(script), output=str(out), tasks_per_node=tasks_per_node(spec),
                           rank_per_task=spec.slurm.mode == "srun", signal=spec.preemption.signal,
                           signal_grace_s=spec.grace.slurm_signal_s))
    run.event("submitted", f"Slurm job {job_id}")
