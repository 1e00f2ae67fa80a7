"""The rank / rendezvous / interface contract.

For every target: world_size = nnodes * nproc_per_node,
rank = node_rank * nproc_per_node + local_rank, node 0 hosts the rendezvous.
What differs per target is *where* a node learns its node rank and the
master's address: a variable its controller sets, a line in a hostfile, a
service name. This module says so, as data, and nothing here does I/O.

Values that must expand on the node (not on the machine that renders or
submits) are `FromNode` parts; every renderer turns them into its own syntax
(`"$VAR"` in shell, `$(VAR)` in Kubernetes) in exactly one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from .spec import JobSpec


class Target(str, Enum):
    SLURM = "slurm"  # one srun task per node, running torchrun
    SLURM_SRUN = "slurm-srun"  # one srun task per process; the entrypoint reads SLURM_*
    SSH = "ssh"
    COMPOSE = "compose"
    PYTORCHJOB = "pytorchjob"
    INDEXED_JOB = "indexed-job"
    TRAINJOB = "trainjob"
    LOCAL = "local"


DEFAULT_PORT = 29500
PYTORCHJOB_DEFAULT_PORT = 23456  # the Kubeflow operator's default for `pytorchjob-port`
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000


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


def slurm_port_expr() -> str:
    """Bash arithmetic that derives a per-job port, so two jobs sharing nodes
    do not both bind 29500."""
    return f"$(( {SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN} ))"


def slurm_port_for_job(job_id: int) -> int:
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def master_port(spec: JobSpec, target: Target) -> int | None:
    """The fixed master port for a target, or None when it is derived at run
    time (Slurm: from SLURM_JOB_ID)."""
    if spec.master_port is not None:
        return spec.master_port
    if target in (Target.SLURM, Target.SLURM_SRUN):
        return None
    if target == Target.PYTORCHJOB:
        return PYTORCHJOB_DEFAULT_PORT
    return DEFAULT_PORT


def k8s_service_name(spec: JobSpec) -> str:
    return spec.name


def hosts_for(spec: JobSpec, target: Target, hosts: list[str] | None = None) -> list[str]:
    """The name each node is reachable by, in node-rank order."""
    if hosts is not None:
        return list(hosts)
    n = spec.nodes
    if target == Target.PYTORCHJOB:
        return [f"{spec.name}-master-0"] + [f"{spec.name}-worker-{i}" for i in range(n - 1)]
    if target == Target.INDEXED_JOB:
        return [f"{spec.name}-{i}.{k8s_service_name(spec)}" for i in range(n)]
    if target == Target.TRAINJOB:
        return [f"{spec.name}-node-0-{i}.{spec.name}" for i in range(n)]
    if target == Target.COMPOSE:
        return [f"node{i}" for i in range(n)]
    if target == Target.LOCAL:
        return ["127.0.0.1"] * n
    if target == Target.SSH and spec.ssh.hosts:
        return list(spec.ssh.hosts)
    return [f"node{i + 1}" for i in range(n)]


def sources(spec: JobSpec, target: Target, hosts: list[str] | None = None) -> Sources:
    """The table in DESIGN.md, as data. `hosts` (node-rank order) overrides
    the target's default names, e.g. the lines of an SSH hostfile."""
    hosts = hosts_for(spec, target, hosts)
    port = master_port(spec, target)
    if target in (Target.SLURM, Target.SLURM_SRUN):
        # MASTER_ADDR/PORT are computed once by the batch script and exported;
        # SLURM_NODEID must be read inside each srun task.
        return Sources(FromNode("SLURM_NODEID"), FromNode("MASTER_ADDR"), FromNode("MASTER_PORT"))
    if target == Target.PYTORCHJOB:
        return Sources(FromNode("PET_NODE_RANK"), FromNode("MASTER_ADDR"), FromNode("MASTER_PORT"))
    if target == Target.INDEXED_JOB:
        return Sources(FromNode("JOB_COMPLETION_INDEX"), hosts[0], str(port))
    if target == Target.TRAINJOB:
        return Sources(FromNode("PET_NODE_RANK"), FromNode("PET_MASTER_ADDR"), FromNode("PET_MASTER_PORT"))
    # ssh, compose, local: the launcher (or the rendered file) writes each
    # node's rank literally into that node's command, as NODE_RANK.
    return Sources(FromNode("DDPKIT_NODE_RANK"), hosts[0], str(port))


