"""The rank / rendezvous / interface contract.

For every target: world_size = nnodes * nproc_per_node,
rank = node_rank * nproc_per_node + local_rank, node 0 hosts the rendezvous.
What differs per target is *where* a node learns its node rank and the
master's address: a variable its controller sets, a line in a hostfile, a
service name. This module says so, as data, and nothing here does I/O.

Values that must expand on the node (not on the machine that renders or
submits) are `FromNode` parts; every renderer turns them into its own syntax
(`"$VAR"` in shell, `$(VAR)` in Kubernetes) in exactly one place.

What the trainer must read back on the node (default ports, the Slurm port
rule, stop signals, flag names, the device rule) lives in wire.py, which
`ddpkit train` imports without this module and the spec behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from . import envnames
from .rdzv_timing import CLOSE_FLOOR_S, LAST_CALL_FLOOR_S, derive
from .spec import JobSpec
from .wire import (
    DEFAULT_PORT,
    KEEP_GLOBAL_BATCH_FLAG,
    PYTORCHJOB_DEFAULT_PORT,
    STRAGGLER_FACTOR,
    TORCHRUN_DEFAULT_SIGNALS,
    TRAINER_STOP_SIGNALS,
)


class Target(str, Enum):
    SLURM = "slurm"  # one srun task per node, running torchrun
    SLURM_SRUN = "slurm-srun"  # one srun task per process; the entrypoint reads SLURM_*
    SSH = "ssh"
    COMPOSE = "compose"
    PYTORCHJOB = "pytorchjob"
    INDEXED_JOB = "indexed-job"
    TRAINJOB = "trainjob"
    JOBSET = "jobset"
    LOCAL = "local"


@dataclass(frozen=True)
class FromNode:
    """A value the node supplies at run time from its environment."""

    var: str


Part = str | FromNode


@dataclass(frozen=True)
class Arg:
    """One argv token, possibly mixing literal text and node-side variables."""

    parts: tuple[Part, ...]

    @classmethod
    def of(cls, *parts: Part | int) -> Arg:
        return cls(tuple(p if isinstance(p, FromNode) else str(p) for p in parts))

    def resolve(self, env: dict[str, str]) -> str:
        return "".join(env[p.var] if isinstance(p, FromNode) else p for p in self.parts)


@dataclass(frozen=True)
class Sources:
    """Where a node reads its node rank, master address and port."""

    node_rank: Part
    master_addr: Part
    master_port: Part
    rdzv_id: Part | None = None  # the elastic rendezvous id (None: the target cannot run elastic)
    target: Target | None = None  # whose row these came from (elastic: its rendezvous timeouts)
    # "1" on the node that hosts the c10d store, "0" elsewhere: only where every
    # agent sees its own host in the endpoint (launch local), so each would try to host it.
    store_host: Part | None = None


class Fixed(str, Enum):
    """A contract value ddpkit writes literally into the launch line at
    render time (no variable on the node carries it)."""

    NODE0_HOST = "node 0's host name"
    PORT = "the target's port (master_port, or its default)"
    JOB_NAME = "the job's name"


@dataclass(frozen=True)
class ElasticRow:
    """How a target runs an elastic job (spec.elastic), or why it cannot.

    `rdzv_id` names this run of the job, so that agents of two runs never
    meet in one rendezvous. Its timeouts derive from watchdog.loss_s
    (rdzv_timing.derive); a row only raises their floors: the last call
    (how long a rendezvous that has min_nodes waits for more, paid at every
    membership change) and the close timeout (how long agents wait for the
    rendezvous to close when the job ends)."""

    rdzv_id: Origin | None
    refusal: str = ""  # when rdzv_id is None: why, and what to use instead
    last_call_floor_s: int = LAST_CALL_FLOOR_S
    close_floor_s: int = CLOSE_FLOOR_S


Origin = FromNode | Fixed


@dataclass(frozen=True)
class ContractRow:
    """One target's row of the rank contract: where a node learns each value.

    `node_rank`, `master_addr` and `master_port` are a variable the node
    reads (FromNode) or a value rendered into its launch line (Fixed).
    `world_size` and `interface` say in words where those come from (the
    same launch-line flags and job env on every torchrun target)."""

    controller: str  # who starts the nodes and injects their variables
    node_rank: Origin
    master_addr: Origin
    master_port: Origin
    world_size: str
    interface: str
    default_port: int | None  # None: derived at run time (Slurm: from the job id)
    hosts: Callable[[JobSpec], list[str]]  # the name each node is reachable by, node-rank order
    # The controller already sets PYTHONUNBUFFERED=1 (the PyTorchJob operator
    # appends it to every container): the job env must not list it twice.
    controller_sets_unbuffered: bool = False
    backend: str | None = None  # a backend the target forces, whatever the spec says
    elastic: ElasticRow = ElasticRow(None, "this target cannot run an elastic job")  # each row names its reason

    @property
    def ddpkit_controls(self) -> bool:
        """ddpkit itself (its launcher or rendered file) injects the node rank."""
        return self.controller == DDPKIT


DDPKIT = "ddpkit"
TORCHRUN_WORLD = "torchrun: --nnodes x --nproc-per-node in the launch line"
SPEC_INTERFACE = f"job env: {envnames.NCCL_SOCKET_IFNAME} / {envnames.GLOO_SOCKET_IFNAME} (or picked at start-up: auto)"
# The batch script computes MASTER_ADDR / MASTER_PORT once and exports them;
# SLURM_NODEID must be read inside each srun task.
_BATCH_ADDR, _BATCH_PORT = FromNode(envnames.MASTER_ADDR), FromNode(envnames.MASTER_PORT)


def _numbered(first: int) -> Callable[[JobSpec], list[str]]:
    return lambda spec: [f"node{i + first}" for i in range(spec.nodes)]


def _pytorchjob_hosts(spec: JobSpec) -> list[str]:
    return [f"{spec.name}-master-0"] + [f"{spec.name}-worker-{i}" for i in range(spec.nodes - 1)]


def _ssh_hosts(spec: JobSpec) -> list[str]:
    return list(spec.ssh.hosts) if spec.ssh.hosts else _numbered(1)(spec)


# The rank contract, one row per target (docs/ARCHITECTURE.md prints it).
CONTRACT: dict[Target, ContractRow] = {
    Target.SLURM: ContractRow(
        controller="slurm", node_rank=FromNode(envnames.SLURM_NODEID),
        master_addr=_BATCH_ADDR, master_port=_BATCH_PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=None, hosts=_numbered(1),
        elastic=ElasticRow(FromNode(envnames.SLURM_JOB_ID))),
    Target.SLURM_SRUN: ContractRow(
        controller="slurm", node_rank=FromNode(envnames.SLURM_NODEID),
        master_addr=_BATCH_ADDR, master_port=_BATCH_PORT,
        world_size=f"srun: {envnames.SLURM_NTASKS}, read by the entrypoint", interface=SPEC_INTERFACE,
        default_port=None, hosts=_numbered(1),
        elastic=ElasticRow(None, "slurm.mode: srun starts every process itself and has no torchrun agent to "
                                 "re-form the job after a node loss; set slurm.mode: torchrun")),
    Target.PYTORCHJOB: ContractRow(
        controller="kubeflow training-operator", node_rank=FromNode(envnames.PET_NODE_RANK),
        master_addr=FromNode(envnames.MASTER_ADDR), master_port=FromNode(envnames.MASTER_PORT),
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=PYTORCHJOB_DEFAULT_PORT,
        hosts=_pytorchjob_hosts, controller_sets_unbuffered=True,
        # The name is unique in its namespace while the job exists, and the
        # store lives in this job's Master pod: no other run can reach it.
        # 90 s of last call at least: a failed Worker pod restarts in place
        # (restartPolicy OnFailure) and rejoins within it, so the others do not
        # restart twice; 90 s to close, as the operator's own examples.
        elastic=ElasticRow(Fixed.JOB_NAME, last_call_floor_s=90, close_floor_s=90)),
    Target.INDEXED_JOB: ContractRow(
        controller="kubernetes job controller", node_rank=FromNode(envnames.JOB_COMPLETION_INDEX),
        master_addr=Fixed.NODE0_HOST, master_port=Fixed.PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=DEFAULT_PORT,
        hosts=lambda spec: [f"{spec.name}-{i}.{k8s_service_name(spec)}" for i in range(spec.nodes)],
        elastic=ElasticRow(None, "ddpkit's Indexed Job fails as a whole on a pod failure and completes only "
                                 "when every index succeeds (keeping survivors would need successPolicy, "
                                 "Kubernetes 1.31+, not rendered yet); use k8s.kind: pytorchjob (elasticPolicy)")),
    Target.TRAINJOB: ContractRow(
        controller="kubeflow trainer", node_rank=FromNode(envnames.PET_NODE_RANK),
        master_addr=FromNode(envnames.PET_MASTER_ADDR), master_port=FromNode(envnames.PET_MASTER_PORT),
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=DEFAULT_PORT,
        hosts=lambda spec: [f"{spec.name}-node-0-{i}.{spec.name}" for i in range(spec.nodes)],
        elastic=ElasticRow(None, "Kubeflow Trainer's TrainJob has a fixed numNodes (min:max nodes is on its "
                                 "roadmap, not in its API); use k8s.kind: pytorchjob (elasticPolicy)")),
    # JobSet (jobset.x-k8s.io): one replicated Job "node" with one Indexed
    # Job; with network.enableDNSHostnames the pod host name is
    # <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>, the subdomain
    # defaults to the JobSet's name and JobSet creates that headless Service.
    Target.JOBSET: ContractRow(
        controller="jobset controller + kubernetes job controller",
        node_rank=FromNode(envnames.JOB_COMPLETION_INDEX),
        master_addr=Fixed.NODE0_HOST, master_port=Fixed.PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=DEFAULT_PORT,
        hosts=lambda spec: [f"{spec.name}-node-0-{i}.{spec.name}" for i in range(spec.nodes)],
        elastic=ElasticRow(None, "a JobSet's failure policy restarts or fails the whole set, it never keeps "
                                 "the survivors; use k8s.kind: pytorchjob (elasticPolicy)")),
    # ssh, compose, local: ddpkit writes each node's rank into that node's
    # command as DDPKIT_NODE_RANK, and node 0's host and the port literally.
    Target.SSH: ContractRow(
        controller=DDPKIT, node_rank=FromNode(envnames.DDPKIT_NODE_RANK),
        master_addr=Fixed.NODE0_HOST, master_port=Fixed.PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=DEFAULT_PORT, hosts=_ssh_hosts,
        # a fresh id per run: the launcher (launch ssh, launch.sh) passes it on every node's env prefix
        elastic=ElasticRow(FromNode(envnames.DDPKIT_RDZV_ID))),
    Target.COMPOSE: ContractRow(
        controller=DDPKIT, node_rank=FromNode(envnames.DDPKIT_NODE_RANK),
        master_addr=Fixed.NODE0_HOST, master_port=Fixed.PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE + "; compose.cpu_test: gloo on CPU",
        default_port=DEFAULT_PORT, hosts=_numbered(0),
        # every `up` starts a fresh node0 container and so a fresh store
        elastic=ElasticRow(Fixed.JOB_NAME)),
    Target.LOCAL: ContractRow(
        controller=DDPKIT, node_rank=FromNode(envnames.DDPKIT_NODE_RANK),
        master_addr=Fixed.NODE0_HOST, master_port=Fixed.PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=DEFAULT_PORT,
        hosts=lambda spec: ["127.0.0.1"] * spec.nodes,
        # a fresh id per run, in each agent's environment (launch local)
        elastic=ElasticRow(FromNode(envnames.DDPKIT_RDZV_ID))),
}


def master_port(spec: JobSpec, target: Target) -> int | None:
    """The fixed master port for a target, or None when it is derived at run
    time (Slurm: from SLURM_JOB_ID)."""
    if spec.master_port is not None:
        return spec.master_port
    return CONTRACT[target].default_port


def k8s_service_name(spec: JobSpec) -> str:
    return spec.name


def one_host_gpus(spec: JobSpec, node: int) -> list[int]:
    """The GPUs node `node` gets where every node is a container on one
    Docker host (compose, launch docker): its own block of gpus_per_node,
    since a count alone gives every container the same first GPUs."""
    per_node = spec.gpus_per_node
    return list(range(node * per_node, (node + 1) * per_node))


def hosts_for(spec: JobSpec, target: Target, hosts: list[str] | None = None) -> list[str]:
    """The name each node is reachable by, in node-rank order."""
    return list(hosts) if hosts is not None else CONTRACT[target].hosts(spec)


def sources(spec: JobSpec, target: Target, hosts: list[str] | None = None) -> Sources:
    """The target's row as launch-line parts. `hosts` (node-rank order)
    overrides the target's default names, e.g. the lines of an SSH hostfile."""
    row = CONTRACT[target]
    fixed = {Fixed.NODE0_HOST: hosts_for(spec, target, hosts)[0], Fixed.PORT: str(master_port(spec, target)),
             Fixed.JOB_NAME: spec.name}

    def part(origin: Origin) -> Part:
        return fixed[origin] if isinstance(origin, Fixed) else origin

    rdzv_id = row.elastic.rdzv_id
    return Sources(part(row.node_rank), part(row.master_addr), part(row.master_port),
                   None if rdzv_id is None else part(rdzv_id), target)


