"""`ddpkit submit slurm -f JOB.yaml [--follow]`: render, sbatch, and follow.

The script is written to `--dir` (default: the current folder) as
`<name>.sbatch`, and sbatch runs there, so the job's output file
(slurm.output, default `%x-%j.out`) lands beside it. With --follow the
output is streamed with a `[node]` prefix per line until the job ends
(requeues included; follow.py), and the exit status is the job's: 0 for
COMPLETED.
Each submitted job gets a run folder (`ddpkit runs`): the spec, a copy of the
script, the job id and output file, and with --follow its end."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from ...exitcodes import ExitCode
from ...runs import RunFolder, RunTarget, SlurmJob
from ...spec import JobSpec, doctor_mode
from ...targets import render
from ..prelude import prelude
from . import checks as slurm_checks
from .follow import follow
from .jobs import job_state, run_state


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


def submit(script: Path) -> tuple[int, int, str]:
    """(sbatch's exit status, job id or 0, sbatch's stderr)."""
    out = subprocess.run(["sbatch", "--parsable", script.name], cwd=script.parent,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return out.returncode, 0, out.stderr
    return 0, int(out.stdout.strip().split(";")[0]), out.stderr


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
    ready = prelude(spec, "submit slurm", None)
    for tool in ("sbatch",) if args.no_check else ("scontrol", "sbatch"):
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
