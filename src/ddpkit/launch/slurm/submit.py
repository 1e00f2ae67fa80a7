"""`ddpkit submit slurm -f JOB.yaml [--follow]`: check, render, and hand
the script to the Slurm backend (launch/control/backends/slurm.py), which
submits it and follows it.

The script is written to `--dir` (default: the current folder) as
`<name>.sbatch`, and sbatch runs there, so the job's output file
(slurm.output, default `%x-%j.out`) lands beside it. With --follow the
output is streamed as `ddpkit logs RUN --follow` streams it (`[node0
rank1]`, `[node0]`, `[batch]` per line) until the job ends (requeues
included), its state changes on stderr (follow.py), and the exit status is
the job's: 0 for COMPLETED.
Each submitted job gets a run folder (`ddpkit runs`): the spec, a copy of the
script, the job id and output file, and its end once a command saw it."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from ...runs import RunTarget, SlurmJob
from ...shared.exitcodes import ExitCode
from ...spec import JobSpec, doctor_mode
from ...targets import render
from ..control.backends.slurm import SbatchRefused, Slurm
from ..prelude import prelude
from . import checks as slurm_checks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ...spec.yamlfile import add_spec_arguments

    add_spec_arguments(parser)
    parser.add_argument("--dir", type=Path, default=Path("."),
                        help="folder for the rendered script and the job's output files (default: .)")
    parser.add_argument("--follow", action="store_true",
                        help="stream the job's output with node prefixes and exit with its final state")
    parser.add_argument("--doctor", action="store_true", help="run `ddpkit doctor` instead of the job's command")
    parser.add_argument("--no-check", action="store_true",
                        help="submit without first checking the job against the partition's nodes and limits")


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
    from ...spec.yamlfile import spec_from_args

    spec = spec_from_args(args)
    if args.doctor:
        spec = doctor_mode(spec)
    # Refused by render, below. The secrets are read to refuse an unset one: sbatch exports
    # this environment to the job, and a secret unset here would be unset on every rank.
    ready = prelude(spec, "submit slurm", None)
    # --follow asks squeue (then sacct or scontrol) how the job is doing.
    for tool in (*(() if args.no_check else ("scontrol",)), "sbatch", *(("squeue",) if args.follow else ())):
        if shutil.which(tool) is None:
            print(slurm_checks.missing_tool(tool), file=sys.stderr)
            return ExitCode.PREFLIGHT
    if not args.no_check and (refused := check_cluster(spec)):
        return refused
    rendered = render(spec, "slurm")
    # The run folder before sbatch: a job that was submitted is always recorded.
    run = ready.run_folder(RunTarget.SLURM, rendered=rendered)
    folder = args.dir.resolve()
    new = [name for name in rendered.files if not (folder / name).exists()]
    [script] = rendered.write(folder)
    backend = Slurm()
    try:
        stored = backend.schedule(run, script, slurm_job(spec, script))
    except SbatchRefused as refused:
        for name in new:  # nothing left behind by a job that was not submitted
            (folder / name).unlink(missing_ok=True)
        shutil.rmtree(run.path, ignore_errors=True)
        line = slurm_checks.unavailable("sbatch", refused.stderr)
        if line:
            print(line, file=sys.stderr)
            return ExitCode.PREFLIGHT
        sys.stderr.write(refused.stderr)  # sbatch's own words on the job, as they are
        print(f"ddpkit: sbatch refused the job (nothing was submitted); fix what it names{_check_hint(args)}",
              file=sys.stderr)
        return ExitCode.BAD_INPUT
    job = stored.record.slurm
    assert job is not None
    print(f"submitted Slurm job {job.job_id}: script {script}, output {job.output}", flush=True)
    print(f"ddpkit: run {run.path.name} (ddpkit status {job.job_id}, ddpkit logs {job.job_id}, "
          f"ddpkit cancel {job.job_id})", file=sys.stderr, flush=True)
    note = spec.watchdog.script_note(spec.command, spec.preamble.progress)
    if note:
        print(f"ddpkit: {note}", file=sys.stderr, flush=True)
    return backend.follow(stored) if args.follow else ExitCode.OK


def slurm_job(spec: JobSpec, script: Path) -> SlurmJob:
    """What `ddpkit status/logs/cancel` need of the job, known before sbatch
    (the backend fills in its id and the output file Slurm names)."""
    from ...targets.slurm import tasks_per_node

    return SlurmJob(job_id=0, script=str(script), output=spec.slurm.output, tasks_per_node=tasks_per_node(spec),
                    rank_per_task=spec.slurm.mode == "srun", signal=spec.preemption.signal,
                    signal_grace_s=spec.grace.slurm_signal_s)
