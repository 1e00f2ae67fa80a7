"""Distributed evaluation that counts each test sample exactly once.

Ranks take disjoint strided shards of the test set with no padding (a
DistributedSampler would repeat samples to even the shards out), evaluate the
unwrapped model (so no collective runs per batch and uneven shard sizes
cannot hang), then all-reduce the sums.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ..model.strategy import Parallel
from ..outputs.progress import Metrics
from ..watchdog.stall_model import Phase, mark

if TYPE_CHECKING:  # for annotations only: evaluate needs no dataset code at run time
    from ..data.loaders import Sample


@dataclass(frozen=True)
class EvalResult:
    correct: int
    total: int
    loss: float  # mean cross-entropy over all samples

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader[Sample], input_device: torch.device, output_device: torch.device,
             distributed: bool, reduce_device: torch.device,
             autocast: Callable[[], AbstractContextManager[None]] | None = None,
             channels_last: bool = False) -> EvalResult:
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=output_device)  # correct, total, loss sum
    for x, y in loader:
        mark(Phase.EVAL)  # an evaluation is progress, batch by batch, for the hang watchdog
        x = x.to(input_device, non_blocking=True)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = y.to(output_device, non_blocking=True)
        with autocast() if autocast else torch.autocast(input_device.type, enabled=False):
            logits = model(x)
        sums[0] += (logits.argmax(1) == y).sum()
        sums[1] += y.numel()
        sums[2] += nn.functional.cross_entropy(logits.float(), y, reduction="sum")
    model.train(was_training)
    sums = sums.to(reduce_device)
    if distributed:
        dist.all_reduce(sums)
    correct, total, loss_sum = sums.tolist()
    return EvalResult(int(correct), int(total), loss_sum / total if total else 0.0)


class Evaluator:
    """The trainer's evaluation: runs `evaluate`, keeps the last result, and
    writes it to the metrics file and the log."""

    def __init__(self, par: Parallel, loader: DataLoader[Sample], distributed: bool, device: torch.device,
                 autocast: Callable[[], AbstractContextManager[None]], channels_last: bool,
                 metrics: Metrics, log: logging.Logger) -> None:
        self.par, self.loader, self.distributed, self.device = par, loader, distributed, device
        self.autocast, self.channels_last = autocast, channels_last
        self.metrics, self.log = metrics, log
        self.last: EvalResult | None = None

    def __call__(self, step: int, epoch: int) -> EvalResult:
        result = evaluate(self.par.raw, self.loader, self.par.input_device, self.par.output_device,
                          self.distributed, self.device, self.autocast, self.channels_last)
        self.last = result
        self.metrics.write("eval", step=step, epoch=epoch, accuracy=result.accuracy,
                           loss=result.loss, correct=result.correct, total=result.total)
        self.log.info("eval at step %d: accuracy %.4f (%d/%d), loss %.4f", step, result.accuracy,
                      result.correct, result.total, result.loss)
        return result
