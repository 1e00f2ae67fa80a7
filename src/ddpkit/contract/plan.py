"""The contract resolved once for one target and node set: a typed launch
plan that targets and launchers read instead of assembling the line, the
environment and the node variables from the contract piece by piece."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..spec import JobSpec
from .argv import process_argv, torchrun_argv
from .env import target_env
from .parts import Arg, Part, RowKey, Sources
from .rows import CONTRACT, controller_env, hosts_for, master_port, rdzv_conf, sources


@dataclass(frozen=True)
class LaunchPlan:
    """What every node of one job runs on one target. `argv` holds FromNode
    parts each node (or the launcher, for the node) fills in; nothing here
    is edited afterwards."""

    target: RowKey
    hosts: list[str]  # the name each node is reachable by, node-rank order
    port: int | None  # the master / rendezvous port; None: derived on the nodes (Slurm)
    sources: Sources
    argv: list[Arg]  # the per-node launch line (torchrun), or per process in Slurm's srun mode
    env: dict[str, str]  # every process's job environment (target_env)
    # What ddpkit injects on node i where it is the controller (ssh, compose, local); empty elsewhere.
    node_vars: tuple[dict[str, str], ...]
    rdzv_conf: dict[str, int] | None  # an elastic job's c10d timeouts; None when not elastic


def resolve(spec: JobSpec, target: RowKey, hosts: list[str] | None = None, *, master_addr: Part | None = None,
            store_host: Part | None = None, agent_flags: Sequence[Arg] = ()) -> LaunchPlan:
    """The plan for `spec` on `target`. `hosts`: node-rank order, instead of
    the target's default names (an SSH hostfile). The rest is what a
    launcher hands the nodes itself: `master_addr` (launch ssh passes it in
    each node's env prefix), `store_host` (launch local: which agent hosts
    the c10d store), `agent_flags` (launch local's --tee and log folder)."""
    src = sources(spec, target, hosts)
    if master_addr is not None:
        src = dataclasses.replace(src, master_addr=master_addr)
    if store_host is not None:
        src = dataclasses.replace(src, store_host=store_host)
    argv = process_argv(spec) if target is RowKey.SLURM_SRUN else torchrun_argv(spec, src, agent_flags)
    names = hosts_for(spec, target, hosts)
    row = CONTRACT[target]
    injected = tuple(controller_env(spec, target, i) for i in range(len(names))) if row.ddpkit_controls else ()
    elastic = spec.elastic is not None and row.elastic.rdzv_id is not None
    return LaunchPlan(target, names, master_port(spec, target), src, argv, target_env(spec, target), injected,
                      rdzv_conf(spec, target) if elastic else None)
