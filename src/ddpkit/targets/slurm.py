"""Slurm: one sbatch script, two modes (spec.slurm.mode).

torchrun: one srun task per node runs torchrun; `--node-rank="${SLURM_NODEID}"`
is expanded by the bash inside each task, never by the batch shell.
srun: one srun task per process; the entrypoint reads SLURM_PROCID,
SLURM_LOCALID and SLURM_NTASKS itself.

This module turns the spec into plain data (sbatch directives, srun options,
the container wrapper, the task command); the template only lays it out."""

from __future__ import annotations

import math
import subprocess
from dataclasses import dataclass

from ..contract import LaunchPlan, RowKey, resolve
from ..render.engine import OutputFile, Rendered, RenderError, shell_argv
from ..render.quoting import bash_c, sbatch_word, sbatch_words_of, shell_word, single_quoted
from ..shared import envnames
from ..shared.agreed import (
    METRICS_TO_LAUNCHER,
    NODE_FAILURE_FILE,
    SLURM_PORT_BASE,
    SLURM_PORT_SKIPS,
    SLURM_PORT_SPAN,
    is_ddpkit_module,
)
from ..shared.exitcodes import ExitCode
from ..spec import JobSpec, container_image, slurm_size
from . import mounts
from .refusals import refuse

NAME = "slurm"
TEMPLATE = "slurm/job.sbatch.j2"


def filename(spec: JobSpec) -> str:
    return f"{spec.name}.sbatch"


def target_for(spec: JobSpec) -> RowKey:
    return RowKey.SLURM if spec.slurm.mode == "torchrun" else RowKey.SLURM_SRUN


def tasks_per_node(spec: JobSpec) -> int:
    return 1 if spec.slurm.mode == "torchrun" else spec.nproc_per_node


def cpus_per_task(spec: JobSpec) -> int | None:
    """--cpus-per-task from resources.cpus_per_process: a torchrun task is a
    whole node's processes, an srun task is one process."""
    per_process = spec.resources.cpus_per_process
    if per_process is None:
        return None
    return per_process * (spec.nproc_per_node if spec.slurm.mode == "torchrun" else 1)


def mem(spec: JobSpec) -> str | None:
    """--mem: slurm.mem in Slurm's own syntax (0: all of the node's memory)
    where set, else resources.memory_per_node (64Gi -> 64G)."""
    if spec.slurm.mem is not None:
        return spec.slurm.mem
    return None if spec.resources.memory_per_node is None else slurm_size(spec.resources.memory_per_node)


def gpu_option(spec: JobSpec) -> list[str]:
    """The GPU request, in the form the cluster accepts (slurm.gpu_request)."""
    if not spec.gpus_per_node:
        return []
    if spec.slurm.gpu_request == "gres":
        return [f"--gres=gpu:{spec.gpus_per_node}"]
    return [f"--gpus-per-node={spec.gpus_per_node}"]


def sbatch_directives(spec: JobSpec) -> list[str]:
    """The #SBATCH options, in the order they are written."""
    s = spec.slurm
    out = [f"--job-name={spec.name}", *node_count(spec), *gpu_option(spec)]
    optional = {"cpus-per-task": cpus_per_task(spec), "mem": mem(spec), "time": s.time,
                "partition": s.partition, "account": s.account, "qos": s.qos}
    out += [f"--{key}={value}" for key, value in optional.items() if value is not None]
    if s.exclusive:
        out.append("--exclusive")
    out.append(f"--output={s.output}")
    if s.requeue:
        # A requeued run appends to the same file, so the log shows every run.
        out += [f"--signal=B:{spec.preemption.signal}@{spec.grace.slurm_signal_s}", "--requeue", "--open-mode=append"]
    placement = {"dependency": s.dependency, "constraint": s.constraint, "reservation": s.reservation,
                 "nodelist": s.nodelist, "exclude": s.exclude}
    out += [f"--{key}={value}" for key, value in placement.items() if value is not None]
    return [*out, *elastic_directives(spec), *s.extra_sbatch]


def node_count(spec: JobSpec) -> list[str]:
    """--nodes=N, or (elastic) --nodes=MIN-MAX: the job starts on what Slurm
    has, a requeued one on the nodes left when one is down for good. No
    --ntasks-per-node then: with it Slurm sets the task count from the
    minimum and gives the job the minimum's nodes even when more are idle
    (the step's srun options say it)."""
    if spec.elastic is None:
        return [f"--nodes={spec.nodes}", f"--ntasks-per-node={tasks_per_node(spec)}"]
    return [f"--nodes={spec.elastic.min_nodes}-{spec.nodes}"]


