"""The environment every process of a job gets on a target: the user's
variables, then what ddpkit owns (interface, backend, elastic store,
watchdog, OpenMP threads, unbuffered output)."""

from __future__ import annotations

from ..shared import envnames
from ..shared.agreed import STRAGGLER_FACTOR
from ..spec import JobSpec
from .parts import RowKey
from .rows import CONTRACT


def interface_env(spec: JobSpec) -> dict[str, str]:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for a named interface. For
    'auto' nothing is fixed here: the entrypoint picks the interface that
    routes to the master and sets both at start-up."""
    if spec.network.is_auto:
        return {}
    value = spec.network.ifname_value
    return dict.fromkeys(envnames.SOCKET_IFNAMES, value)


def target_env(spec: JobSpec, target: RowKey | None = None) -> dict[str, str]:
    """The environment every process of the job gets on `target` (None: a
    launcher that is no render target), in a stable order: the user's
    variables, then what ddpkit owns. PYTHONUNBUFFERED=1, because a log line
    must reach the launcher when it is printed, not when a buffer fills;
    a value the user set wins, and it is left out where the controller
    already sets it."""
    row = CONTRACT[target] if target is not None else None
    env = dict(spec.env)
    env.update(interface_env(spec))
    env[envnames.DDPKIT_BACKEND] = (row.backend if row else None) or spec.resolved_backend
    env[envnames.DDPKIT_INTERFACE] = spec.network.ifname_value
    env[envnames.DDPKIT_JOB_NAME] = spec.name
    env.update(elastic_env(spec))
    env.update(watchdog_env(spec, env[envnames.DDPKIT_BACKEND]))
    env.update(omp_env(spec, target))
    if spec.preamble.off():
        env[envnames.DDPKIT_PREAMBLE] = ",".join(spec.preamble.off())
    if spec.command.workdir:
        env[envnames.DDPKIT_WORKDIR] = str(spec.command.workdir)
    if not (row and row.controller_sets_unbuffered):
        env.setdefault(envnames.PYTHONUNBUFFERED, "1")
    return env


def cpus_per_process(spec: JobSpec, target: RowKey | None) -> int | None:
    """The CPUs one training process gets, where the spec says:
    resources.cpus_per_process, or where a target's own field overrides it
    (a Kubernetes pod's cpu, compose's cpus_per_node) that shared by the
    node's processes (at least 1); None where it does not."""
    per_node: float | None = None
    if target in (RowKey.PYTORCHJOB, RowKey.INDEXED_JOB, RowKey.TRAINJOB, RowKey.JOBSET) and spec.k8s.cpu:
        cpu = spec.k8s.cpu.strip()
        try:
            per_node = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
        except ValueError:
            return None
    elif target is RowKey.COMPOSE:
        per_node = spec.compose.cpus_per_node
    return spec.resources.cpus_per_process if per_node is None else max(1, int(per_node // spec.nproc_per_node))


def omp_env(spec: JobSpec, target: RowKey | None) -> dict[str, str]:
    """OMP_NUM_THREADS for every process, unless the user's `env:` sets it:
    the CPUs per process where the spec knows them, else 1 where torchrun
    runs more than one process per node (what torchrun itself would set,
    printing its "Setting OMP_NUM_THREADS ... to be 1 in default" banner on
    every node). A job with one process per node, or srun mode, and no CPU
    count keeps OpenMP's own default (every core), as before."""
    if envnames.OMP_NUM_THREADS in spec.env:
        return {}
    cpus = cpus_per_process(spec, target)
    if cpus is not None:
        return {envnames.OMP_NUM_THREADS: str(cpus)}
    if spec.nproc_per_node > 1 and target is not RowKey.SLURM_SRUN:
        return {envnames.OMP_NUM_THREADS: "1"}
    return {}


def elastic_env(spec: JobSpec) -> dict[str, str]:
    """An elastic job's workers meet through a store their own rank 0 opens
    afresh at every restart. torchrun's default shares one store server,
    opened by the first rendezvous' rank-0 agent, across all rounds: its
    keys from the previous world (peers' old addresses) mislead the next
    one, and it dies with that agent's node."""
    return {envnames.TORCH_DISABLE_SHARE_RDZV_TCP_STORE: "1"} if spec.elastic else {}


def watchdog_env(spec: JobSpec, backend: str) -> dict[str, str]:
    """The hang watchdog's settings, and with NCCL the flight recorder on
    (a ring of the last collectives, dumped when one times out); a value the
    user set in `env:` wins."""
    wd = spec.watchdog
    env = {envnames.DDPKIT_WATCHDOG_STALL_S: f"{wd.stall_s:g}" if wd.enabled else "0"}
    if wd.first_step_s is not None:
        env[envnames.DDPKIT_WATCHDOG_FIRST_STEP_S] = f"{wd.first_step_s:g}"
    if wd.straggler_factor != STRAGGLER_FACTOR:  # the job's default otherwise (rendered files stay as they were)
        env[envnames.DDPKIT_WATCHDOG_STRAGGLER_FACTOR] = f"{wd.straggler_factor:g}"
    if "loss_s" in wd.model_fields_set:  # the default is the trainer's own (stall_model.Settings)
        env[envnames.DDPKIT_WATCHDOG_LOSS_S] = f"{wd.loss_s:g}"
    if backend == "nccl":
        env[envnames.TORCH_NCCL_TRACE_BUFFER_SIZE] = "2000"
        env[envnames.TORCH_NCCL_DUMP_ON_TIMEOUT] = "1"
    return {k: v for k, v in env.items() if k not in spec.env}


def job_env(spec: JobSpec) -> dict[str, str]:
    """target_env for a launcher that is no render target (PYTHONUNBUFFERED
    included)."""
    return target_env(spec)

