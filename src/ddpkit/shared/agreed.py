"""What the renderer and the job agree on: the facts both sides of a launch
line must read alike (the trainer's flags, its stop signals, the default
ports, the device rule, the preamble's parts), and nothing else.

The renderer (contract, spec, targets) writes these into launch lines and
scripts; the trainer (train/*) reads them back on the node. Keeping them in
a leaf that imports nothing of the package but envnames/exitcodes lets
`ddpkit train` start without importing the job spec (and pydantic with it),
while a rename still cannot leave one side behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from . import envnames

# The module every target runs by default (command.module's default).
TRAIN_MODULE: Final = "ddpkit.train"
# The module every per-node launch line runs: torchrun with pre-imported
# workers (ddpkit/agent), torch.distributed.run's arguments unchanged.
AGENT_MODULE: Final = "ddpkit.agent"
# The runner that gives a program of the user's own the preamble where no zygote forks it (ddpkit/run.py).
RUN_MODULE: Final = "ddpkit.run"
# An elastic job's rendezvous store as a service of its own, where no launcher hosts it (compose, Kubernetes).
RDZV_STORE_MODULE: Final = "ddpkit.rdzv_store"
# The preamble's parts (ddpkit/preamble), in the order they install; DDPKIT_PREAMBLE leaves some out.
PREAMBLE_PARTS: Final = ("interface", "rank_report", "progress", "metrics", "stragglers", "stop")
# A metrics file of this name is the launcher: each record goes framed on
# stderr, with its time, and the launcher that reads the node's output appends
# it to its run folder's metrics.jsonl (launch ssh, launch docker: rank 0 runs
# where the run folder is not).
METRICS_TO_LAUNCHER: Final = "-"
# In a Slurm job's records folder, a node whose workers failed leaves when and
# its exit code (agent/nodefailure.py) for the batch script, which ends the job
# with the first failure's code (targets/slurm.SlurmPlan.failed_file).
NODE_FAILURE_FILE: Final = "{node}.run{run}.failed"


def metrics_to_launcher(path: object) -> bool:
    """Whether a metrics file (a path, or DDPKIT_METRICS's value) names the launcher."""
    return path is not None and str(path) == METRICS_TO_LAUNCHER


def threads_per_process(cores: int, processes: int) -> int:
    """OMP_NUM_THREADS for `processes` processes sharing `cores` cores: an
    equal share, at least 1 (torchrun sets 1 for any count above one, which
    leaves all but one core per process idle in the CPU's own work)."""
    return max(1, cores // max(processes, 1))


def is_ddpkit_module(module: str | None) -> bool:
    """ddpkit's own programs (ddpkit.train, ddpkit.doctor), which report for themselves: no preamble."""
    return module is not None and (module == "ddpkit" or module.startswith("ddpkit."))


def preamble_parts(env: Mapping[str, str]) -> tuple[str, ...]:
    """The parts DDPKIT_PREAMBLE leaves on ("off": none; a comma list: all but those)."""
    off = {name.strip() for name in env.get(envnames.DDPKIT_PREAMBLE, "").split(",") if name.strip()}
    return () if "off" in off else tuple(part for part in PREAMBLE_PARTS if part not in off)

# torchrun's --rdzv-backend for ddpkit's rendezvous handler (rendezvous.py), the
# name of its `torchrun.handlers` entry point (pyproject.toml): installed with
# ddpkit, so an elastic job whose nodes run ddpkit train uses it.
RDZV_HANDLER: Final = "ddpkit"
# Its --rdzv-conf key for the first round's wait for the nodes still starting (spec elastic.first_round_s).
RDZV_FIRST_ROUND_KEY: Final = "first_round_timeout"

# The straggler judge's default (spec watchdog.straggler_factor; train/watchdog/straggler.py
# uses it when the job environment does not say otherwise).
STRAGGLER_FACTOR: Final = 1.33
# watchdog.loss_s (the spec's default and floor; the trainer's default when
# the job environment does not carry it): seconds of a node's silence before
# the others act on it. The floor is three heartbeats (one a second).
LOSS_S: Final = 10.0
LOSS_FLOOR_S: Final = 3.0

# ---- Trainer flags the renderer reads or writes ---------------------------------
# The spec checks a job's --strategy / --devices-per-process against the
# fields that size the GPU request; Kubernetes warns about --resume auto with
# a --checkpoint-dir on storage that dies with the pod; elastic jobs get
# --keep-global-batch-of appended. train/config/options.py declares the same names.
STRATEGY_FLAG: Final = "--strategy"
DEVICES_PER_PROCESS_FLAG: Final = "--devices-per-process"
RESUME_FLAG: Final = "--resume"
CHECKPOINT_DIR_FLAG: Final = "--checkpoint-dir"
KEEP_GLOBAL_BATCH_FLAG: Final = "--keep-global-batch-of"
METRICS_FLAG: Final = "--metrics"


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in a trainer argv (the last one
    wins, as argparse does); None when the flag is absent."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


# ---- Stop signals ----------------------------------------------------------------
# torchrun's own default --signals-to-handle, kept: an agent that dies on
# SIGINT/SIGHUP/SIGQUIT instead of forwarding them leaves its workers behind.
TORCHRUN_DEFAULT_SIGNALS: Final = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# The signals `ddpkit train` stops on with a checkpoint (train/stop/signals.py);
# the renderers tell torchrun's agent to forward them (contract.stop_args).
TRAINER_STOP_SIGNALS: Final = ("SIGTERM", "SIGUSR2")

# ---- Ports -----------------------------------------------------------------------

DEFAULT_PORT: Final = 29500
PYTORCHJOB_DEFAULT_PORT: Final = 23456  # the Kubeflow operator's default for `pytorchjob-port`
# Slurm's derived master port: below Linux's default ephemeral range
# (net.ipv4.ip_local_port_range = 32768 60999), where any process's outgoing
# connection may already hold a port, and above the crowded low ports.
SLURM_PORT_BASE: Final = 10000
SLURM_PORT_LAST: Final = 32767
# Ports in that range that other services commonly listen on, skipped
# (sorted): memcached, RabbitMQ management, Kubeflow's PyTorchJob default,
# MongoDB, the c10d rendezvous port of PyTorch's examples, torchrun's default.
SLURM_PORT_SKIPS: Final = (11211, 15672, PYTORCHJOB_DEFAULT_PORT, 27017, 29400, DEFAULT_PORT)
# How many ports the job id is spread over: two job ids collide only when
# they differ by a multiple of this (22762), the least any pure function of
# an unbounded job id can promise with this many ports.
SLURM_PORT_SPAN: Final = SLURM_PORT_LAST - SLURM_PORT_BASE + 1 - len(SLURM_PORT_SKIPS)


def slurm_port_for_job(job_id: int) -> int:
    """The master port of Slurm job `job_id`: the (job id mod span)-th port
    of SLURM_PORT_BASE..SLURM_PORT_LAST that is not in SLURM_PORT_SKIPS.
    The batch script computes the same in bash (templates/slurm; the two are
    compared in tests/test_render_slurm.py)."""
    return quiet_port(job_id)


def quiet_port(n: int) -> int:
    """The (n mod SLURM_PORT_SPAN)-th port of SLURM_PORT_BASE..SLURM_PORT_LAST
    not in SLURM_PORT_SKIPS: below the ephemeral range, so no process's
    outgoing connection and no kernel-assigned listener holds it."""
    port = SLURM_PORT_BASE + n % SLURM_PORT_SPAN
    for skip in SLURM_PORT_SKIPS:  # sorted: each skip below shifts the port up by one
        if port >= skip:
            port += 1
    return port


# ---- Devices -----------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceBlock:
    """The GPUs one process owns, as indices into CUDA_VISIBLE_DEVICES (or
    into all GPUs when it is unset). `primary` is where its inputs live."""

    first: int
    count: int

    @property
    def primary(self) -> int:
        return self.first

    @property
    def indices(self) -> list[int]:
        return list(range(self.first, self.first + self.count))


def device_block(local_rank: int, devices_per_process: int, visible: int) -> DeviceBlock:
    """The one device-ownership rule. A node runs nproc_per_node processes of
    devices_per_process GPUs each (JobSpec.gpus_per_node requests their
    product on every target); the process with local rank r owns the
    contiguous block [r*K, (r+1)*K). Contiguous blocks keep a model split
    over K GPUs on neighbouring devices, which usually share a switch.
    `visible` is the number of GPUs the process sees; a block past it means
    the target gave the node fewer GPUs than the layout needs."""
    if local_rank < 0 or devices_per_process < 1:
        raise ValueError(f"local rank {local_rank} and devices per process {devices_per_process}: "
                         "need local rank >= 0 and at least one device per process")
    first = local_rank * devices_per_process
    if first + devices_per_process > visible:
        raise ValueError(f"local rank {local_rank} owns GPUs {first}..{first + devices_per_process - 1} "
                         f"({devices_per_process} per process) but this process sees {visible}; "
                         "request nproc_per_node x devices_per_process GPUs per node")
    return DeviceBlock(first, devices_per_process)
