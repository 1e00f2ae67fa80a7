"""One optimizer step: micro-batches, mixed precision, gradient accumulation
(all-reduce only on the last micro-batch), activation-checkpointing's
BatchNorm fix-up, the scaler and the LR scheduler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager

import torch
from torch import nn

from ..config.values import TrainConfig
from ..model.strategy import Parallel
from ..watchdog.stall_model import Phase, mark
from ..watchdog.worktime import WorkTimer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


class Stepper:
    def __init__(self, config: TrainConfig, par: Parallel, device: torch.device, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LambdaLR, scaler: torch.amp.GradScaler, rank: int = 0) -> None:
        self.config, self.par, self.device = config, par, device
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.criterion = nn.CrossEntropyLoss()
        self.work = WorkTimer(par.module, par.raw, device, rank)  # this rank's own work, for the straggler judge

    def autocast(self) -> ContextManager[None]:
        if self.config.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.config.precision])

    def _bn_buffers(self) -> list[torch.Tensor]:
        return [b for m in self.par.raw.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                for b in m.buffers()]

    def _backward(self, loss: torch.Tensor) -> None:
        if not self.config.activation_checkpointing:
            self.scaler.scale(loss).backward()
            return
        # recomputing a stage in backward runs its BatchNorms a second time; put
        # their running statistics back so they match a run without checkpointing
        saved = [b.clone() for b in self._bn_buffers()]
        self.scaler.scale(loss).backward()
        for buf, old in zip(self._bn_buffers(), saved):
            buf.copy_(old)

    # One optimizer step is compute() then update(): the loop keeps a guard over
    # the update alone (train/checkpoint/last_step.py), never over the all-reduce's wait.
    def compute(self, batches: Batches) -> torch.Tensor:
        """The step's gradients over grad_accum micro-batches (forward, backward,
        all-reduce); returns the loss (on the device). The model is not changed yet."""
        c, par = self.config, self.par
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=par.output_device)
        for micro in range(c.grad_accum):
            mark(Phase.DATA)  # the hang watchdog's phases: what a stalled rank was doing
            with self.work.data():
                x, y = next(batches)
                x = x.to(par.input_device, non_blocking=True)
                if c.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                y = y.to(par.output_device, non_blocking=True)
            # all-reduce only on the last micro-batch; the others just accumulate locally
            sync = par.no_sync() if micro < c.grad_accum - 1 else contextlib.nullcontext()
            with sync:
                with self.autocast(), self.work.forward():
                    mark(Phase.FORWARD)
                    loss = self.criterion(par.module(x), y) / c.grad_accum
                mark(Phase.BACKWARD)
                with self.work.backward():
                    self._backward(loss)
            total += loss.detach().float()
        self.work.step_done()
        return total

    def update(self) -> None:
        """The optimizer, the scaler and the learning rate move on to the next step."""
        mark(Phase.OPTIMIZER)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
