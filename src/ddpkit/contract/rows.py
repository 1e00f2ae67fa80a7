"""The rank contract as data: one row per target saying where a node learns
its node rank, the master's address and port, how an elastic job's
rendezvous is named (or why the target refuses one), and the host names;
the functions that read a row (sources, ports, hosts, rendezvous timeouts,
the variables ddpkit injects on the targets it controls)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from ..rendezvous.timing import CLOSE_FLOOR_S, LAST_CALL_FLOOR_S, derive, torchrun_defaults
from ..shared import envnames
from ..shared.agreed import DEFAULT_PORT, PYTORCHJOB_DEFAULT_PORT, RDZV_FIRST_ROUND_KEY, RDZV_HANDLER
from ..spec import JobSpec
from .parts import FromNode, Part, RowKey, Sources


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
    # Where the target renders the rendezvous store as a service of its own
    # beside the nodes (`python -m ddpkit.rdzv_store`), its host name: every
    # agent is then its client and none hosts it, so node 0 may go as any.
    # None: the store is at the master address (an agent or a launcher hosts it).
    store_service: Callable[[JobSpec], str] | None = None
    # Where the target allocates an elastic job between min_nodes and nodes,
    # the variable that holds the count its nodes run with: torchrun's
    # --nnodes maximum, so that a rendezvous closes once they are all in
    # rather than waiting its last call for nodes the target never gave.
    max_nodes: FromNode | None = None


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


COMPOSE_STORE_SERVICE = "rdzv"  # the compose service (and host name) of an elastic job's store


def pytorchjob_store_service(spec: JobSpec) -> str:
    """The Service (and Job) of an elastic PyTorchJob's store: unique
    in the namespace as the job's own name is."""
    return f"{spec.name}-rdzv"


def _ssh_hosts(spec: JobSpec) -> list[str]:
    return list(spec.ssh.hosts) if spec.ssh.hosts else _numbered(1)(spec)