def interface_env(spec: JobSpec) -> dict[str, str]:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for a named interface. For
    'auto' nothing is fixed here: the entrypoint picks the interface that
    routes to the master and sets both at start-up."""
    if spec.network.is_auto:
        return {}
    value = spec.network.ifname_value
    return {"NCCL_SOCKET_IFNAME": value, "GLOO_SOCKET_IFNAME": value}


def job_env(spec: JobSpec) -> dict[str, str]:
    """Environment every process of the job gets, on every target, in a
    stable order: the user's variables, then what ddpkit owns."""
    env = dict(spec.env)
    env.update(interface_env(spec))
    env["DDPKIT_BACKEND"] = spec.resolved_backend
    env["DDPKIT_INTERFACE"] = spec.network.ifname_value
    env["DDPKIT_JOB_NAME"] = spec.name
    return env


def torchrun_argv(spec: JobSpec, src: Sources, *, doctor: bool = False) -> list[Arg]:
    """The one launch line every per-node target runs."""
    argv = [
        Arg.of(spec.command.python),
        Arg.of("-m"),
        Arg.of("torch.distributed.run"),
        Arg.of(f"--nnodes={spec.nodes}"),
        Arg.of(f"--nproc-per-node={spec.nproc_per_node}"),
    ]
    if spec.rendezvous.backend == "static":
        argv += [
            Arg.of("--node-rank=", src.node_rank),
            Arg.of("--master-addr=", src.master_addr),
            Arg.of("--master-port=", src.master_port),
        ]
    else:
        argv += [
            Arg.of("--rdzv-backend=c10d"),
            Arg.of("--rdzv-endpoint=", src.master_addr, ":", src.master_port),
            Arg.of(f"--rdzv-id={spec.name}"),
            Arg.of(f"--rdzv-conf=join_timeout={spec.rendezvous.timeout_s}"),
        ]
    argv.append(Arg.of("--max-restarts=0"))
    argv += [Arg.of(a) for a in spec.command.argv(doctor=doctor)]
    return argv


def process_argv(spec: JobSpec, *, doctor: bool = False) -> list[Arg]:
    """The per-process line for launchers that start every rank themselves
    (Slurm srun mode): no torchrun, the entrypoint reads the launcher's variables."""
    return [Arg.of(spec.command.python)] + [Arg.of(a) for a in spec.command.argv(doctor=doctor)]


@dataclass(frozen=True)
class NodeView:
    """What one node sees: the environment its controller injects and the
    rank values its launch line resolves to."""

    index: int
    host: str
    injected: dict[str, str]
    node_rank: int
    master_addr: str
    master_port: int
    nnodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def ranks(self) -> list[int]:
        return [self.node_rank * self.nproc_per_node + lr for lr in range(self.nproc_per_node)]


@dataclass(frozen=True)
class ProcessView:
    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    master_addr: str
    master_port: int