def elastic_refusal(spec: JobSpec, target: Target) -> str | None:
    """Why `target` cannot render this elastic job (None: it can, or the
    job is not elastic). The target raises it as an input error (exit 2)
    before any file is written."""
    row = CONTRACT[target].elastic
    if spec.elastic is None or row.rdzv_id is not None:
        return None
    return f"elastic on {target.value}: {row.refusal}"


def rdzv_conf(spec: JobSpec, target: Target) -> dict[str, int]:
    """torchrun's c10d --rdzv-conf for an elastic job on `target`: the
    spec's join timeout, then the keep-alive, last call (the spec's when
    set) and close timeout derived from watchdog.loss_s with the target's
    floors (rdzv_timing.derive; docs/ELASTIC.md says why each)."""
    row = CONTRACT[target].elastic
    timing = derive(spec.watchdog.loss_s, row.last_call_floor_s, row.close_floor_s,
                    spec.elastic.last_call_s if spec.elastic is not None else None)
    return {"join_timeout": spec.rendezvous.timeout_s, "last_call_timeout": timing.last_call_timeout,
            "close_timeout": timing.close_timeout, "keep_alive_interval": timing.keep_alive_interval,
            "keep_alive_max_attempt": timing.keep_alive_max_attempt}


def controller_env(spec: JobSpec, target: Target, index: int) -> dict[str, str]:
    """The variables ddpkit injects on node `index` of a target it controls
    (ssh, compose, local). Other targets' controllers inject their own; the
    tests emulate those (tests/emulators.py)."""
    row = CONTRACT[target]
    if not row.ddpkit_controls or not isinstance(row.node_rank, FromNode):
        raise ValueError(f"{target.value}: node variables are injected by the {row.controller}, not by ddpkit")
    return {row.node_rank.var: str(index)}


