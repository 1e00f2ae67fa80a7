"""Test-only emulators of the rank contract: what each controller (Slurm,
the Kubeflow operators, the Job controller, ddpkit's own launchers) injects
on node i, and each node's view of the launch line resolved with it.

The production side of the contract is ddpkit.contract (one row per target);
this module plays the controllers that ddpkit does not run, with a made-up
Slurm job id, so that tests can check every target without a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddpkit import contract
from ddpkit.contract import RowKey, hosts_for, master_port, sources, torchrun_argv
from ddpkit.shared.agreed import slurm_port_for_job
from ddpkit.spec import JobSpec

JOB_ID = 4242  # the Slurm job id the emulated controller hands out


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


def controller_env(spec: JobSpec, target: RowKey, index: int, *, job_id: int = JOB_ID,
                   hosts: list[str] | None = None) -> dict[str, str]:
    """The variables a controller or launcher injects on node `index`, per
    the contract table (docs/CONTRACT.md)."""
    if contract.CONTRACT[target].ddpkit_controls:
        return contract.controller_env(spec, target, index)
    names = hosts_for(spec, target, hosts)
    port = master_port(spec, target)
    n, p = spec.nodes, spec.nproc_per_node
    if target in (RowKey.SLURM, RowKey.SLURM_SRUN):
        return {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_NODEID": str(index),
            "SLURM_JOB_NUM_NODES": str(n),
            "SLURM_NNODES": str(n),  # the step's nodes: every node of the job here
            "SLURMD_NODENAME": names[index],
            "MASTER_ADDR": names[0],
            "MASTER_PORT": str(port if port is not None else slurm_port_for_job(job_id)),
        }
    if target == RowKey.PYTORCHJOB:
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
    if target in (RowKey.INDEXED_JOB, RowKey.JOBSET):
        # JobSet's pods are an Indexed Job's: the Job controller sets the index.
        return {"JOB_COMPLETION_INDEX": str(index)}
    assert target == RowKey.TRAINJOB, target
    return {
        "PET_NNODES": str(n),
        "PET_NPROC_PER_NODE": str(p),
        "PET_NODE_RANK": str(index),
        "PET_MASTER_ADDR": names[0],
        "PET_MASTER_PORT": str(port),
    }


_FLAG = re.compile(r"^--(node-rank|master-addr|master-port|rdzv-endpoint)=(.*)$")


def node_view(spec: JobSpec, target: RowKey, index: int, *, job_id: int = JOB_ID,
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


def node_views(spec: JobSpec, target: RowKey, *, job_id: int = JOB_ID,
               hosts: list[str] | None = None) -> list[NodeView]:
    return [node_view(spec, target, i, job_id=job_id, hosts=hosts) for i in range(spec.nodes)]


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