def controller_env(spec: JobSpec, target: Target, index: int, *, job_id: int = 4242,
                   hosts: list[str] | None = None) -> dict[str, str]:
    """The variables a controller or launcher injects on node `index`,
    exactly as DESIGN.md's table says (used by tests and by emulators)."""
    names = hosts_for(spec, target, hosts)
    port = master_port(spec, target)
    n, p = spec.nodes, spec.nproc_per_node
    if target in (Target.SLURM, Target.SLURM_SRUN):
        return {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_NODEID": str(index),
            "SLURM_JOB_NUM_NODES": str(n),
            "SLURMD_NODENAME": names[index],
            "MASTER_ADDR": names[0],
            "MASTER_PORT": str(port if port is not None else slurm_port_for_job(job_id)),
        }
    if target == Target.PYTORCHJOB:
        # training-operator release-1.9, controller.v1/pytorch/envvar.go and
        # master.go: PET_MASTER_* mirror MASTER_*; PET_NPROC_PER_NODE only
        # because the rendered job sets spec.nprocPerNode.
        return {
            "MASTER_ADDR": names[0],
            "MASTER_PORT": str(port),
            "PET_MASTER_ADDR": names[0],
            "PET_MASTER_PORT": str(port),
            "WORLD_SIZE": str(n * p),
            "RANK": str(index),
            "PET_NODE_RANK": str(index),
            "PET_NNODES": str(n),
            "PET_NPROC_PER_NODE": str(p),
            "PYTHONUNBUFFERED": "1",
        }
    if target == Target.INDEXED_JOB:
        return {"JOB_COMPLETION_INDEX": str(index)}
    if target == Target.TRAINJOB:
        return {
            "PET_NNODES": str(n),
            "PET_NPROC_PER_NODE": str(p),
            "PET_NODE_RANK": str(index),
            "PET_MASTER_ADDR": names[0],
            "PET_MASTER_PORT": str(port),
        }
    return {"DDPKIT_NODE_RANK": str(index)}


_FLAG = re.compile(r"^--(node-rank|master-addr|master-port|rdzv-endpoint)=(.*)$")


def node_view(spec: JobSpec, target: Target, index: int, *, job_id: int = 4242,
              hosts: list[str] | None = None) -> NodeView:
    """Resolve the launch line with node `index`'s injected environment, the
    way the node itself would."""
    injected = controller_env(spec, target, index, job_id=job_id, hosts=hosts)
    flags: dict[str, str] = {}
    for arg in torchrun_argv(spec, sources(spec, target, hosts)):
        m = _FLAG.match(arg.resolve(injected))
        if m:
            flags[m.group(1)] = m.group(2)
    if "rdzv-endpoint" in flags:
        addr, _, port = flags["rdzv-endpoint"].rpartition(":")
        flags.update({"master-addr": addr, "master-port": port, "node-rank": str(index)})
    return NodeView(
        index=index,
        host=hosts_for(spec, target, hosts)[index],
        injected=injected,
        node_rank=int(flags["node-rank"]),
        master_addr=flags["master-addr"],
        master_port=int(flags["master-port"]),
        nnodes=spec.nodes,
        nproc_per_node=spec.nproc_per_node,
    )


def node_views(spec: JobSpec, target: Target, **kwargs: object) -> list[NodeView]:
    return [node_view(spec, target, i, **kwargs) for i in range(spec.nodes)]  # type: ignore[arg-type]


def process_views(node: NodeView) -> list[ProcessView]:
    return [
        ProcessView(
            rank=rank,
            local_rank=local,
            node_rank=node.node_rank,
            world_size=node.world_size,
            master_addr=node.master_addr,
            master_port=node.master_port,
        )
        for local, rank in enumerate(node.ranks)
    ]


def check_views(views: list[NodeView]) -> list[str]:
    """Problems with a set of node views: ranks must be a permutation, the
    master must be node 0's host, and everyone must agree on it."""
    problems = []
    ranks = sorted(r for v in views for r in v.ranks)
    world = views[0].world_size if views else 0
    if ranks != list(range(world)):
        problems.append(f"global ranks are {ranks}, expected 0..{world - 1} once each")
    if sorted(v.node_rank for v in views) != list(range(len(views))):
        problems.append("node ranks are not a permutation of 0..nnodes-1")
    masters = {(v.master_addr, v.master_port) for v in views}
    if len(masters) != 1:
        problems.append(f"nodes disagree on the master: {sorted(masters)}")
    node0 = [v for v in views if v.node_rank == 0]
    if node0 and views[0].master_addr not in (node0[0].host, node0[0].host.split(".")[0]):
        problems.append(f"master {views[0].master_addr} is not node 0's host {node0[0].host}")
    return problems