def interface_env(spec: JobSpec) -> dict[str, str]:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for a named interface. For
    'auto' nothing is fixed here: the entrypoint picks the interface that
    routes to the master and sets both at start-up."""
    if spec.network.is_auto:
        return {}
    value = spec.network.ifname_value
    return dict.fromkeys(envnames.SOCKET_IFNAMES, value)


def target_env(spec: JobSpec, target: Target | None = None) -> dict[str, str]:
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
    if not (row and row.controller_sets_unbuffered):
        env.setdefault(envnames.PYTHONUNBUFFERED, "1")
    return env


def cpus_per_process(spec: JobSpec, target: Target | None) -> int | None:
    """The CPUs one training process gets, where the spec says:
    resources.cpus_per_process, or where a target's own field overrides it
    (a Kubernetes pod's cpu, compose's cpus_per_node) that shared by the
    node's processes (at least 1); None where it does not."""
    per_node: float | None = None
    if target in (Target.PYTORCHJOB, Target.INDEXED_JOB, Target.TRAINJOB, Target.JOBSET) and spec.k8s.cpu:
        cpu = spec.k8s.cpu.strip()
        try:
            per_node = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
        except ValueError:
            return None
    elif target is Target.COMPOSE:
        per_node = spec.compose.cpus_per_node
    return spec.resources.cpus_per_process if per_node is None else max(1, int(per_node // spec.nproc_per_node))


def omp_env(spec: JobSpec, target: Target | None) -> dict[str, str]:
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
    if spec.nproc_per_node > 1 and target is not Target.SLURM_SRUN:
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


def nnodes(spec: JobSpec) -> str:
    """torchrun's --nnodes: N, or MIN:MAX for an elastic job."""
    return f"{spec.elastic.min_nodes}:{spec.nodes}" if spec.elastic else str(spec.nodes)


def _conf_word(conf: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in conf.items())


def rendezvous_args(spec: JobSpec, src: Sources) -> list[Arg]:
    """How the agents meet: static ranks from the target, c10d on node 0,
    or (spec.elastic) c10d with this run's id, the target's timeouts and
    restarts; always ending with --max-restarts."""
    if spec.elastic is not None:
        target = src.target
        if src.rdzv_id is None or target is None:
            # targets refuse such a job first (elastic_refusal); reaching here is a bug
            raise ValueError(elastic_refusal(spec, target) if target else "elastic: sources() names no target")
        return [
            Arg.of("--rdzv-backend=c10d"),
            Arg.of("--rdzv-endpoint=", src.master_addr, ":", src.master_port),
            Arg.of("--rdzv-id=", src.rdzv_id),
            Arg.of("--rdzv-conf=" + _conf_word(rdzv_conf(spec, target)),
                   *(() if src.store_host is None else (",is_host=", src.store_host))),
            Arg.of(f"--max-restarts={spec.elastic.max_restarts}"),
        ]
    if spec.rendezvous.backend == "static":
        argv = [
            Arg.of("--node-rank=", src.node_rank),
            Arg.of("--master-addr=", src.master_addr),
            Arg.of("--master-port=", src.master_port),
        ]
    else:
        argv = [
            Arg.of("--rdzv-backend=c10d"),
            Arg.of("--rdzv-endpoint=", src.master_addr, ":", src.master_port),
            Arg.of(f"--rdzv-id={spec.name}"),
            Arg.of(f"--rdzv-conf=join_timeout={spec.rendezvous.timeout_s}"),
        ]
    return argv + [Arg.of("--max-restarts=0")]


def elastic_train_args(spec: JobSpec) -> list[Arg]:
    """keep_global_batch: tell ddpkit train the world its global batch is
    sized for (the full job), so it accumulates gradients on fewer nodes."""
    if spec.elastic is None or not spec.elastic.keep_global_batch:
        return []
    return [Arg.of(KEEP_GLOBAL_BATCH_FLAG), Arg.of(spec.world_size)]


def torchrun_argv(spec: JobSpec, src: Sources, agent_flags: Sequence[Arg] = ()) -> list[Arg]:
    """The one launch line every per-node target runs. `agent_flags`: what a
    launcher asks of torchrun's agent for itself (launch local's --tee and
    log folder), placed where torchrun reads its own options."""
    argv = [
        Arg.of(spec.command.python),
        Arg.of("-m"),
        Arg.of("torch.distributed.run"),
        *agent_flags,
        Arg.of(f"--nnodes={nnodes(spec)}"),
        Arg.of(f"--nproc-per-node={spec.nproc_per_node}"),
    ]
    argv += rendezvous_args(spec, src)
    argv += stop_args(spec)
    argv += [Arg.of(a) for a in spec.command.argv()]
    argv += elastic_train_args(spec)
    return argv


def stop_args(spec: JobSpec) -> list[Arg]:
    """torchrun's half of the grace chain (spec.grace). torchrun overwrites
    TORCHELASTIC_SIGNALS_TO_HANDLE from --signals-to-handle, so only the flag
    makes its agent forward the pre-emption signal to the workers (it would
    die on SIGUSR2 otherwise); --shutdown-timeout is how long the agent then
    waits for them (their checkpoint) before SIGKILL. The agent itself exits
    1 afterwards; the workers' exit (75, pre-empted) is in their logs."""
    wanted = (*TORCHRUN_DEFAULT_SIGNALS, *TRAINER_STOP_SIGNALS, f"SIG{spec.preemption.signal}")
    signals = ",".join(dict.fromkeys(wanted))
    return [Arg.of(f"--signals-to-handle={signals}"), Arg.of(f"--shutdown-timeout={spec.grace.shutdown_s}")]


def process_argv(spec: JobSpec) -> list[Arg]:
    """The per-process line for launchers that start every rank themselves
    (Slurm srun mode): no torchrun, the entrypoint reads the launcher's variables."""
    return [Arg.of(spec.command.python)] + [Arg.of(a) for a in spec.command.argv()]
