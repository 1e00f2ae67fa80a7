"""The training loop: the plan, epochs, pre-emption, and the order of things.
The units it drives each live in their own module: one optimizer step
(steps.Stepper), checkpoints (checkpointer.Checkpointer) and evaluation
(evaluate.Evaluator).

Position is counted in optimizer steps (`step` overall, `epoch_step` within
the epoch) and, for resuming, in GLOBAL samples of the epoch (`samples`): a
resumed run, with any world size, continues at the exact global sample
(data.ResumableSampler), runs the steps its world needs for the rest of the
epochs, and scales the learning rate to its own global batch (linear
scaling rule), saying so in one log line.

After each step the ranks agree on whether to stop (signals.StopAgreement):
a stop signal takes effect after the step following the one it arrived in,
on every rank at the same step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ... import records
from ...shared.exitcodes import ExitCode
from ..checkpoint.checkpointer import Checkpointer, Position, TrainState, check_checkpoint_dir, seed_all
from ..checkpoint.last_step import LastStep, failure_reason
from ..config.values import TrainConfig
from ..data.loaders import (
    DeviceResidentLoader,
    ResumableSampler,
    build_datasets,
    data_problem,
    eval_loader,
    train_loader,
)
from ..model.build import build_model
from ..model.strategy import Parallel, make_optimizer, parallelise
from ..outputs.progress import Metrics, Progress, TrainingStatus, TrainingSummary, rank_logger
from ..outputs.rank_steps import RankStepTimes
from ..startup.clock import CLOCK, StartupClock
from ..startup.distributed import DistContext
from ..startup.launchinfo import AgentRestarts
from ..stop.faults import check_data
from ..stop.signals import StopAgreement, StopRequest, requeue_if_slurm
from ..watchdog import stall_model
from ..watchdog.liveness import watch_start_up
from .evaluate import Evaluator
from .steps import Stepper

__all__ = ["DataTooSmall", "Position", "Trainer", "TrainingPlan", "TrainingStatus", "exit_code", "make_plan", "seed_all",
           "warmup_cosine"]


class DataTooSmall(ValueError):
    pass


@dataclass
class TrainingPlan:
    steps_per_epoch: int
    total_steps: int
    global_batch: int
    lr: float
    warmup_steps: int


def _restartable(config: TrainConfig) -> bool:
    """An agent will start this rank's workers again (it has restarts left to
    give), and they resume from --checkpoint-dir: the last step is worth writing."""
    return AgentRestarts.from_env() is not None and config.checkpoint_dir is not None and not config.zero


def exit_code(status: TrainingStatus) -> int:
    return ExitCode.PREEMPTED if status is TrainingStatus.PREEMPTED else ExitCode.OK


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up from ~0 to 1 over `warmup` steps (Goyal et al., for large
    global batches), then cosine decay to 0 at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        span = max(total - warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * min(step - warmup, span) / span))
    return factor


def make_plan(config: TrainConfig, samples_per_rank: int, world_size: int) -> TrainingPlan:
    micro = samples_per_rank // config.batch_size
    steps_per_epoch = micro // config.grad_accum
    if steps_per_epoch == 0:
        raise DataTooSmall(f"each rank gets {samples_per_rank} samples per epoch, fewer than one step of "
                           f"--batch-size {config.batch_size} x --grad-accum {config.grad_accum}; "
                           "use a smaller --batch-size or more data")
    total = config.epochs * steps_per_epoch
    if config.max_steps:
        total = min(total, config.max_steps)
    global_batch = config.batch_size * config.grad_accum * world_size
    return TrainingPlan(steps_per_epoch, total, global_batch, config.lr * global_batch / config.base_batch,
                round(config.warmup_epochs * steps_per_epoch))


@dataclass
class _Counters:
    """One `Trainer.run`'s counters from its start or resume, for the throughput figures and the save-once rule."""

    t0: float
    start_step: int
    saved_at: int = -1
    trained_at: float | None = None  # the clock at the last step this run trained

    def images_per_s(self, step: int, global_batch: int) -> float:
        """Images trained per second, start to the last step: the figure the
        progress line shows and the summary repeats (not diluted by the final
        evaluation and checkpoint, which the summary's time includes)."""
        end = self.trained_at if self.trained_at is not None else self.t0
        return (step - self.start_step) * global_batch / max(end - self.t0, 1e-9)


