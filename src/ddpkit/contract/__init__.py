"""The rank / rendezvous / interface contract.

For every target: world_size = nnodes * nproc_per_node,
rank = node_rank * nproc_per_node + local_rank, node 0 hosts the rendezvous.
What differs per target is *where* a node learns its node rank and the
master's address: a variable its controller sets, a line in a hostfile, a
service name. This package says so, as data, and nothing here does I/O.

Values that must expand on the node (not on the machine that renders or
submits) are `FromNode` parts; every renderer turns them into its own syntax
(`"$VAR"` in shell, `$(VAR)` in Kubernetes) in exactly one place.

What the trainer must read back on the node (default ports, the Slurm port
rule, stop signals, flag names, the device rule) lives in agreed.py, which
`ddpkit train` imports without this package and the spec behind it.

The package, by concern:
  parts.py  RowKey, FromNode, Arg, Sources: the launch line's parts
  rows.py   the contract table (one row per target) and what reads a row
  env.py    the job environment on a target
  argv.py   the torchrun line (rendezvous, stop flags, the program)
  plan.py   resolve(spec, target, ...) -> LaunchPlan: all of it, once

Other modules import from here (`from ddpkit.contract import resolve`),
never from a submodule.
"""

from .argv import (
    elastic_train_args,
    nnodes,
    process_argv,
    rendezvous_args,
    stop_args,
    torchrun_argv,
)
from .env import cpus_per_process, elastic_env, interface_env, job_env, omp_env, target_env, watchdog_env
from .parts import Arg, FromNode, Part, RowKey, Sources
from .plan import LaunchPlan, resolve
from .rows import (
    COMPOSE_STORE_SERVICE,
    CONTRACT,
    DDPKIT,
    ContractRow,
    ElasticRow,
    Fixed,
    Origin,
    controller_env,
    elastic_rdzv_backend,
    elastic_refusal,
    hosts_for,
    k8s_service_name,
    master_port,
    one_host_gpus,
    pytorchjob_store_service,
    rdzv_conf,
    sources,
)

__all__ = [
    "COMPOSE_STORE_SERVICE", "CONTRACT", "DDPKIT", "Arg", "ContractRow", "ElasticRow", "Fixed", "FromNode",
    "LaunchPlan", "Origin", "Part", "Sources", "RowKey", "controller_env", "cpus_per_process", "elastic_env",
    "elastic_rdzv_backend", "elastic_refusal", "elastic_train_args", "hosts_for", "interface_env", "job_env",
    "k8s_service_name", "master_port", "nnodes", "omp_env", "one_host_gpus", "process_argv",
    "pytorchjob_store_service", "rdzv_conf", "rendezvous_args", "resolve", "sources", "stop_args", "target_env",
    "torchrun_argv", "watchdog_env",
]
