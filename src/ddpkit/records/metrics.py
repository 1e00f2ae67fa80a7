"""The metrics records a job appends to its `--metrics` JSON Lines file
(what `ddpkit report` draws); the stall, straggler and lost-node records
(job.py) go there too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .base import Record, optional


@dataclass(frozen=True)
class Train(Record):
    kind: ClassVar[str] = "train"
    step: int
    loss: float | None
    images_per_s: float  # the throughput of all ranks, in `unit` a second
    epoch: int | None = optional()  # the trainer's; a program of the user's own has none
    lr: float | None = optional()
    loss_is: str | None = optional()  # what the loss is, where it is not the trainer's own
    unit: str | None = optional()  # what the throughput counts where not images: "samples" or "tokens"


@dataclass(frozen=True)
class Eval(Record):
    kind: ClassVar[str] = "eval"
    step: int
    epoch: int
    accuracy: float
    loss: float
    correct: int
    total: int


@dataclass(frozen=True)
class StepTimes(Record):
    """Each rank's mean time a step over the window before `step`."""

    kind: ClassVar[str] = "step_times"
    step: int
    step_s: tuple[float, ...]


@dataclass(frozen=True)
class RankRow(Record):
    """One process's row of the rank report."""

    kind: ClassVar[str] = "rank_report"
    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    device: str
    interface: str | None
    address: str | None
    torch: str
    cuda: str | None
    nccl: str | None
    launcher: str
    # The rest has defaults so that rows forged or built in tests stay short.
    world_size: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    backend: str = ""
    nccl_socket_ifname: str | None = None
    gloo_socket_ifname: str | None = None
    # --rank-report-env NAME: the value of each named variable in this process (None: unset)
    env: dict[str, str | None] = field(default_factory=dict)

    @property
    def versions(self) -> tuple[str, str | None, str | None]:
        return (self.torch, self.cuda, self.nccl)


@dataclass(frozen=True)
class Checkpoint(Record):
    kind: ClassVar[str] = "checkpoint"
    step: int
    path: str
    from_memory: str | None = optional()  # why a checkpoint was written from the copy in memory


@dataclass(frozen=True)
class Stop(Record):
    """A stop signal: checkpointed and stopped."""

    kind: ClassVar[str] = "stop"
    signal: str | None
    step: int
    checkpoint: str | None
    slurm_restart_count: int


@dataclass(frozen=True)
class Resume(Record):
    kind: ClassVar[str] = "resume"
    step: int
    epoch: int
    checkpoint: str
    world_size: int | None = optional()  # the world that resumed (the checkpoint's own may differ)


@dataclass(frozen=True)
class Startup(Record):
    """How long this process took from its start to its first step, by phase."""

    kind: ClassVar[str] = "startup"
    stamps: dict[str, float]
    phases: dict[str, float]
    total: float
    process_start_from: str
    pid: int


@dataclass(frozen=True)
class Summary(Record):
    """How the run ended."""

    kind: ClassVar[str] = "summary"
    status: str
    steps: int
    epochs_completed: int
    seconds: float
    images_per_second: float
    accuracy: float | None
    eval_loss: float | None
    checkpoint: str | None
    world_size: int
    global_batch: int
