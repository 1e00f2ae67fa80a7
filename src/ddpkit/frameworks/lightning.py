"""A Lightning `Trainer` stopped the way ddpkit stops a job: after a stop
signal, at the optimizer step every rank agreed on, the Trainer writes
`last.ckpt` (through its own `save_checkpoint`) into its ModelCheckpoint's
folder (or `dirpath`) and stops; the process then exits 75, so that Slurm
requeues the job and the next start resumes with `trainer.fit(model,
ckpt_path="last")`. Give the ModelCheckpoint a fixed `dirpath`: its default
folder has a new version number each start, where "last" finds nothing.

When training starts the callback takes SIGTERM and SIGUSR2 back from the
handler Lightning installs: Lightning's SIGTERM handler broadcasts over the
process group from inside the signal handler, so ranks that get the signal
at different points of a step wait on each other for good.

    from ddpkit.frameworks.lightning import StopCallback
    Trainer(callbacks=[ModelCheckpoint(dirpath="ckpt"), StopCallback()])
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from ..preamble import stop

LAST = "last.ckpt"  # the name Lightning's ckpt_path="last" looks for in a ModelCheckpoint's folder


class StopCallback(Callback):
    """Save `last.ckpt` and stop at the agreed step; end the process as pre-empted when training ended."""

    def __init__(self, dirpath: str | None = None) -> None:
        stop.install_once()
        stop.attach_framework()
        self.dirpath = dirpath
        self.saved: str | None = None

    def folder(self, trainer: Trainer) -> str:
        if self.dirpath:
            return self.dirpath
        checkpoint = trainer.checkpoint_callback
        found = getattr(checkpoint, "dirpath", None)
        return str(found) if found else str(trainer.default_root_dir)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stop.take_signals()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if stop.agreed() and self.saved is None:
            self.saved = os.path.join(self.folder(trainer), LAST)
            trainer.save_checkpoint(self.saved)  # every rank calls it; rank 0 writes
            trainer.should_stop = True

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if stop.agreed():
            stop.finish(trainer.global_step)  # the step last.ckpt holds, counted on across resumes
