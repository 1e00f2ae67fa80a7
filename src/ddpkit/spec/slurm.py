"""The `slurm:` section: what only a Slurm job has (sbatch's options, the
container runtime, the launch mode). Every value here ends up on an #SBATCH
line or an srun option, so each is held to what sbatch parses as one word."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from .fields import Mounts, SlurmMem, SlurmTime, SlurmWord, Strict, each, matching, rule


class SlurmContainer(Strict):
    runtime: Literal["none", "pyxis", "apptainer"] = "none"
    mounts: Mounts = Field(
        default_factory=list, description="'SRC:DST[:ro]' bind mounts for Slurm only (the job's own `mounts:` "
                                          "serve every container target), both absolute paths")
    workdir: Annotated[str, AfterValidator(rule(
        lambda v: v.startswith("/") and "\n" not in v, "{value!r}: container workdir must be an absolute path"))] | None = None


SLURM_DEPENDENCY_TYPES = ("after", "afterany", "afterburstbuffer", "aftercorr", "afternotok", "afterok")
_DEP_ITEM = re.compile(rf"^(singleton|({'|'.join(SLURM_DEPENDENCY_TYPES)})(:\d+(_\d+)?(\+\d+)?)+)$")
SLURM_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.,&|*!\[\]():+-]+$")
SLURM_HOSTLIST = re.compile(r"^[A-Za-z0-9_.,\[\]-]+$")
# Options ddpkit writes from other fields: a second copy in extra_sbatch
# would silently win over them (sbatch keeps the last) and break the job.
SBATCH_OWNED = {
    "job-name": "name", "nodes": "nodes", "ntasks": "nproc_per_node", "ntasks-per-node": "nproc_per_node",
    "cpus-per-task": "resources.cpus_per_process", "gpus": "nproc_per_node", "gpus-per-node": "slurm.gpu_request",
    "gpus-per-task": "slurm.gpu_request", "gres": "slurm.gpu_request", "mem": "resources.memory_per_node", "time": "slurm.time",
    "partition": "slurm.partition", "account": "slurm.account", "qos": "slurm.qos", "exclusive": "slurm.exclusive",
    "output": "slurm.output", "requeue": "slurm.requeue", "no-requeue": "slurm.requeue", "signal": "slurm.signal_seconds",
    "open-mode": "slurm.requeue", "dependency": "slurm.dependency", "constraint": "slurm.constraint",
    "reservation": "slurm.reservation", "nodelist": "slurm.nodelist", "exclude": "slurm.exclude",
}


def sbatch_directive_problem(value: str) -> str | None:
    """Why `value` cannot be one #SBATCH argument, or None. sbatch's
    directive parser blanks the words packjob/hetjob anywhere on the line."""
    if "\n" in value or "\r" in value or "\x00" in value:
        return "no newline or NUL"
    if any(word in value.lower() for word in ("packjob", "hetjob")):
        return "sbatch erases the words 'packjob' and 'hetjob' from #SBATCH lines"
    return None


def _output(value: str) -> str:
    if not value or any(c in value for c in "\n\r\t ") or value.startswith("-"):
        raise ValueError(f"{value!r}: an output pattern has no whitespace and no leading '-'")
    problem = sbatch_directive_problem(value)
    if problem:
        raise ValueError(f"{value!r}: {problem}")
    return value


def _dependency(value: str) -> str:
    # ',' means all must hold, '?' any; sbatch refuses a list that mixes them.
    items = value.split("?") if "?" in value else value.split(",")
    if "?" in value and "," in value or not all(_DEP_ITEM.match(i) for i in items):
        raise ValueError(
            f"{value!r} is not a Slurm dependency: write TYPE:JOBID[:JOBID...] with TYPE one of "
            f"{', '.join(SLURM_DEPENDENCY_TYPES)} (or 'singleton'), several joined by ',' (all) or '?' (any), "
            "e.g. afterok:1234"
        )
    return value


def _extra_option(option: str) -> str:
    if not option.startswith("--") or len(option) < 3:
        raise ValueError(f"{option!r}: write each extra sbatch option in its long form, e.g. --mail-type=END")
    problem = sbatch_directive_problem(option)
    if problem:
        raise ValueError(f"{option!r}: {problem}")
    name = option[2:].split("=", 1)[0]
    if name in SBATCH_OWNED:
        raise ValueError(f"{option!r}: ddpkit writes --{name} itself; set {SBATCH_OWNED[name]} instead")
    return option


SbatchOutput = Annotated[str, AfterValidator(_output)]
SlurmDependency = Annotated[str, AfterValidator(_dependency)]
SlurmConstraint = Annotated[str, AfterValidator(matching(
    SLURM_CONSTRAINT, "{value!r} is not a Slurm constraint: feature names joined by & | , with [ ] ( ) *N"))]
SlurmHostList = Annotated[str, AfterValidator(matching(
    SLURM_HOSTLIST, "{value!r} is not a Slurm host list, e.g. node[1-4],gpu07"))]


class SlurmOptions(Strict):
    mode: Literal["torchrun", "srun"] = Field(
        default="torchrun",
        description="torchrun: one srun task per node running torchrun; srun: one task per GPU/process",
    )
    partition: SlurmWord | None = None
    account: SlurmWord | None = None
    qos: SlurmWord | None = None
    time: SlurmTime | None = Field(default=None, description="wall time, e.g. 04:00:00 or 1-00:00:00")
    mem: SlurmMem | None = Field(
        default=None, description="memory per node in Slurm's syntax (0: all of it); default: resources.memory_per_node")
    cpus_per_process: int | None = Field(default=None, ge=1, description="deprecated: resources.cpus_per_process")
    cpus_per_task: int | None = Field(default=None, description="replaced by cpus_per_process (refused)")
    gpu_request: Literal["gpus-per-node", "gres"] = Field(
        default="gpus-per-node", description="how GPUs are asked for: --gpus-per-node=N or --gres=gpu:N"
    )
    exclusive: bool = False
    output: SbatchOutput = Field(default="%x-%j.out", description="sbatch --output pattern")
    requeue: bool = Field(default=True, description="requeue on preemption after checkpointing")
    signal_seconds: int | None = Field(
        default=None, ge=10, le=3600,
        description="seconds of warning before the time limit (--signal=B:SIG@N); default: derived from "
                    "preemption.checkpoint_s",
    )
    dependency: SlurmDependency | None = Field(
        default=None, description="e.g. afterok:1234 or afterany:12:13 (sbatch --dependency)")
    constraint: SlurmConstraint | None = Field(default=None, description="node features, e.g. a100&ib (sbatch --constraint)")
    reservation: SlurmWord | None = None
    nodelist: SlurmHostList | None = Field(default=None, description="hosts the job must use, e.g. gpu[01-04]")
    exclude: SlurmHostList | None = Field(default=None, description="hosts the job must not use, e.g. gpu07")
    extra_sbatch: Annotated[list[str], AfterValidator(each(_extra_option))] = Field(
        default_factory=list, description="raw sbatch options, e.g. --mail-type=END")
    container: SlurmContainer = Field(default_factory=SlurmContainer)

    @field_validator("cpus_per_task")
    @classmethod
    def _cpus_per_task(cls, value: int | None) -> int | None:
        if value is not None:
            # Not mapped: it meant CPUs per node in torchrun mode and per
            # process in srun mode, so no one reading fits both modes.
            raise ValueError(
                "slurm.cpus_per_task is replaced by resources.cpus_per_process (CPUs for each training process; "
                "ddpkit derives --cpus-per-task for either mode). It meant per node in torchrun mode, per process "
                f"in srun mode: set resources.cpus_per_process to {value} / nproc_per_node if you used torchrun mode, "
                f"or to {value} if you used srun mode"
            )
        return value
