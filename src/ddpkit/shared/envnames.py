"""Names of the environment variables that carry the rank contract.

The render side (contract, targets, launchers) writes them and the train side
(launchinfo, startup) reads them; both import the names from here so that a
rename cannot leave one side behind. docs/CONTRACT.md has the table of
which target sets which.
"""

from __future__ import annotations

from typing import Final

# torch.distributed's env:// rendezvous and torchrun's per-worker variables.
MASTER_ADDR: Final = "MASTER_ADDR"
MASTER_PORT: Final = "MASTER_PORT"
WORLD_SIZE: Final = "WORLD_SIZE"
RANK: Final = "RANK"
LOCAL_RANK: Final = "LOCAL_RANK"
LOCAL_WORLD_SIZE: Final = "LOCAL_WORLD_SIZE"
GROUP_RANK: Final = "GROUP_RANK"
NODE_RANK: Final = "NODE_RANK"
# The rest of torchrun's per-worker set, and its agent's settings.
GROUP_WORLD_SIZE: Final = "GROUP_WORLD_SIZE"
ROLE_RANK: Final = "ROLE_RANK"
ROLE_WORLD_SIZE: Final = "ROLE_WORLD_SIZE"
NNODES: Final = "NNODES"
NPROC_PER_NODE: Final = "NPROC_PER_NODE"
TORCHELASTIC_SIGNALS_TO_HANDLE: Final = "TORCHELASTIC_SIGNALS_TO_HANDLE"
TORCHELASTIC_RESTART_COUNT: Final = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun's agent in every worker
TORCHELASTIC_RUN_ID: Final = "TORCHELASTIC_RUN_ID"  # likewise: the worker was started by torchrun
TORCHELASTIC_MAX_RESTARTS: Final = "TORCHELASTIC_MAX_RESTARTS"
TORCHELASTIC_ERROR_FILE: Final = "TORCHELASTIC_ERROR_FILE"  # torchrun's per-worker error file (its folder: one per start)
TORCH_DISABLE_SHARE_RDZV_TCP_STORE: Final = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # elastic: a fresh store per restart
TORCH_ELASTIC_SHUTDOWN_TIMEOUT: Final = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"

# Interface pinning, read by the communication libraries themselves.
NCCL_SOCKET_IFNAME: Final = "NCCL_SOCKET_IFNAME"
GLOO_SOCKET_IFNAME: Final = "GLOO_SOCKET_IFNAME"
SOCKET_IFNAMES: Final = (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)

# torchrun reads PET_<FLAG> as the default of --<flag>; Kubeflow sets these.
PET_NODE_RANK: Final = "PET_NODE_RANK"
PET_NNODES: Final = "PET_NNODES"
PET_NPROC_PER_NODE: Final = "PET_NPROC_PER_NODE"
PET_MASTER_ADDR: Final = "PET_MASTER_ADDR"
PET_MASTER_PORT: Final = "PET_MASTER_PORT"

# Kubernetes Indexed Job.
JOB_COMPLETION_INDEX: Final = "JOB_COMPLETION_INDEX"

# Slurm.
SLURM_JOB_ID: Final = "SLURM_JOB_ID"
SLURM_RESTART_COUNT: Final = "SLURM_RESTART_COUNT"  # runs of a requeued job before this one
SLURM_NODEID: Final = "SLURM_NODEID"
SLURM_PROCID: Final = "SLURM_PROCID"
SLURM_LOCALID: Final = "SLURM_LOCALID"
SLURM_NTASKS: Final = "SLURM_NTASKS"
SLURM_NNODES: Final = "SLURM_NNODES"  # in a job step: the step's nodes
SLURM_JOB_NUM_NODES: Final = "SLURM_JOB_NUM_NODES"  # the allocation's nodes
SLURM_JOB_NODELIST: Final = "SLURM_JOB_NODELIST"
SLURM_NODELIST: Final = "SLURM_NODELIST"
SLURM_NTASKS_PER_NODE: Final = "SLURM_NTASKS_PER_NODE"
SLURM_TASKS_PER_NODE: Final = "SLURM_TASKS_PER_NODE"
SLURM_STEPID: Final = "SLURM_STEPID"
SLURM_STEP_ID: Final = "SLURM_STEP_ID"
SLURMD_NODENAME: Final = "SLURMD_NODENAME"  # the Slurm name of the node a task (or the batch shell) runs on

