"""The launch line's parts: the target names, values a node supplies at run
time (FromNode), argv tokens mixing both (Arg), and where a node reads its
rank, master and rendezvous id (Sources)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RowKey(str, Enum):
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
    target: RowKey | None = None  # whose row these came from (elastic: its rendezvous timeouts)
    # "1" on the node that hosts the c10d store, "0" elsewhere: only where every
    # agent sees its own host in the endpoint (launch local), so each would try to host it.
    store_host: Part | None = None
    # An elastic job's most nodes, where the target may give it fewer than the
    # spec's (Slurm's --nodes=MIN-MAX): a variable the node reads. None: spec.nodes.
    max_nodes: Part | None = None