class Trainer:
    def __init__(self, config: TrainConfig, ctx: DistContext, stop: StopRequest | None = None,
                 clock: StartupClock = CLOCK) -> None:
        self.config, self.ctx, self.clock = config, ctx, clock
        self.rank, self.world = ctx.rank, ctx.world_size
        self.distributed = bool(ctx.distributed)
        self.device: torch.device = ctx.device
        self.log = rank_logger(self.rank, config.log_dir)
        # Until the first step, a rank that moves (a slow checkpoint read, a long model build) is
        # slow, not stuck: its signs of life keep the ranks that wait for it from a stall verdict.
        watch_start_up()
        check_checkpoint_dir(config, ctx, self.distributed)  # before anything slow
        seed_all(config.seed)  # identical initial weights on every rank
        if config.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest kernels
        model = build_model(config.model, config.num_classes, config.image_size)
        # DDP's wrap broadcasts rank 0's parameters: here a rank waits for every other rank's start-up,
        # so the hang watchdog judges it and names a rank still in setup (a hung read, a lock).
        with stall_model.in_phase(stall_model.Phase.SYNC):
            self.par: Parallel = parallelise(model, config, self.device, ctx.local_rank, self.world,
                                             self.distributed)
        clock.mark("model_built")
        self._build_data()
        clock.mark("data_built")
        self.plan = make_plan(config, len(self.sampler), self.world)
        optimizer = make_optimizer(list(self.par.raw.parameters()), config, self.plan.lr, self.distributed)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine(self.plan.warmup_steps, self.plan.total_steps))
        scaler = torch.amp.GradScaler(self.device.type, enabled=config.precision == "fp16")
        self.stepper = Stepper(config, self.par, self.device, optimizer, scheduler, scaler, self.rank)
        self.metrics = Metrics(config.metrics, enabled=self.rank == 0, tensorboard=config.tensorboard)
        self.evaluator = Evaluator(self.par, self.test_loader, self.distributed, self.device,
                                   self.stepper.autocast, config.channels_last, self.metrics, self.log)
        self.checkpointer = Checkpointer(config, ctx, self.distributed,
                                         TrainState(self.par, optimizer, scheduler, scaler), self.metrics, self.log)
        # Installed by the caller before start-up when given, so a pre-emption
        # signal during the rank report or model build is not fatal.
        self.stop = stop or StopRequest()
        # may create a process group: every rank gets here at the same point
        self.agreement = StopAgreement.for_run(self.stop, self.distributed)
        self.pos, self.resumed_from, saved_batch = self.checkpointer.resume(self.plan.global_batch)
        self.last_step = LastStep(self.checkpointer, self.par.raw, lambda: self.pos,
                                  enabled=_restartable(config), log=self.log, rank=self.rank)
        if self.resumed_from is not None:
            self._replan(saved_batch)
            self.metrics.write("resume", step=self.pos.step, epoch=self.pos.epoch, checkpoint=str(self.resumed_from),
                               world_size=self.world)
        self._first_step_pending = True

    def _steps_left_in_epoch(self) -> int:
        """Optimizer steps this world runs for the rest of the current epoch."""
        self.sampler.set_epoch(self.pos.epoch, start=self.pos.samples)
        return len(self.sampler) // (self.config.batch_size * self.config.grad_accum)

    def _replan(self, saved_batch: int | None) -> None:
        """After a resume: the steps left follow this world's steps per epoch, and
        the learning rate this world's global batch. The same world size changes nothing."""
        c, plan, pos = self.config, self.plan, self.pos
        total = pos.step
        if pos.epoch < c.epochs:
            total += self._steps_left_in_epoch() + (c.epochs - pos.epoch - 1) * plan.steps_per_epoch
        if c.max_steps:
            total = min(total, c.max_steps)
        if total != plan.total_steps:
            plan.total_steps = total
            self.stepper.scheduler.lr_lambdas = [warmup_cosine(plan.warmup_steps, total)]
        if saved_batch is not None and saved_batch != plan.global_batch:
            self._rescale_lr(saved_batch)

    def _rescale_lr(self, saved_batch: int) -> None:
        """Linear scaling rule: the base learning rate follows the global batch."""
        scheduler, plan = self.stepper.scheduler, self.plan
        old_lr = scheduler.base_lrs[0]
        factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
        scheduler.base_lrs = [plan.lr] * len(scheduler.base_lrs)
        for group in self.stepper.optimizer.param_groups:
            group["initial_lr"] = plan.lr
            group["lr"] = plan.lr * factor
        self.log.info("resumed with world size %d and global batch %d (checkpoint: global batch %d): "
                      "base lr %.4g -> %.4g (linear scaling), %d steps in all, continuing at global sample %d "
                      "of epoch %d", self.world, plan.global_batch, saved_batch, old_lr, plan.lr,
                      plan.total_steps, self.pos.samples, self.pos.epoch)

    # ---- set-up -------------------------------------------------------------
    def _build_data(self) -> None:
        c = self.config
        problem = None
        if c.data == "cifar10":
            from ..data.download import prepare_once

            assert c.data_dir is not None  # options.problems() requires it
            try:
                prepare_once(c.data_dir, self.ctx.local_rank, self.distributed)
            except Exception as exc:
                problem = f"could not fetch CIFAR-10 into {c.data_dir}: {exc}"
        # every rank, together: one node without the data must not leave the others waiting in a collective
        check_data(c.data, c.data_dir, problem or data_problem(c.data, c.data_dir), self.ctx.host, self.distributed)
        self.train_set, self.test_set = build_datasets(c.data, c.data_dir, c.image_size, c.num_classes,
                                                       c.synthetic_size, c.eval_size, c.seed)
        self.sampler = ResumableSampler(self.train_set, self.world, self.rank, seed=c.seed)
        self.loader: Any
        if c.gpu_resident_data:
            self.loader = DeviceResidentLoader.from_dataset(self.train_set, self.sampler, c.batch_size,
                                                            c.seed, self.par.input_device)
        else:
            self.loader = train_loader(self.train_set, self.sampler, c.batch_size, c.workers,
                                       pin=self.device.type == "cuda")
        self.test_loader = eval_loader(self.test_set, self.world, self.rank, c.batch_size, c.workers)

    # ---- the units, by their old names ------------------------------------------
    def save(self) -> Path | None:
        return self.checkpointer.save(self.pos)

    def evaluate(self) -> Any:
        return self.evaluator(self.pos.step, self.pos.epoch)

    # ---- the loop -------------------------------------------------------------------
    def run(self) -> TrainingSummary:
        c, plan = self.config, self.plan
        self.clock.mark("setup_done")
        self.stop.install()
        progress = Progress(c.progress, self.rank == 0, plan.total_steps, self.pos.step, c.log_every)
        self.log.info("plan: %d steps (%d per epoch), global batch %d, lr %.4g, warm-up %d steps",
                      plan.total_steps, plan.steps_per_epoch, plan.global_batch, plan.lr, plan.warmup_steps)
        run, status = _Counters(time.monotonic(), self.pos.step), TrainingStatus.FINISHED
        self.step_times = RankStepTimes(self.metrics, self.device, self.world, self.distributed, c.log_every,
                                        plan.total_steps, enabled=c.metrics is not None or c.tensorboard is not None)
        try:
            while self.pos.step < plan.total_steps and status is TrainingStatus.FINISHED:
                status = self._epoch(progress, run)
        except Exception as exc:
            # most often a collective whose peer died: the restart resumes from this
            self.last_step.write(failure_reason(exc))
            raise
        finally:
            progress.close()
        # Not in the finally: after an error a peer may be gone, and waiting
        # for its part of the all-reduce would last the whole timeout.
        self.agreement.finish()
        seconds = time.monotonic() - run.t0
        if status is TrainingStatus.FINISHED:
            self._finish(run)
        summary = self._summary(status, run, seconds)
        self.metrics.put(summary.record)
        self.metrics.close()
        return summary

    def _finish(self, run: _Counters) -> None:
        """The end of a finished run: the last evaluation and checkpoint, unless the last epoch just made them."""
        if self.config.eval and (self.evaluator.last is None or self.pos.epoch_step != 0):
            self.evaluate()
        if run.saved_at != self.pos.step:
            self.save()

    def _summary(self, status: TrainingStatus, run: _Counters, seconds: float) -> TrainingSummary:
        last_eval, last_ckpt, plan = self.evaluator.last, self.checkpointer.last, self.plan
        return TrainingSummary(records.Summary(
            status.value, self.pos.step, self.pos.epoch, seconds, run.images_per_s(self.pos.step, plan.global_batch),
            last_eval.accuracy if last_eval else None, last_eval.loss if last_eval else None,
            str(last_ckpt) if last_ckpt else None, self.world, plan.global_batch))

    def _start_epoch(self) -> tuple[Any, int]:
        """The epoch's batches from the current global sample on, and how many steps they make."""
        steps = self._steps_left_in_epoch()
        return iter(self.loader), steps

    def _epoch(self, progress: Progress, run: _Counters) -> TrainingStatus:
        c, plan, pos = self.config, self.plan, self.pos
        batches, steps = self._start_epoch()
        for _ in range(steps):
            if pos.step >= plan.total_steps:
                return TrainingStatus.FINISHED  # --max-steps mid-epoch
            self.step_times.begin()
            self.last_step.begin()
            loss = self.stepper.compute(batches)
            with self.last_step.advancing():
                self.stepper.update()
                pos.epoch_step += 1
                pos.step += 1
                pos.samples += plan.global_batch
            stall_model.progress(pos.step)  # the hang watchdog's pulse (attribute writes; its thread publishes)
            self.step_times.end(pos.step)  # after the pulse: a rank waiting in its gather has reported the step
            if self._first_step_pending:
                self._report_startup()
            self._show(progress, run, loss)
            if self.agreement.check():
                run.saved_at = pos.step
                return self._preempt()
            if c.checkpoint_every and pos.step % c.checkpoint_every == 0:
                self.save()
                run.saved_at = pos.step
        self._end_epoch(run)
        return TrainingStatus.FINISHED

    def _end_epoch(self, run: _Counters) -> None:
        self.pos.epoch += 1
        self.pos.epoch_step = 0
        self.pos.samples = 0
        if self.config.eval:
            self.evaluate()
        if run.saved_at != self.pos.step:
            self.save()
            run.saved_at = self.pos.step

    def _show(self, progress: Progress, run: _Counters, loss: torch.Tensor) -> None:
        pos, plan = self.pos, self.plan
        run.trained_at = time.monotonic()
        ips = run.images_per_s(pos.step, plan.global_batch)
        value = loss.item() if progress.wants_loss(pos.step) else None
        progress.update(pos.step, pos.epoch, value, ips)
        if value is not None:
            self.metrics.write("train", step=pos.step, epoch=pos.epoch, loss=value, images_per_s=ips,
                               lr=self.stepper.scheduler.get_last_lr()[0])

    def _report_startup(self) -> None:
        """After this process's first step: the `startup` metrics record and one log line (rank 0)."""
        self._first_step_pending = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # once: the stamp is when the step ran, not when it was queued
        self.clock.mark("first_step_done")
        if self.rank == 0:
            self.metrics.write("startup", **self.clock.record())
            self.log.info("%s", self.clock.line())

    def _preempt(self) -> TrainingStatus:
        self.log.warning("stop signal received: checkpointing at step %d and exiting with %d",
                         self.pos.step, ExitCode.PREEMPTED)
        path = self.save()
        stopped = self.agreement.stop_record(self.pos.step, str(path) if path else None)
        self.metrics.put(stopped)
        if self.rank == 0 and not self.metrics.framed:
            records.emit(stopped)  # for the launcher's summary: stopped, checkpoint at step N (or none)
        if self.rank == 0:
            requeue_if_slurm(self.agreement.signum, lambda line: self.log.warning("%s", line))
        return TrainingStatus.PREEMPTED
