"""The trainer's checkpoints: what a save gathers from every rank and writes
(on rank 0), and what a resume puts back. File handling (atomic writes,
rotation, `latest`) is checkpoint.py's."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .config import TrainConfig
from .progress import Metrics
from .startup import DistContext
from .strategy import Parallel


@dataclass
class Position:
    """Where training stands, in optimizer steps: `step` overall and
    `epoch_step` within the epoch."""

    epoch: int = 0
    epoch_step: int = 0
    step: int = 0


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class TrainState:
    """What a checkpoint holds besides the position: the model and what steps it."""

    par: Parallel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler


class Checkpointer:
    def __init__(self, config: TrainConfig, ctx: DistContext, distributed: bool, state: TrainState,
                 metrics: Metrics, log: logging.Logger) -> None:
        self.config, self.ctx, self.distributed = config, ctx, distributed
        self.state, self.metrics, self.log = state, metrics, log
        self.last: Path | None = None

    def _optimizer_state(self) -> dict[str, Any] | None:
        if self.config.zero:
            self.state.optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # a collective
            return self.state.optimizer.state_dict() if self.ctx.rank == 0 else None
        return self.state.optimizer.state_dict()

    def _gathered_rngs(self) -> list[Any]:
        rng = ckpt.rng_state(self.ctx.device)
        if not self.distributed:
            return [rng]
        rngs: list[Any] = [None] * self.ctx.world_size if self.ctx.rank == 0 else []
        dist.gather_object(rng, rngs if self.ctx.rank == 0 else None, dst=0)
        return rngs

    def save(self, pos: Position) -> Path | None:
        """Every rank calls this at the same step (it runs collectives)."""
        directory = self.config.checkpoint_dir
        if directory is None:
            return None
        optim_state = self._optimizer_state()
        rngs = self._gathered_rngs()
        path = None
        if self.ctx.rank == 0:
            s = self.state
            payload = {"model": s.par.raw.state_dict(), "optimizer": optim_state,
                       "scheduler": s.scheduler.state_dict(), "scaler": s.scaler.state_dict(),
                       "position": vars(pos).copy(), "rng": rngs, "world_size": self.ctx.world_size,
                       "args": self.config.as_record()}
            path = ckpt.write_checkpoint(directory, pos.step, payload, self.config.keep)
            self.metrics.write("checkpoint", step=pos.step, path=str(path))
        if self.distributed:
            dist.barrier()  # nobody runs ahead (or exits) before the file is complete
        self.last = directory / ckpt.checkpoint_name(pos.step)
        return path

    def resume(self) -> tuple[Position, Path | None]:
        """Load the checkpoint --resume names, if any; the position to continue from."""
        c, rank = self.config, self.ctx.rank
        path = ckpt.resolve_resume(c.resume, c.checkpoint_dir)
        if path is None:
            seed_all(c.seed + rank)  # per-rank streams for anything random during training
            return Position(), None
        state = ckpt.read_checkpoint(path, map_location=self.ctx.device)
        s = self.state
        s.par.raw.load_state_dict(state["model"])
        s.optimizer.load_state_dict(state["optimizer"])
        s.scheduler.load_state_dict(state["scheduler"])
        s.scaler.load_state_dict(state["scaler"])
        pos = Position(**state["position"])
        rngs = state["rng"]
        if len(rngs) == self.ctx.world_size:
            ckpt.set_rng_state(rngs[rank], self.ctx.device)
        else:
            self.log.warning("checkpoint was written by %d ranks, this run has %d: RNG streams restart",
                             len(rngs), self.ctx.world_size)
            seed_all(c.seed + rank + 1_000 * pos.step)
        self.log.info("resumed from %s at step %d (epoch %d, step %d of the epoch)",
                      path, pos.step, pos.epoch, pos.epoch_step)
        return pos, path