# The rank contract, one row per target (docs/CONTRACT.md prints it).
CONTRACT: dict[RowKey, ContractRow] = {
    RowKey.SLURM: ContractRow(
        controller="slurm", node_rank=FromNode(envnames.SLURM_NODEID),
        master_addr=_BATCH_ADDR, master_port=_BATCH_PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=None, hosts=_numbered(1),
        elastic=ElasticRow(FromNode(envnames.SLURM_JOB_ID), max_nodes=FromNode(envnames.SLURM_NNODES))),
    RowKey.SLURM_SRUN: ContractRow(
        controller="slurm", node_rank=FromNode(envnames.SLURM_NODEID),
        master_addr=_BATCH_ADDR, master_port=_BATCH_PORT,
        world_size=f"srun: {envnames.SLURM_NTASKS}, read by the entrypoint", interface=SPEC_INTERFACE,
        default_port=None, hosts=_numbered(1),
        elastic=ElasticRow(None, "slurm.mode: srun starts every process itself and has no torchrun agent to "
                                 "re-form the job after a node loss; set slurm.mode: torchrun")),
    RowKey.PYTORCHJOB: ContractRow(
        controller="kubeflow training-operator", node_rank=FromNode(envnames.PET_NODE_RANK),
        master_addr=FromNode(envnames.MASTER_ADDR), master_port=FromNode(envnames.MASTER_PORT),
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=PYTORCHJOB_DEFAULT_PORT,
        hosts=_pytorchjob_hosts, controller_sets_unbuffered=True,
        # The name is unique in its namespace while the job exists, and the
        # store lives in this job's own rendezvous Job and Service (no Master pod
        # holds it, so the Master may be lost as any Worker): no other run can
        # reach it. 90 s of last call at least: a failed pod restarts in place
        # (restartPolicy OnFailure) and rejoins within it, so the others do not
        # restart twice; 90 s to close, as the operator's own examples.
        elastic=ElasticRow(Fixed.JOB_NAME, last_call_floor_s=90, close_floor_s=90,
                           store_service=pytorchjob_store_service)),
    RowKey.INDEXED_JOB: ContractRow(
        controller="kubernetes job controller", node_rank=FromNode(envnames.JOB_COMPLETION_INDEX),
        master_addr=Fixed.NODE0_HOST, master_port=Fixed.PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=DEFAULT_PORT,
        hosts=lambda spec: [f"{spec.name}-{i}.{k8s_service_name(spec)}" for i in range(spec.nodes)],
        elastic=ElasticRow(None, "ddpkit's Indexed Job fails as a whole on a pod failure and completes only "
                                 "when every index succeeds (keeping survivors would need successPolicy, "
                                 "Kubernetes 1.31+, not rendered yet); use k8s.kind: pytorchjob (elasticPolicy)")),
    RowKey.TRAINJOB: ContractRow(
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
    RowKey.JOBSET: ContractRow(
        controller="jobset controller + kubernetes job controller",
        node_rank=FromNode(envnames.JOB_COMPLETION_INDEX),
        master_addr=Fixed.NODE0_HOST, master_port=Fixed.PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=DEFAULT_PORT,
        hosts=lambda spec: [f"{spec.name}-node-0-{i}.{spec.name}" for i in range(spec.nodes)],
        elastic=ElasticRow(None, "a JobSet's failure policy restarts or fails the whole set, it never keeps "
                                 "the survivors; use k8s.kind: pytorchjob (elasticPolicy)")),
    # ssh, compose, local: ddpkit writes each node's rank into that node's
    # command as DDPKIT_NODE_RANK, and node 0's host and the port literally.
    RowKey.SSH: ContractRow(
        controller=DDPKIT, node_rank=FromNode(envnames.DDPKIT_NODE_RANK),
        master_addr=Fixed.NODE0_HOST, master_port=Fixed.PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=DEFAULT_PORT, hosts=_ssh_hosts,
        # a fresh id per run: the launcher (launch ssh, launch.sh) passes it on every node's env prefix
        elastic=ElasticRow(FromNode(envnames.DDPKIT_RDZV_ID))),
    RowKey.COMPOSE: ContractRow(
        controller=DDPKIT, node_rank=FromNode(envnames.DDPKIT_NODE_RANK),
        master_addr=Fixed.NODE0_HOST, master_port=Fixed.PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE + "; compose.cpu_test: gloo on CPU",
        default_port=DEFAULT_PORT, hosts=_numbered(0),
        # the store is the rdzv service's, fresh after every `down`; a fresh
        # run key (the header says so) makes the id fresh for each run
        elastic=ElasticRow(Fixed.JOB_NAME, store_service=lambda spec: COMPOSE_STORE_SERVICE)),
    RowKey.LOCAL: ContractRow(
        controller=DDPKIT, node_rank=FromNode(envnames.DDPKIT_NODE_RANK),
        master_addr=Fixed.NODE0_HOST, master_port=Fixed.PORT,
        world_size=TORCHRUN_WORLD, interface=SPEC_INTERFACE, default_port=DEFAULT_PORT,
        hosts=lambda spec: ["127.0.0.1"] * spec.nodes,
        # a fresh id per run, in each agent's environment (launch local)
        elastic=ElasticRow(FromNode(envnames.DDPKIT_RDZV_ID))),
}


def master_port(spec: JobSpec, target: RowKey) -> int | None:
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


def hosts_for(spec: JobSpec, target: RowKey, hosts: list[str] | None = None) -> list[str]:
    """The name each node is reachable by, in node-rank order."""
    return list(hosts) if hosts is not None else CONTRACT[target].hosts(spec)


def sources(spec: JobSpec, target: RowKey, hosts: list[str] | None = None) -> Sources:
    """The target's row as launch-line parts. `hosts` (node-rank order)
    overrides the target's default names, e.g. the lines of an SSH hostfile."""
    row = CONTRACT[target]
    fixed = {Fixed.NODE0_HOST: hosts_for(spec, target, hosts)[0], Fixed.PORT: str(master_port(spec, target)),
             Fixed.JOB_NAME: spec.name}

    def part(origin: Origin) -> Part:
        return fixed[origin] if isinstance(origin, Fixed) else origin

    rdzv_id = row.elastic.rdzv_id
    src = Sources(part(row.node_rank), part(row.master_addr), part(row.master_port),
                  None if rdzv_id is None else part(rdzv_id), target,
                  max_nodes=row.elastic.max_nodes if spec.elastic is not None else None)
    service = row.elastic.store_service
    if spec.elastic is None or service is None:
        return src
    return dataclasses.replace(src, master_addr=service(spec), store_host="0")


def elastic_refusal(spec: JobSpec, target: RowKey) -> str | None:
    """Why `target` cannot render this elastic job (None: it can, or the
    job is not elastic). The target raises it as an input error (exit 2)
    before any file is written."""
    row = CONTRACT[target].elastic
    if spec.elastic is None or row.rdzv_id is not None:
        return None
    return f"elastic on {target.value}: {row.refusal}"


def elastic_rdzv_backend(spec: JobSpec) -> str:
    """torchrun's --rdzv-backend for an elastic job: ddpkit's handler (torch's
    c10d with the round after a loss completed without the last call,
    rendezvous.py) for every program, since every node runs ddpkit's agent,
    which registers it; torch's own c10d for `elastic.rendezvous: torchrun`."""
    ddpkit = spec.elastic is not None and spec.elastic.rendezvous == "ddpkit"
    return RDZV_HANDLER if ddpkit else "c10d"


def rdzv_conf(spec: JobSpec, target: RowKey) -> dict[str, int]:
    """torchrun's c10d --rdzv-conf for an elastic job on `target`: the
    spec's join timeout, then the keep-alive, last call (the spec's when
    set) and close timeout derived from watchdog.loss_s and the node count
    with the target's floors (rdzv_timing.derive; docs/DESIGN-NOTES.md says why
    each), or torchrun's own (elastic.rendezvous "torchrun")."""
    row = CONTRACT[target].elastic
    last_call_s = spec.elastic.last_call_s if spec.elastic is not None else None
    if spec.elastic is not None and spec.elastic.rendezvous == "torchrun":
        timing = torchrun_defaults(row.last_call_floor_s, row.close_floor_s, last_call_s)
    else:
        timing = derive(spec.watchdog.loss_s, spec.nodes, row.last_call_floor_s, row.close_floor_s, last_call_s)
    conf = {"join_timeout": spec.rendezvous.timeout_s, "last_call_timeout": timing.last_call_timeout,
            "close_timeout": timing.close_timeout, "keep_alive_interval": timing.keep_alive_interval,
            "keep_alive_max_attempt": timing.keep_alive_max_attempt}
    if spec.elastic is not None and spec.elastic.rendezvous == "ddpkit" and spec.elastic.first_round_s is not None:
        conf[RDZV_FIRST_ROUND_KEY] = spec.elastic.first_round_s  # absent: the handler's default
    return conf


def controller_env(spec: JobSpec, target: RowKey, index: int) -> dict[str, str]:
    """The variables ddpkit injects on node `index` of a target it controls
    (ssh, compose, local). Other targets' controllers inject their own; the
    tests emulate those (tests/emulators.py)."""
    row = CONTRACT[target]
    if not row.ddpkit_controls or not isinstance(row.node_rank, FromNode):
        raise ValueError(f"{target.value}: node variables are injected by the {row.controller}, not by ddpkit")
    return {row.node_rank.var: str(index)}