# Open MPI's mpirun (read by the train side only).
OMPI_COMM_WORLD_RANK: Final = "OMPI_COMM_WORLD_RANK"
OMPI_COMM_WORLD_LOCAL_RANK: Final = "OMPI_COMM_WORLD_LOCAL_RANK"
OMPI_COMM_WORLD_SIZE: Final = "OMPI_COMM_WORLD_SIZE"
OMPI_COMM_WORLD_LOCAL_SIZE: Final = "OMPI_COMM_WORLD_LOCAL_SIZE"
OMPI_COMM_WORLD_NODE_RANK: Final = "OMPI_COMM_WORLD_NODE_RANK"

# Python: logs must reach the launcher line by line, not in 8 KiB blocks.
PYTHONUNBUFFERED: Final = "PYTHONUNBUFFERED"
OMP_NUM_THREADS: Final = "OMP_NUM_THREADS"

# ddpkit's own, set by its renderers and launchers.
DDPKIT_NODE_RANK: Final = "DDPKIT_NODE_RANK"
DDPKIT_MASTER_ADDR: Final = "DDPKIT_MASTER_ADDR"
DDPKIT_BACKEND: Final = "DDPKIT_BACKEND"
DDPKIT_INTERFACE: Final = "DDPKIT_INTERFACE"
DDPKIT_JOB_NAME: Final = "DDPKIT_JOB_NAME"
DDPKIT_HOSTNAME: Final = "DDPKIT_HOSTNAME"
DDPKIT_PGID: Final = "DDPKIT_PGID"
DDPKIT_RDZV_ID: Final = "DDPKIT_RDZV_ID"  # an elastic job's rendezvous id on ssh and local: fresh per run
# The run key (runkey.py): a random secret per run that every process of the job holds and no file,
# command line or log does; ddpkit's control keys in the rendezvous store live under a namespace derived from it.
DDPKIT_RUN_KEY: Final = "DDPKIT_RUN_KEY"
# Where run folders live (default ~/.ddpkit/runs); read by ddpkit.runs, never by the job.
DDPKIT_RUNS_DIR: Final = "DDPKIT_RUNS_DIR"
# The run id in every process `launch local` starts: what `ddpkit cancel` finds
# them by once their launcher is gone (torchrun puts workers in sessions of their own).
DDPKIT_RUN_ID: Final = "DDPKIT_RUN_ID"
# Tenths of a second the SSH stop script waits between TERM and KILL, when the
# stop asks for a checkpoint (an interrupt): the grace chain's launcher grace.
DDPKIT_STOP_TICKS: Final = "DDPKIT_STOP_TICKS"
# 0: `python -m ddpkit.agent` starts workers as torchrun does, not from its pre-imported zygote (ddpkit/agent).
DDPKIT_AGENT_FORK: Final = "DDPKIT_AGENT_FORK"
# Set by ddpkit's agent in every worker: where a worker that ends on an uncaught exception writes what it was, for
# the agent to tell the same error after a restart (a bug) from a fault (ddpkit/agent/sameerror.py).
DDPKIT_FAILURE_FILE: Final = "DDPKIT_FAILURE_FILE"
# Comma-separated modules the agent's zygote imports too (a program's own heavy imports: transformers, lightning).
DDPKIT_AGENT_PRELOAD: Final = "DDPKIT_AGENT_PRELOAD"
# What a program of the user's own gets before its first line (ddpkit/preamble): "off", or the parts
# to leave out, comma-separated (agreed.PREAMBLE_PARTS).
DDPKIT_PREAMBLE: Final = "DDPKIT_PREAMBLE"
DDPKIT_WORKDIR: Final = "DDPKIT_WORKDIR"  # command.workdir: made and entered on every node (ddpkit/host/workdir.py)
# Where the preamble's rank 0 appends a program's metrics records (launch local: the run folder's metrics.jsonl;
# launch ssh and docker: agreed.METRICS_TO_LAUNCHER, framed on stderr for the launcher; submit slurm: the same
# value, its records then in the job's records folder: DDPKIT_RECORDS).
DDPKIT_METRICS: Final = "DDPKIT_METRICS"
# Where every record a job sends back (ddpkit.records) goes: a folder, one JSON Lines file per node in it
# (the rendered Slurm, compose and Kubernetes jobs set it, where people read the raw output); unset: framed on
# stderr, for the ddpkit launcher that reads the stream (launch local, ssh, docker, launch.sh).
DDPKIT_RECORDS: Final = "DDPKIT_RECORDS"
DDPKIT_RENDEZVOUS_WINDOW: Final = "DDPKIT_RENDEZVOUS_WINDOW"  # seconds the pre-join checks wait for peers