def elastic_directives(spec: JobSpec) -> list[str]:
    """An elastic job keeps its allocation when a node fails (sbatch
    --no-kill): the survivors go on without it."""
    return ["--no-kill"] if spec.elastic else []


def elastic_srun_options(spec: JobSpec) -> list[str]:
    """Fail fast, or (elastic) let the step outlive a lost node and a task
    that failed: torchrun's agents on the other nodes re-form the job."""
    return ["--no-kill", "--kill-on-bad-exit=0"] if spec.elastic else ["--kill-on-bad-exit=1"]


# An elastic job's first step spans the allocation, whatever its size within
# --nodes=MIN-MAX (one task a node: elastic runs in torchrun mode only). The
# batch shell expands these, so they are written unquoted.
ALLOCATION_SIZE = (f'--nodes="${{{envnames.SLURM_JOB_NUM_NODES}}}"', f'--ntasks="${{{envnames.SLURM_JOB_NUM_NODES}}}"')


def srun_options(spec: JobSpec) -> list[str]:
    """What srun must be told again: since Slurm 22.05 srun does not inherit
    --cpus-per-task from sbatch, and a step must not take the whole
    allocation's task count by accident."""
    n = tasks_per_node(spec)
    size = list(ALLOCATION_SIZE) if spec.elastic else [f"--nodes={spec.nodes}", f"--ntasks={spec.nodes * n}"]
    out = [*size, f"--ntasks-per-node={n}", *gpu_option(spec)]
    cpus = cpus_per_task(spec)
    if cpus is not None:
        out.append(f"--cpus-per-task={cpus}")
    out += [*elastic_srun_options(spec), "--label"]
    c = spec.slurm.container
    if c.runtime == "pyxis":
        out.append(f"--container-image={container_image(spec.image, c.runtime)}")
        binds = container_mounts(spec)
        if binds:
            out.append(f"--container-mounts={','.join(binds)}")
        if c.workdir:
            out.append(f"--container-workdir={c.workdir}")
    return out


def container_prefix(spec: JobSpec) -> list[str]:
    """argv placed between srun and the task command (Apptainer only; pyxis
    is srun options)."""
    c = spec.slurm.container
    if c.runtime != "apptainer":
        return []
    out = ["apptainer", "exec"]
    if spec.gpus_per_node:
        out.append("--nv")
    for mount in container_mounts(spec):
        out += ["--bind", mount]
    if c.workdir:
        out += ["--pwd", c.workdir]
    return [*out, container_image(spec.image, c.runtime)]


def task_argv(launch: LaunchPlan) -> str:
    """The task command as shell text. torchrun mode wraps the launch line in
    `bash -c '<line>'` so "${SLURM_NODEID}" expands in each task; srun mode
    runs the process line itself."""
    if launch.target is RowKey.SLURM:
        return bash_c("exec " + shell_argv(launch.argv))
    return shell_argv(launch.argv)


def exports(launch: LaunchPlan) -> dict[str, str]:
    """`export NAME=value` lines: the job env. PYTHONUNBUFFERED (from the
    job env) is exported first, as it always was."""
    env = launch.env
    # torchrun's signals and shutdown timeout are flags on its line (contract.stop_args).
    return {envnames.PYTHONUNBUFFERED: env[envnames.PYTHONUNBUFFERED]} | env


