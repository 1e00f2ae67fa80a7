"""The training configuration: one frozen, typed value built once from the
command line (`TrainConfig.from_args`) and passed to every train module and
to every spawned child (it pickles; an argparse Namespace carrying the CLI's
handler does not).

Field names are the flags' dest names, so `--batch-size` is `batch_size`.
No torch import: `ddpkit --help` builds its parser from this package.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class StartupOptions:
    """The start-up flags (add_startup_arguments), all that init_distributed reads."""

    backend: str = "auto"
    init_method: str | None = None
    rank: int | None = None
    world_size: int | None = None
    spawn: int | None = None
    interface: str = "auto"
    device: str = "auto"
    dist_timeout: float = 1800.0


# What start-up accepts: the training config, or the Namespace that `ddpkit
# doctor` and the test helpers parse with add_startup_arguments.
Options = StartupOptions | argparse.Namespace


@dataclass(frozen=True)
class TrainConfig(StartupOptions):
    """Every `ddpkit train` flag (options.add_training_arguments), after validation."""

    # model
    model: str = "resnet18"
    num_classes: int = 10
    image_size: int = 32
    # data
    data: str = "synthetic"
    data_dir: Path | None = None
    synthetic_size: int = 1024
    workers: int = 2
    gpu_resident_data: bool = False
    # optimisation
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 32
    lr: float = 0.1
    base_batch: int = 256
    warmup_epochs: float = 0.0
    momentum: float = 0.9
    weight_decay: float = 5e-4
    grad_accum: int = 1
    keep_global_batch_of: int | None = None  # elastic: keep the global batch of a world of this many ranks
    seed: int = 0
    # parallelism and speed
    strategy: str = "ddp"
    gpu0_batch: int | None = None
    devices_per_process: int = 1
    zero: bool = False
    activation_checkpointing: bool = False
    sync_bn: bool = False
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    cudnn_benchmark: bool = False
    # checkpoints
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    keep: int = 3
    resume: str | None = None
    # output
    eval: bool = True
    eval_size: int = 256
    log_dir: Path | None = None
    metrics: Path | None = None
    tensorboard: Path | None = None
    rank_report_json: str | None = None
    rank_report_env: tuple[str, ...] = ()
    log_every: int = 10
    progress: str = "auto"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        """The parsed flags, without what the CLI adds for itself (its handler)."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        if "rank_report_env" in values:  # argparse's append list: a tuple keeps the config frozen and hashable
            values["rank_report_env"] = tuple(values["rank_report_env"] or ())
        return cls(**values)

    def as_record(self) -> dict[str, str]:
        """Every field as text, for the checkpoint's record of how it was made."""
        return {k: str(v) for k, v in asdict(self).items()}

