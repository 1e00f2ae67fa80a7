"""The trainer's checkpoints: what a save gathers from every rank and writes
(on rank 0), and what a resume puts back. File handling (atomic writes,
rotation, `latest`) is checkpoint_files.py's."""

from __future__ import annotations

import logging
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config.values import TrainConfig
from ..model.strategy import Parallel
from ..outputs.progress import Metrics
from ..startup.distributed import DistContext
from ..stop.faults import CheckpointDirError, ResumeMismatch, agree, hosts_named
from ..watchdog.stall_model import Phase, mark
from . import files as ckpt


@dataclass
class Position:
    """Where training stands: `step` optimizer steps overall, `epoch_step`
    within the epoch, and `samples`, the GLOBAL samples of this epoch already
    trained on (all ranks together), which is what a resume continues from:
    it means the same for any world size or batch."""

    epoch: int = 0
    epoch_step: int = 0
    step: int = 0
    samples: int = 0

    @classmethod
    def from_saved(cls, saved: dict[str, int], global_batch: int) -> Position:
        """A checkpoint's position; files from before `samples` counted steps only."""
        samples = saved.get("samples", saved["epoch_step"] * global_batch)
        return cls(saved["epoch"], saved["epoch_step"], saved["step"], samples)


@dataclass(frozen=True)
class ResumeChoice:
    """What rank 0 broadcasts: the checkpoint's name (in --checkpoint-dir for
    --resume auto, else the path given), its step, its fingerprint, or the
    error rank 0 met choosing it."""

    name: str | None
    step: int | None
    digest: str
    error: str | None
    host: str = ""


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _unwritable(directory: Path) -> str | None:
    """Why this process cannot write checkpoints into `directory`, or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".ddpkit-write-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
    return None


def check_checkpoint_dir(config: TrainConfig, ctx: DistContext, distributed: bool) -> None:
    """Before training: every rank that writes checkpoints (rank 0) can write
    --checkpoint-dir. Every rank learns the outcome at once (a collective), so
    a bad directory ends the job now, not at the first save an epoch later."""
    if config.checkpoint_dir is None:
        return
    problem = _unwritable(config.checkpoint_dir) if ctx.rank == 0 else None
    failures = agree(problem, ctx.host, distributed)
    if failures:
        raise CheckpointDirError(
            f"--checkpoint-dir {config.checkpoint_dir} is not writable on {hosts_named(failures)}: "
            f"{failures[0][2]}; make it writable by the job's user, or choose another --checkpoint-dir "
            "(on a filesystem every node shares, for --resume)")


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
        self.saved_world: int | None = None  # world size of the checkpoint resumed from (elastic report)
        self.global_batch = config.batch_size * config.grad_accum * ctx.world_size

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
        mark(Phase.CHECKPOINT)  # the hang watchdog gives a checkpoint write its longer limit
        optim_state = self._optimizer_state()
        rngs = self._gathered_rngs()
        mark(Phase.CHECKPOINT)
        path = None
        if self.ctx.rank == 0:
            payload = self._payload(pos, self.state.par.raw.state_dict(), optim_state, rngs)
            path = ckpt.write_checkpoint(directory, pos.step, payload, self.config.keep)
            self.metrics.write("checkpoint", step=pos.step, path=str(path))
        if self.distributed:
            dist.barrier()  # nobody runs ahead (or exits) before the file is complete
        self.last = directory / ckpt.checkpoint_name(pos.step)
        return path

    def save_from_memory(self, pos: Position, model: dict[str, Any], reason: str) -> Path | None:
        """One rank alone, without a collective (a peer is gone): this rank's
        state of the last completed step, which every DDP rank holds whole. Its
        own RNG state only: a restart on another world size restarts the streams anyway."""
        directory = self.config.checkpoint_dir
        if directory is None or self.config.zero:  # ZeRO: this rank holds one shard of the optimizer
            return None
        payload = self._payload(pos, model, self.state.optimizer.state_dict(), [ckpt.rng_state(self.ctx.device)])
        payload["from_memory"], payload["from_memory_rank"] = reason, self.ctx.rank
        path = ckpt.write_checkpoint(directory, pos.step, payload, self.config.keep)
        # another rank writes only where rank 0 is gone: the record goes where rank 0's would have
        metrics = self.metrics if self.ctx.rank == 0 else Metrics(self.config.metrics, enabled=True)
        metrics.write("checkpoint", step=pos.step, path=str(path), from_memory=reason)
        if metrics is not self.metrics:
            metrics.close()
        self.last = path
        return path

    def _payload(self, pos: Position, model: dict[str, Any], optim_state: dict[str, Any] | None,
                 rngs: list[Any]) -> dict[str, Any]:
        s = self.state
        return {"model": model, "optimizer": optim_state,
                "scheduler": s.scheduler.state_dict(), "scaler": s.scaler.state_dict(),
                "position": vars(pos).copy(), "rng": rngs, "world_size": self.ctx.world_size,
                "global_batch": self.global_batch, "args": self.config.as_record()}

    # ---- resume: rank 0 chooses, every rank checks the same file ---------------
    def _choose(self) -> ResumeChoice:
        """Rank 0: the checkpoint to resume from, as every rank will name it."""
        c = self.config
        try:
            path = ckpt.resolve_resume(c.resume, c.checkpoint_dir)
            if path is None:
                return ResumeChoice(None, None, "", None, self.ctx.host)
            # --resume auto: the name inside --checkpoint-dir, which each rank looks up in its own
            # --checkpoint-dir (the same path on every node when the directory is shared)
            name = path.name if c.resume == "auto" else str(path)
            return ResumeChoice(name, ckpt.step_of(path), ckpt.fingerprint(path), None, self.ctx.host)
        except (OSError, ckpt.CheckpointError) as exc:
            return ResumeChoice(None, None, "", str(exc), self.ctx.host)

    def _local_path(self, choice: ResumeChoice) -> Path:
        assert choice.name is not None
        if self.config.resume == "auto" and self.config.checkpoint_dir is not None:
            return self.config.checkpoint_dir / choice.name
        return Path(choice.name)

    def _check(self, choice: ResumeChoice) -> str | None:
        """This rank's problem with rank 0's choice, or None when it has the very same file."""
        path = self._local_path(choice)
        try:
            mine = ckpt.fingerprint(path)
        except FileNotFoundError:
            return f"{path}: no such file"
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
        if mine != choice.digest:
            return f"{path}: a different file than rank 0's (fingerprint {mine[:12]} != {choice.digest[:12]})"
        return None

    def agree_on_resume(self) -> Path | None:
        """Rank 0 picks the checkpoint (--resume auto: the latest in its --checkpoint-dir)
        and broadcasts its name, step and fingerprint; every rank checks that it
        reads the same file. Raises ResumeMismatch on every rank when one cannot."""
        choice = self._choose() if self.ctx.rank == 0 else None
        if self.distributed:
            box = [choice]
            dist.broadcast_object_list(box, src=0)
            choice = box[0]
        assert choice is not None
        if choice.error:
            # every rank raises it, as each did when it read the file itself
            raise ckpt.CheckpointError(f"rank 0 on host {choice.host}: {choice.error}")
        if choice.name is None:
            return None
        failures = agree(self._check(choice), self.ctx.host, self.distributed)
        if failures:
            _, _, detail = failures[0]
            raise ResumeMismatch(
                f"{hosts_named(failures)} cannot use the checkpoint rank 0 chose to resume from (step "
                f"{choice.step}, on host {choice.host}): {detail}; the checkpoint directory must be shared by "
                "every node, or copied to the same path on every node before resuming")
        return self._local_path(choice)

    def resume(self, world_batch: int) -> tuple[Position, Path | None, int | None]:
        """Load the checkpoint every rank agreed on, if any: (the position to
        continue from, the file, the global batch the checkpoint was trained with)."""
        c, rank = self.config, self.ctx.rank
        path = self.agree_on_resume()
        if path is None:
            seed_all(c.seed + rank)  # per-rank streams for anything random during training
            return Position(), None, None
        state = ckpt.read_checkpoint(path, map_location=self.ctx.device)
        s = self.state
        s.par.raw.load_state_dict(state["model"])
        s.optimizer.load_state_dict(state["optimizer"])
        s.scheduler.load_state_dict(state["scheduler"])
        s.scaler.load_state_dict(state["scaler"])
        old_batch = _global_batch_of(state, world_batch)
        self.saved_world = int(state["world_size"]) if "world_size" in state else None
        pos = Position.from_saved(state["position"], old_batch)
        rngs = state["rng"]
        if len(rngs) == self.ctx.world_size:
            ckpt.set_rng_state(rngs[rank], self.ctx.device)
        else:
            self.log.warning("checkpoint holds the RNG states of %d ranks, this run has %d: RNG streams restart",
                             len(rngs), self.ctx.world_size)
            seed_all(c.seed + rank + 1_000 * pos.step)
        origin = (f" (written from rank {state.get('from_memory_rank', 0)}'s memory: {state['from_memory']})"
                  if "from_memory" in state else "")
        self.log.info("resumed from %s at step %d (epoch %d, step %d of the epoch, global sample %d of the epoch)%s",
                      path, pos.step, pos.epoch, pos.epoch_step, pos.samples, origin)
        return pos, path, old_batch


def _global_batch_of(state: dict[str, Any], default: int) -> int:
    """The global batch a checkpoint was trained with (older files: from its flags and world size)."""
    if "global_batch" in state:
        return int(state["global_batch"])
    flags = state.get("args", {})
    try:
        return int(flags["batch_size"]) * int(flags["grad_accum"]) * int(state["world_size"])
    except (KeyError, ValueError):
        return default