@dataclass(frozen=True)
class SlurmPlan:
    spec: JobSpec
    directives: list[str]
    exports: dict[str, str]
    srun_options: list[str]
    container: list[str]
    task: str
    # The derived port (used unless spec.master_port fixes it), as in
    # agreed.slurm_port_for_job.
    port_base: int = SLURM_PORT_BASE
    port_span: int = SLURM_PORT_SPAN
    port_skips: tuple[int, ...] = SLURM_PORT_SKIPS

    @property
    def directive_words(self) -> list[str]:
        return [sbatch_word(d) for d in self.directives]

    @property
    def same_error_code(self) -> int:
        """An agent's exit on the same error twice (a bug): the step is not
        relaunched and the job not requeued (templates/slurm)."""
        return int(ExitCode.SAME_ERROR)

    @property
    def own_metrics(self) -> str | None:
        """DDPKIT_METRICS for a program of the user's own (templates/slurm): its
        preamble's metrics records go on the records channel, the job's records
        folder, where `ddpkit report` reads them; None for ddpkit's own programs
        (ddpkit train writes the --metrics file it is given)."""
        return None if is_ddpkit_module(self.spec.command.module) else METRICS_TO_LAUNCHER

    @property
    def failed_file(self) -> str:
        """Where the agent on node `$host` left when its workers failed and its
        exit code (agreed.NODE_FAILURE_FILE, in the records folder; this run's:
        a requeued job keeps its id), as the batch shell expands it."""
        name = NODE_FAILURE_FILE.format(node="${host}", run="${SLURM_RESTART_COUNT:-0}")
        return f"${{{envnames.DDPKIT_RECORDS}}}/{name}"

    @property
    def left_behind_s(self) -> int:
        """Whole seconds an elastic step's tasks may outlive finished training
        (templates/slurm: a node the others left behind): watchdog.loss_s."""
        return math.ceil(self.spec.watchdog.loss_s)

    @property
    def srun_words(self) -> list[str]:
        # Single-quoted when it holds a comma: shellcheck reads a bare a,b
        # in an array as a mistaken separator.
        return [o if o in ALLOCATION_SIZE else single_quoted(o) if "," in o else shell_word(o)
                for o in self.srun_options]


def plan(spec: JobSpec) -> SlurmPlan:
    launch = resolve(spec, target_for(spec))
    return SlurmPlan(spec, sbatch_directives(spec), exports(launch), srun_options(spec),
                container_prefix(spec), task_argv(launch))


def build(spec: JobSpec) -> list[OutputFile]:
    refuse(spec, target_for(spec))
    runtime = spec.slurm.container.runtime
    warning = None if runtime == "none" else mounts.container_checkpoint_warning(spec, f"slurm {runtime}")
    return [OutputFile(filename(spec), TEMPLATE, {"plan": plan(spec)}, "shell", 0o755,
                       notes=(warning,) if warning else ())]


def container_mounts(spec: JobSpec) -> list[str]:
    """Slurm's own container mounts, then the job's (every container target's)."""
    return [*spec.slurm.container.mounts, *mounts.binds(spec)]


def parse_directives(text: str) -> list[str]:
    """#SBATCH options as sbatch reads them (its own quoting, see
    quoting.sbatch_words_of): only the comment block before the first
    command counts."""
    out: list[str] = []
    for line in text.split("\n")[1:]:  # sbatch splits on \n only, not on \v, \f or U+2028
        if line.startswith("#SBATCH"):
            words = sbatch_words_of(line[len("#SBATCH"):])
            if len(words) != 1:
                raise RenderError(f"malformed directive line {line!r}: one option per line")
            out += words
        elif line.strip() and not line.startswith("#"):
            break
    return out


ENV_BLOCK_END = "\n# ---- Rendezvous"


def read_exports(text: str, names: list[str]) -> dict[str, str]:
    """Run the script's environment block in bash (nothing else) and read
    the named variables back, byte for byte."""
    block = text.split(ENV_BLOCK_END, 1)[0]
    script = block + "\n" + "".join(f'printf "%s\\0" "${{{n}-}}"\n' for n in names)
    out = subprocess.run(["bash", "--norc", "-c", script], capture_output=True, check=True, env={}).stdout
    return dict(zip(names, out.decode("utf-8", "surrogateescape").split("\0")[:-1]))


def verify(spec: JobSpec, rendered: Rendered) -> None:
    name = filename(spec)
    text = rendered.files[name]
    if not text.startswith("#!/bin/bash\n"):
        raise RenderError(f"{name}: must start with #!/bin/bash (sbatch reads directives after it)")
    got = parse_directives(text)
    if got != sbatch_directives(spec):
        raise RenderError(f"{name}: #SBATCH lines {got} do not match the spec {sbatch_directives(spec)}")
    p = plan(spec)
    env = read_exports(text, list(p.exports))
    missing = {k: v for k, v in p.exports.items() if env.get(k) != v}
    if missing:
        raise RenderError(f"{name}: exports differ from the job env for {sorted(missing)}")
    if p.task not in text:
        raise RenderError(f"{name}: the task command is missing")
    # the step options and the container words (the image in the runtime's syntax)
    missing_words = [w for w in p.srun_words + [shell_word(w) for w in p.container] if f"\n  {w}\n" not in text]
    if missing_words:
        raise RenderError(f"{name}: srun / container words missing: {missing_words}")
