"""The launch line itself: torchrun's flags (nodes, rendezvous, stop
signals) and the job's program, as Arg tokens each target renders in its
own syntax."""

from __future__ import annotations

from collections.abc import Sequence

from ..shared.agreed import (
    AGENT_MODULE,
    KEEP_GLOBAL_BATCH_FLAG,
    RUN_MODULE,
    TORCHRUN_DEFAULT_SIGNALS,
    TRAINER_STOP_SIGNALS,
    is_ddpkit_module,
)
from ..spec import JobSpec
from .parts import Arg, Sources
from .rows import elastic_rdzv_backend, elastic_refusal, rdzv_conf


def nnodes(spec: JobSpec) -> str:
    """torchrun's --nnodes: N, or MIN:MAX for an elastic job."""
    return f"{spec.elastic.min_nodes}:{spec.nodes}" if spec.elastic else str(spec.nodes)


def nnodes_arg(spec: JobSpec, src: Sources) -> Arg:
    """--nnodes on the node: an elastic job's maximum is the count the node
    reads where its target allocates between min_nodes and nodes (Sources.max_nodes)."""
    if spec.elastic is not None and src.max_nodes is not None:
        return Arg.of(f"--nnodes={spec.elastic.min_nodes}:", src.max_nodes)
    return Arg.of(f"--nnodes={nnodes(spec)}")


def _conf_word(conf: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in conf.items())


def rendezvous_args(spec: JobSpec, src: Sources) -> list[Arg]:
    """How the agents meet: static ranks from the target, c10d on node 0,
    or (spec.elastic) ddpkit's c10d rendezvous (elastic_rdzv_backend) with
    this run's id, the target's timeouts and restarts; always ending with
    --max-restarts."""
    if spec.elastic is not None:
        target = src.target
        if src.rdzv_id is None or target is None:
            # targets refuse such a job first (elastic_refusal); reaching here is a bug
            raise ValueError(elastic_refusal(spec, target) if target else "elastic: sources() names no target")
        return [
            Arg.of(f"--rdzv-backend={elastic_rdzv_backend(spec)}"),
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
        Arg.of(AGENT_MODULE),
        *agent_flags,
        nnodes_arg(spec, src),
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
    (Slurm srun mode): no torchrun. ddpkit's entrypoint reads the launcher's
    variables; a program of the user's own runs under `ddpkit.run`, which sets
    torchrun's variables from Slurm's and gives it the preamble."""
    program = [Arg.of(a) for a in spec.command.argv()]
    if not is_ddpkit_module(spec.command.module):
        program = [Arg.of("-m"), Arg.of(RUN_MODULE), *program]
    return [Arg.of(spec.command.python), *program]