# The hang watchdog (spec `watchdog:`; docs/guides/hangs.md): seconds without progress, 0 = off.
# An elastic job's rendezvous store (host:port), where the watchdog keeps its records: set by the agent, so that
# they outlive rank 0's process and, where the launcher hosts that store, a node 0 that froze.
DDPKIT_CONTROL_STORE: Final = "DDPKIT_CONTROL_STORE"
DDPKIT_WATCHDOG_STALL_S: Final = "DDPKIT_WATCHDOG_STALL_S"
DDPKIT_WATCHDOG_FIRST_STEP_S: Final = "DDPKIT_WATCHDOG_FIRST_STEP_S"
# The straggler judge (spec watchdog.straggler_factor; set only when not the default, agreed.STRAGGLER_FACTOR).
DDPKIT_WATCHDOG_STRAGGLER_FACTOR: Final = "DDPKIT_WATCHDOG_STRAGGLER_FACTOR"
# Test hook, read only by train/watchdog/worktime.py: RANK:SECONDS[:FROM_STEP] sleeps in that rank's data loading.
DDPKIT_TEST_SLOW_RANK: Final = "DDPKIT_TEST_SLOW_RANK"
# The rank whose DataLoader fork server and workers these are (train/data/loader_procs.py): they end with it.
DDPKIT_LOADER_RANK_PID: Final = "DDPKIT_LOADER_RANK_PID"
# The fork server's own pid, which its workers inherit (train/data/loader_procs.py).
DDPKIT_LOADER_SERVER_PID: Final = "DDPKIT_LOADER_SERVER_PID"
# Seconds of a node's silence before the others act on it (spec watchdog.loss_s; docs/guides/elastic.md).
DDPKIT_WATCHDOG_LOSS_S: Final = "DDPKIT_WATCHDOG_LOSS_S"
# The stop signal after which ddpkit train requeues its Slurm job (train/stop/signals.py): the rendered
# script sets preemption.signal, or empty (slurm.requeue false); unset means USR2.
DDPKIT_SLURM_REQUEUE_ON: Final = "DDPKIT_SLURM_REQUEUE_ON"
# An elastic Slurm job's batch shell, to be told (SIGUSR1) when training finished (train/stop/slurm_batch.py).
DDPKIT_SLURM_BATCH_PID: Final = "DDPKIT_SLURM_BATCH_PID"
DDPKIT_SLURM_BATCH_NODE: Final = "DDPKIT_SLURM_BATCH_NODE"
# torch's NCCL flight recorder: ring-buffer entries, dump on a collective timeout, and the dump file prefix.
TORCH_NCCL_TRACE_BUFFER_SIZE: Final = "TORCH_NCCL_TRACE_BUFFER_SIZE"
TORCH_NCCL_DUMP_ON_TIMEOUT: Final = "TORCH_NCCL_DUMP_ON_TIMEOUT"
TORCH_FR_DUMP_TEMP_FILE: Final = "TORCH_FR_DUMP_TEMP_FILE"
