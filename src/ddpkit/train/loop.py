"""The training loop: steps, checkpoints, pre-emption, evaluation.

Position is counted in optimizer steps: `step` overall and `epoch_step`
within the epoch. A resumed run skips the epoch_step * grad_accum * batch
samples of the epoch this rank already trained on, so it continues at the
exact sample.

After each step the ranks agree on whether to stop (signals.StopAgreement):
a stop signal takes effect after the step following the one it arrived in,
on every rank at the same step.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint as ckpt
from .data import DeviceResidentLoader, ResumableSampler, build_datasets, eval_loader, train_loader
from .evaluate import EvalResult, evaluate
from .models import build_model
from .progress import Metrics, Progress, Summary, rank_logger
from .signals import EXIT_PREEMPTED, StopAgreement, StopRequest, requeue_if_slurm
from .startup import CLOCK, StartupClock
from .strategy import Parallel, make_optimizer, parallelise

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class DataTooSmall(ValueError):
    pass


@dataclass
class Position:
    epoch: int = 0
    epoch_step: int = 0
    step: int = 0


@dataclass
class Plan:
    steps_per_epoch: int
    total_steps: int
    global_batch: int
    lr: float
    warmup_steps: int


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up from ~0 to 1 over `warmup` steps (Goyal et al., for large
    global batches), then cosine decay to 0 at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        span = max(total - warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * min(step - warmup, span) / span))
    return factor


def make_plan(args: argparse.Namespace, samples_per_rank: int, world_size: int) -> Plan:
    micro = samples_per_rank // args.batch_size
    steps_per_epoch = micro // args.grad_accum
    if steps_per_epoch == 0:
        raise DataTooSmall(f"each rank gets {samples_per_rank} samples per epoch, fewer than one step of "
                           f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum}; "
                           "use a smaller --batch-size or more data")
    total = args.epochs * steps_per_epoch
    if args.max_steps:
        total = min(total, args.max_steps)
    global_batch = args.batch_size * args.grad_accum * world_size
    return Plan(steps_per_epoch, total, global_batch, args.lr * global_batch / args.base_batch,
                round(args.warmup_epochs * steps_per_epoch))


class Trainer:
    def __init__(self, args: argparse.Namespace, ctx: Any, stop: StopRequest | None = None,
                 clock: StartupClock = CLOCK) -> None:
        self.args, self.ctx, self.clock = args, ctx, clock
        self.rank, self.world = ctx.rank, ctx.world_size
        self.distributed = bool(ctx.distributed)
        self.device: torch.device = ctx.device
        self.log = rank_logger(self.rank, args.log_dir)
        seed_all(args.seed)  # identical initial weights on every rank
        if args.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest kernels
        model = build_model(args.model, args.num_classes, args.image_size)
        self.par: Parallel = parallelise(model, args, self.device, ctx.local_rank, self.world, self.distributed)
        clock.mark("model_built")
        self._build_data()
        clock.mark("data_built")
        self.plan = make_plan(args, len(self.sampler), self.world)
        self.optimizer = make_optimizer(list(self.par.raw.parameters()), args, self.plan.lr, self.distributed)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(self.plan.warmup_steps, self.plan.total_steps))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=args.precision == "fp16")
        self.criterion = nn.CrossEntropyLoss()
        self.pos = Position()
        self.last_checkpoint: Path | None = None
        self.last_eval: EvalResult | None = None
        self.metrics = Metrics(args.metrics, enabled=self.rank == 0)
        # Installed by the caller before start-up when given, so a pre-emption
        # signal during the rank report or model build is not fatal.
        self.stop = stop or StopRequest()
        # may create a process group: every rank gets here at the same point
        self.agreement = StopAgreement.for_run(self.stop, self.distributed)
        self.resumed_from = self._resume()
        self._first_step_pending = True

    # ---- set-up -------------------------------------------------------------
    def _build_data(self) -> None:
        a = self.args
        if a.data == "cifar10":
            from .datasets_cli import prepare_once

            prepare_once(a.data_dir, self.ctx.local_rank, self.distributed)
        self.train_set, self.test_set = build_datasets(a.data, a.data_dir, a.image_size, a.num_classes,
                                                       a.synthetic_size, a.eval_size, a.seed)
        self.sampler = ResumableSampler(self.train_set, self.world, self.rank, seed=a.seed)
        if a.gpu_resident_data:
            self.loader: Any = DeviceResidentLoader.from_dataset(self.train_set, self.sampler, a.batch_size,
                                                                 a.seed, self.par.input_device)
        else:
            self.loader = train_loader(self.train_set, self.sampler, a.batch_size, a.workers,
                                       pin=self.device.type == "cuda")
        self.test_loader = eval_loader(self.test_set, self.world, self.rank, a.batch_size, a.workers)

    def _resume(self) -> Path | None:
        path = ckpt.resolve_resume(self.args.resume, self.args.checkpoint_dir)
        if path is None:
            seed_all(self.args.seed + self.rank)  # per-rank streams for anything random during training
            return None
        state = ckpt.read_checkpoint(path, map_location=self.device)
        self.par.raw.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.pos = Position(**state["position"])
        rngs = state["rng"]
        if len(rngs) == self.world:
            ckpt.set_rng_state(rngs[self.rank], self.device)
        else:
            self.log.warning("checkpoint was written by %d ranks, this run has %d: RNG streams restart",
                             len(rngs), self.world)
            seed_all(self.args.seed + self.rank + 1_000 * self.pos.step)
        self.log.info("resumed from %s at step %d (epoch %d, step %d of the epoch)",
                      path, self.pos.step, self.pos.epoch, self.pos.epoch_step)
        return path

    # ---- one optimizer step ---------------------------------------------------
    def _autocast(self) -> ContextManager:
        if self.args.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.args.precision])

    def _bn_buffers(self) -> list[torch.Tensor]:
        return [b for m in self.par.raw.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                for b in m.buffers()]

    def _backward(self, loss: torch.Tensor) -> None:
        if not self.args.activation_checkpointing:
            self.scaler.scale(loss).backward()
            return
        # recomputing a stage in backward runs its BatchNorms a second time; put
        # their running statistics back so they match a run without checkpointing
        saved = [b.clone() for b in self._bn_buffers()]
        self.scaler.scale(loss).backward()
        for buf, old in zip(self._bn_buffers(), saved):
            buf.copy_(old)

    def _step(self, batches: Any) -> torch.Tensor:
        a, par = self.args, self.par
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=par.output_device)
        for micro in range(a.grad_accum):
            x, y = next(batches)
            x = x.to(par.input_device, non_blocking=True)
            if a.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            y = y.to(par.output_device, non_blocking=True)
            # all-reduce only on the last micro-batch; the others just accumulate locally
            sync = par.no_sync() if micro < a.grad_accum - 1 else contextlib.nullcontext()
            with sync:
                with self._autocast():
                    loss = self.criterion(par.module(x), y) / a.grad_accum
                self._backward(loss)
            total += loss.detach().float()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        return total

    # ---- checkpoints ------------------------------------------------------------
    def _payload_optimizer(self) -> dict[str, Any] | None:
        if self.args.zero:
            self.optimizer.consolidate_state_dict(to=0)  # a collective: every rank takes part
            return self.optimizer.state_dict() if self.rank == 0 else None
        return self.optimizer.state_dict()

    def save(self) -> Path | None:
        if self.args.checkpoint_dir is None:
            return None
        optim_state = self._payload_optimizer()
        rng = ckpt.rng_state(self.device)
        rngs: list[Any] = [rng]
        if self.distributed:
            rngs = [None] * self.world if self.rank == 0 else []
            dist.gather_object(rng, rngs if self.rank == 0 else None, dst=0)
        path = None
        if self.rank == 0:
            payload = {"model": self.par.raw.state_dict(), "optimizer": optim_state,
                       "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                       "position": vars(self.pos).copy(), "rng": rngs, "world_size": self.world,
                       "args": {k: str(v) for k, v in vars(self.args).items()}}
            path = ckpt.write_checkpoint(self.args.checkpoint_dir, self.pos.step, payload, self.args.keep)
            self.metrics.write("checkpoint", step=self.pos.step, path=str(path))
        self._barrier()  # nobody runs ahead (or exits) before the file is complete
        self.last_checkpoint = self.args.checkpoint_dir / ckpt.checkpoint_name(self.pos.step)
        return path

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    # ---- evaluation ---------------------------------------------------------------
    def evaluate(self) -> EvalResult:
        result = evaluate(self.par.raw, self.test_loader, self.par.input_device, self.par.output_device,
                          self.distributed, self.device, self._autocast, self.args.channels_last)
        self.last_eval = result
        self.metrics.write("eval", step=self.pos.step, epoch=self.pos.epoch, accuracy=result.accuracy,
                           loss=result.loss, correct=result.correct, total=result.total)
        self.log.info("eval at step %d: accuracy %.4f (%d/%d), loss %.4f", self.pos.step, result.accuracy,
                      result.correct, result.total, result.loss)
        return result

    # ---- the loop -------------------------------------------------------------------
    def run(self) -> tuple[Summary, int]:
        a, plan = self.args, self.plan
        self.clock.mark("setup_done")
        self.stop.install()
        progress = Progress(a.progress, self.rank == 0, plan.total_steps, self.pos.step, a.log_every)
        self.log.info("plan: %d steps (%d per epoch), global batch %d, lr %.4g, warm-up %d steps",
                      plan.total_steps, plan.steps_per_epoch, plan.global_batch, plan.lr, plan.warmup_steps)
        t0, start_step, status, saved_at = time.monotonic(), self.pos.step, "finished", -1
        try:
            while self.pos.step < plan.total_steps and status == "finished":
                status, saved_at = self._epoch(progress, t0, start_step, saved_at)
        finally:
            progress.close()
        # Not in the finally: after an error a peer may be gone, and waiting
        # for its part of the all-reduce would last the whole timeout.
        self.agreement.finish()
        seconds = time.monotonic() - t0
        if status == "finished":
            if a.eval and (self.last_eval is None or self.pos.epoch_step != 0):
                self.evaluate()
            if saved_at != self.pos.step:
                self.save()
        summary = Summary(status, self.pos.step, self.pos.epoch, seconds,
                          (self.pos.step - start_step) * plan.global_batch / max(seconds, 1e-9),
                          self.last_eval.accuracy if self.last_eval else None,
                          self.last_eval.loss if self.last_eval else None,
                          str(self.last_checkpoint) if self.last_checkpoint else None, self.world, plan.global_batch)
        self.metrics.write("summary", **summary.as_dict())
        self.metrics.close()
        return summary, (EXIT_PREEMPTED if status == "preempted" else 0)

    def _epoch(self, progress: Progress, t0: float, start_step: int, saved_at: int) -> tuple[str, int]:
        a, plan, pos = self.args, self.plan, self.pos
        self.sampler.set_epoch(pos.epoch, skip=pos.epoch_step * a.grad_accum * a.batch_size)
        if hasattr(self.train_set, "set_epoch"):
            self.train_set.set_epoch(pos.epoch)
        batches = iter(self.loader)
        while pos.epoch_step < plan.steps_per_epoch and pos.step < plan.total_steps:
            loss = self._step(batches)
            pos.epoch_step += 1
            pos.step += 1
            if self._first_step_pending:
                self._report_startup()
            ips = (pos.step - start_step) * plan.global_batch / max(time.monotonic() - t0, 1e-9)
            value = loss.item() if progress.wants_loss(pos.step) else None
            progress.update(pos.step, pos.epoch, value, ips)
            if value is not None:
                self.metrics.write("train", step=pos.step, epoch=pos.epoch, loss=value, images_per_s=ips,
                                   lr=self.scheduler.get_last_lr()[0])
            if self.agreement.check():
                return self._preempt(), pos.step
            if a.checkpoint_every and pos.step % a.checkpoint_every == 0:
                self.save()
                saved_at = pos.step
        if pos.epoch_step == plan.steps_per_epoch:
            pos.epoch += 1
            pos.epoch_step = 0
            if a.eval:
                self.evaluate()
            if saved_at != pos.step:
                self.save()
                saved_at = pos.step
        return "finished", saved_at

    def _report_startup(self) -> None:
        """After this process's first step: the `startup` metrics record and one log line (rank 0)."""
        self._first_step_pending = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # once: the stamp is when the step ran, not when it was queued
        self.clock.mark("first_step_done")
        if self.rank == 0:
            self.metrics.write("startup", **self.clock.record())
            self.log.info("%s", self.clock.line())

    def _preempt(self) -> str:
        self.log.warning("stop signal received: checkpointing at step %d and exiting with %d",
                         self.pos.step, EXIT_PREEMPTED)
        self.save()
        if self.rank == 0:
            note = requeue_if_slurm()
            if note:
                self.log.warning(note)
        return "preempted"
